"""Assembling the drafter a user asked for, above the engine: the factory (``--draft``), the
target's and draft models' pass-cost timing the cost model starts from, and the EAGLE-3 head's
load-time canary. These load models and run engines; :mod:`quickdraft.speculative` below them
holds the drafters, verification and the cost model themselves, and imports neither."""
