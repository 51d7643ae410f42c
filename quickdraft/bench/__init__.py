"""Benchmarking: output tokens/s per user for each drafting method, or any OpenAI-compatible endpoint.

:mod:`.datasets` (prompt sets), :mod:`.metrics` (pure arithmetic on timestamps), :mod:`.runner`
(in-process and endpoint contenders, the interleaved loop), :mod:`.report` (table, JSON, Markdown,
PNG). The ``quickdraft bench`` command (:mod:`quickdraft.cli.bench`) ties them together.
"""
