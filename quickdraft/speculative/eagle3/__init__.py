"""EAGLE-3 draft heads (Li et al. 2025, arXiv 2503.01840): one decoder layer that drafts from the
target's own hidden states.

``head``: the module (inference and training forward); ``io``: reading and writing the public file
layouts (and what they are, with sources); ``drafter``: the Drafter that proposes chains and EAGLE-2
dynamic trees sized by a cost model. Wiring (``--draft HEAD``, ``LLM(model, draft=HEAD)``) and the
load-time canary (that a head pays for its target) are in ``quickdraft.assemble``.
"""
