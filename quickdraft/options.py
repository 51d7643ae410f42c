"""The engine's options, defined, defaulted and checked once.

:class:`EngineOptions` holds every setting that shapes how a target is loaded, which drafter runs
and how the engine generates. The Python API (``LLM(model, options)`` or ``LLM(model, draft=...)``),
the CLI (``EngineOptions.from_args``), the server and the benchmark all read them from here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from quickdraft.config import CUDA_GRAPH_MODES, DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_VOCAB
from quickdraft.errors import QuickdraftError

MAX_NUM_DRAFT = 32


@dataclass(frozen=True)
class EngineOptions:
    # --- the drafter (quickdraft.assemble.drafters.build_drafter)
    draft: str = "auto"  # auto | none | ngram | a model (zoo name, .gguf, folder) | an EAGLE-3 head
    num_draft: int | None = None  # tokens drafted per step; None = chosen per step by the cost model
    canary: bool = True  # EAGLE-3 heads: check with a short decode at load that the head pays
    # a draft model's output head covers its draft_vocab most frequent tokens, each prompt's tokens
    # and the added / special tokens only (quickdraft.speculative.vocab), 0 = all. Any draft distribution
    # keeps speculation lossless; measured on HumanEval with Qwen2.5-Coder-0.5B drafting for 1.5B,
    # 16384 makes a draft token 26% cheaper at the same 94% acceptance (the first 32768 ids by
    # number instead: 21% cheaper, acceptance 97% -> 89%: "```" and identifiers have high ids).
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    # a draft model ends its proposal after a token it gives less than this probability (0: it
    # always drafts the k asked for); see DraftModelDrafter and policy.CONFIDENT_K.
    draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE
    # --- the target and its memory (quickdraft.loading.load.load_model, the engine)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (see config.DTYPE_CHOICES)
    kv_dtype: str = "auto"  # the KV caches' element type (see config.KV_DTYPE_CHOICES)
    max_context: int | None = None  # KV length per sequence; None = min(model, 8192)
    threads: int | None = None  # compute threads; None = physical cores
    tensor_parallel: int = 1  # processes the target is split over
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    cuda_graphs: str = "auto"  # replay decode/verify passes as CUDA graphs: auto | on | off
    prefix_cache_mb: int | None = None  # host memory for earlier sequences; 0 = off, None = the default
    max_concurrency: int | None = 1  # sequences generated at once; None = auto (see api.auto_concurrency)

    def __post_init__(self) -> None:
        if self.num_draft is not None and not 1 <= self.num_draft <= MAX_NUM_DRAFT:
            raise QuickdraftError(f"--num-draft must be between 1 and {MAX_NUM_DRAFT} (or 'auto'), got {self.num_draft}")
        if self.draft_vocab < 0 or 0 < self.draft_vocab < 256:
            raise QuickdraftError(f"--draft-vocab must be 0 (the whole vocabulary) or at least 256, got {self.draft_vocab}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise QuickdraftError(
                f"--draft-confidence must be at least 0 (0: off) and below 1, got {self.draft_confidence}"
            )
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise QuickdraftError(f"--cuda-graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.tensor_parallel < 1:
            raise QuickdraftError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise QuickdraftError(f"--max-concurrency takes a number of at least 1 or 'auto', got {self.max_concurrency}")

    def replace(self, **changes: Any) -> EngineOptions:
        """These options with ``changes`` (field names; an unknown one is a QuickdraftError; None
        restores a field's default)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise QuickdraftError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
        values: dict[str, Any] = {k: fields[k].default if v is None else v for k, v in changes.items()}
        return dataclasses.replace(self, **values)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options a subcommand's parsed arguments give (those it does not define keep their
        defaults); ``--num-draft`` and ``--max-concurrency`` take a number or 'auto'."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name) and getattr(args, f.name) is not None:
                values[f.name] = getattr(args, f.name)
        if "num_draft" in values:
            values["num_draft"] = parse_count(values["num_draft"], "--num-draft")
        if "max_concurrency" in values:
            values["max_concurrency"] = parse_count(values["max_concurrency"], "--max-concurrency")
        return cls(**values)


def parse_count(value: object, flag: str) -> int | None:
    """A number, or None for 'auto' (already a number: itself)."""
    if value is None or value == "auto":
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        raise QuickdraftError(f"{flag} takes a number or 'auto', got {value!r}") from None
