"""What the subcommands that load a model and generate share: their flags (the engine's built from
quickdraft.options, so each default and help text is written once), loading, progress lines."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from quickdraft.options import EngineOptions, cli_options
from quickdraft.sampling import SamplingParams

if TYPE_CHECKING:
    from quickdraft.api import LLM
    from quickdraft.speculative.base import Drafter

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


ENGINE_MODEL_FLAGS = ("dtype", "max_context", "kv_dtype", "threads", "prefix_cache_mb", "device", "cuda_graphs",
                      "tensor_parallel")
ENGINE_DRAFT_FLAGS = ("draft", "num_draft", "draft_vocab", "draft_confidence")
_UNSET = object()


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model and every engine option, as generate, chat, selftest and serve take them."""
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="zoo name (quickdraft models list), .gguf file, Hugging Face folder or hub id "
                        f"(default: {DEFAULT_MODEL})")
    add_engine_flags(g, ENGINE_MODEL_FLAGS)
    add_engine_flags(p.add_argument_group("speculative decoding (lossless)"), ENGINE_DRAFT_FLAGS)


def add_engine_flags(
    g: argparse._ArgumentGroup, names: Sequence[str], defaults: Mapping[str, object] | None = None
) -> None:
    """Add the flags of these :class:`~quickdraft.options.EngineOptions` fields to ``g``, each as
    options.py defines it (name, alias, type, choices, default, help). ``defaults``: a command's
    own default for a field, where it differs from the engine's (None = auto for count options)."""
    specs = cli_options()
    for name in names:
        spec = specs[name]
        own = (defaults or {}).get(name, _UNSET)
        value = spec.default if own is _UNSET else own
        shown = spec.flag.default_text if value is None and spec.flag.default_text else value
        if spec.flag.count and value is None:
            value = shown = "auto"
        text = spec.flag.help  # "... (0 = off)" -> "... (0 = off; default: X)"
        text = f"{text[:-1]}; default: {shown})" if text.endswith(")") else f"{text} (default: {shown})"
        flags = [spec.flag_name] + ([spec.flag.short] if spec.flag.short else [])
        g.add_argument(*flags, type=spec.value_type, default=value, choices=spec.flag.choices,
                       metavar=spec.flag.metavar, help=text.replace("%", "%%"))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 512) -> None:
    """The sampling flags, defaulting to :class:`SamplingParams`' own defaults (``max_tokens``: the
    command's)."""
    d = SamplingParams()
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=max_tokens, help=f"tokens to generate at most (default: {max_tokens})")
    g.add_argument("--temperature", "-t", type=float, default=d.temperature, help=f"0 = greedy (default: {d.temperature:g})")
    g.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    g.add_argument("--top-p", type=float, default=d.top_p, help="1 = off")
    g.add_argument("--min-p", type=float, default=d.min_p, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("--seed", type=int, default=d.seed, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=list(d.stop), help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def load_llm(args: argparse.Namespace, say: Callable[[str], None]) -> LLM:
    from quickdraft.api import LLM
    options = EngineOptions.from_args(args)
    say(f"loading {args.model} ...")
    llm = LLM(args.model, options, log=say)
    cfg = llm.target.config
    say(f"loaded in {llm.target.load_seconds:.1f} s ({llm.target.path}): {cfg.model_type}, {cfg.layer_pattern()}; "
        f"drafter: {describe_drafter(llm.drafter)}")
    for note in llm.target.model.load_notes:
        say(note)
    return llm


def info(msg: str) -> None:
    """Progress and statistics go to stderr so stdout stays pipe-friendly."""
    print(msg, file=sys.stderr, flush=True)


def describe_drafter(drafter: Drafter | None) -> str:
    """The drafter as the start-up line names it: "auto (ngram, draft)" for one that chooses."""
    if drafter is None:
        return "none"
    parts = drafter.parts()
    return f"{drafter.name} ({', '.join(p.name for p in parts)})" if parts else drafter.name
