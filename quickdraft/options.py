"""The engine's options, defined, defaulted, documented and checked once.

:class:`EngineOptions` holds every setting that shapes how a target is loaded, which drafter runs
and how the engine generates. Each field carries its default and, where the command line offers
it, a :class:`Flag` with its help: ``quickdraft.cli.common.add_engine_flags`` builds the argparse
flags from these (name, type, choices, default, help) and :meth:`EngineOptions.from_args` reads
them back. The Python API (``LLM(model, options)`` or ``LLM(model, draft=...)``), the CLI, the
server and the benchmark all read them from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from quickdraft.config import (
    CUDA_GRAPH_MODES,
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_PREFIX_CACHE_MB,
    DEVICES,
    DTYPE_CHOICES,
    KV_DTYPE_CHOICES,
)
from quickdraft.errors import QuickdraftError

MAX_NUM_DRAFT = 32

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """How an option is spelled on the command line. The flag is ``--`` + the field's name with
    dashes; its type is the field's (``int | None`` -> int) and its default the field's, appended
    to ``help`` as "(default: ...)"."""

    help: str  # what the option does, without its default
    short: str | None = None  # a one-letter (or two) alias: "-k"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None  # how help names a None default ("physical cores"); None: the value
    count: bool = False  # a number or 'auto' (the field's None); from_args parses it


def option(default: T, flag: Flag | None = None) -> T:
    """A field of :class:`EngineOptions` with its default and, if the CLI offers it, its flag."""
    metadata = {"flag": flag} if flag is not None else {}
    return typing.cast(T, dataclasses.field(default=default, metadata=metadata))


@dataclass(frozen=True)
class EngineOptions:
    """How a target is loaded, which drafter runs and how the engine generates. A field with a
    :class:`Flag` is a flag of every command that adds it (``quickdraft.cli.common.add_engine_flags``)."""

    # --- the drafter (quickdraft.assemble.drafters.build_drafter)
    draft: str = option("auto", Flag(
        "how to draft: auto (picks per step what pays; the model's own MTP layer where it has one), none, "
        "ngram, mtp (the checkpoint's multi-token-prediction layer, e.g. Qwen3.5's), a draft model sharing the "
        "target's tokenizer (zoo name, .gguf, folder), or an EAGLE-3 head trained for the target (folder or "
        ".safetensors), which drafts trees sized per step alongside n-gram", short="-d"))
    # None: chosen per step by the cost model
    num_draft: int | None = option(None, Flag("tokens drafted per step: a number, or auto", short="-k", count=True))
    canary: bool = True  # EAGLE-3 heads: check with a short decode at load that the head pays
    # A draft model's output head covers its draft_vocab most frequent tokens, each prompt's tokens
    # and the added / special tokens only (quickdraft.speculative.vocab), 0 = all. Any draft distribution
    # keeps speculation lossless; measured on HumanEval with Qwen2.5-Coder-0.5B drafting for 1.5B,
    # 16384 makes a draft token 26% cheaper at the same 94% acceptance (the first 32768 ids by
    # number instead: 21% cheaper, acceptance 97% -> 89%: "```" and identifiers have high ids).
    draft_vocab: int = option(DEFAULT_DRAFT_VOCAB, Flag(
        "a draft model computes logits only for its N most frequent tokens, the first N ids, the prompt's tokens "
        "and the special tokens: cheaper draft tokens, a few fewer accepted, output unchanged (0 = the whole "
        "vocabulary)", metavar="N"))
    # see DraftModelDrafter and policy.CONFIDENT_K
    draft_confidence: float = option(DEFAULT_DRAFT_CONFIDENCE, Flag(
        "a draft model ends its proposal after a token it gives probability below P: fewer wasted draft passes, "
        "output unchanged (0 = always draft k)", metavar="P"))
    # --- the target and its memory (quickdraft.loading.load.load_model, the engine)
    dtype: str = option("auto", Flag(
        "the target's compute dtype: auto = GGUF weights stay in their quantized blocks, computed by the CPU "
        "kernels (bfloat16 where they cannot build); float32 is the exact reference mode", choices=DTYPE_CHOICES))
    kv_dtype: str = option("auto", Flag(
        "KV cache element type: auto = float16 where the CPU kernels run the model (half of float32's memory "
        "and bandwidth; lossless speculation either way), else the activation dtype; float32 with --dtype "
        "float32 is the exact reference mode; q8_0 (CPU kernels' path) stores 8-bit blocks, ~half of "
        "float16's, for long contexts", choices=KV_DTYPE_CHOICES))
    max_context: int | None = option(None, Flag("KV cache length in tokens", default_text="min(model, 8192)"))
    threads: int | None = option(None, Flag("compute threads", default_text="physical cores"))
    tensor_parallel: int = option(1, Flag(
        "split the model over N processes (gloo on CPU, NCCL on GPUs); under torchrun use the same N as "
        "--nproc-per-node", short="-tp", metavar="N"))
    device: str = option("auto", Flag(
        "where the model runs: cpu, cuda (or cuda:N), or auto = cuda when there is one",
        metavar="{" + ",".join(DEVICES) + "}"))
    cuda_graphs: str = option("auto", Flag(
        "replay decode and verify passes as CUDA graphs (auto: on CUDA where the model's layers allow it)",
        choices=CUDA_GRAPH_MODES))
    # None: the default budget (config.prefix_cache_bytes)
    prefix_cache_mb: int | None = option(None, Flag(
        "host memory for earlier sequences' keys/values and drafter state: a request that begins like an "
        "earlier one (a conversation's history, a shared system prompt) computes only the rest (0 = off)",
        metavar="MB", default_text=f"{DEFAULT_PREFIX_CACHE_MB}, at most a quarter of the memory"))
    # One sequence: the engine's single KV region (CUDA graphs allowed), what LLM.generate and the
    # one-user commands need; quickdraft serve asks for auto (api.auto_concurrency).
    max_concurrency: int | None = option(1, Flag(
        "requests generated at once, in shared passes (continuous batching; each answer is bitwise what it is "
        f"alone); more wait in a FIFO queue. auto: up to {DEFAULT_MAX_CONCURRENCY}, as many as the KV memory of "
        "a context each fits in a quarter of the memory", metavar="N", count=True))

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
        """The options a subcommand's parsed arguments give (those it does not define, or leaves
        None, keep their defaults); count options (``--num-draft``, ``--max-concurrency``) take a
        number or 'auto'."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if getattr(args, f.name, None) is not None:
                values[f.name] = getattr(args, f.name)
        for name, spec in cli_options().items():
            if spec.flag.count and name in values:
                values[name] = parse_count(values[name], spec.flag_name)
        return cls(**values)


@dataclass(frozen=True)
class CliOption:
    """One :class:`EngineOptions` field as the command line offers it."""

    name: str
    flag: Flag
    default: Any  # the field's default
    value_type: Callable[[str], Any]  # what argparse converts the text to (count options: str)

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


def cli_options() -> dict[str, CliOption]:
    """Every option the command line offers, by field name, in the fields' order."""
    hints = typing.get_type_hints(EngineOptions)
    out = {}
    for f in dataclasses.fields(EngineOptions):
        flag = f.metadata.get("flag")
        if flag is not None:
            out[f.name] = CliOption(f.name, flag, f.default, str if flag.count else _scalar_type(hints[f.name]))
    return out


def _scalar_type(hint: Any) -> type:
    """``int | None`` -> int; ``str`` -> str."""
    if isinstance(hint, types.UnionType):
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    assert isinstance(hint, type), hint
    return hint


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
