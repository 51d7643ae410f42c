"""Options shared by the subcommands that load a model and generate."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

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
from quickdraft.sampling import SamplingParams

if TYPE_CHECKING:
    from quickdraft.api import LLM
    from quickdraft.speculative.base import Drafter

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="zoo name (quickdraft models list), .gguf file, Hugging Face folder or hub id "
                        f"(default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto (default): GGUF weights stay in their quantized blocks, computed by the CPU "
                        "kernels (bfloat16 where they cannot build); float32 is the exact reference mode")
    g.add_argument("--max-context", type=int, default=None, help="KV cache length in tokens (default: min(model, 8192))")
    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                   help="KV cache element type: auto (default) = float16 where the CPU kernels run the model "
                        "(half of float32's memory and bandwidth; lossless speculation either way), else the "
                        "activation dtype; float32 with --dtype float32 is the exact reference mode; q8_0 "
                        "(CPU kernels' path) stores 8-bit blocks, ~half of float16's, for long contexts")
    g.add_argument("--threads", type=int, default=None, help="compute threads (default: physical cores)")
    g.add_argument("--prefix-cache-mb", type=int, default=None, metavar="MB",
                   help="host memory for earlier sequences' keys/values and drafter state: a request that "
                        "begins like an earlier one (a conversation's history, a shared system prompt) "
                        f"computes only the rest (0 = off; default: {DEFAULT_PREFIX_CACHE_MB}, at most a "
                        "quarter of the memory)")
    add_device_args(g)
    g.add_argument("--tensor-parallel", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N processes (gloo on CPU, NCCL on GPUs); under torchrun "
                        "use the same N as --nproc-per-node (default: 1)")
    g = p.add_argument_group("speculative decoding (lossless)")
    g.add_argument("--draft", "-d", default="auto",
                   help="auto (default: picks per step what pays; the model's own MTP layer where it has one), "
                        "none, ngram, mtp (the checkpoint's multi-token-prediction layer, e.g. Qwen3.5's), a draft "
                        "model sharing the target's tokenizer (zoo name, .gguf, folder), or an EAGLE-3 head trained for "
                        "the target (folder or .safetensors; drafts trees sized per step, alongside n-gram)")
    g.add_argument("--num-draft", "-k", default="auto", help="tokens drafted per step: a number, or auto (default)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="a draft model computes logits only for its N most frequent tokens, the first N ids, the prompt's "
                        "tokens and the special tokens: cheaper draft tokens, a few fewer accepted, output "
                        f"unchanged (0 = the whole vocabulary; default: {DEFAULT_DRAFT_VOCAB})")
    g.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                   help="a draft model ends its proposal after a token it gives probability below P: fewer "
                        f"wasted draft passes, output unchanged (0 = always draft k; default: {DEFAULT_DRAFT_CONFIDENCE})")


def add_device_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--device", default="auto", metavar="{" + ",".join(DEVICES) + "}",
                   help="where the model runs: cpu, cuda (or cuda:N), or auto = cuda when there is one (default)")
    g.add_argument("--cuda-graphs", default="auto", choices=CUDA_GRAPH_MODES,
                   help="replay decode and verify passes as CUDA graphs (auto: on CUDA where the model's "
                        "layers allow it; default)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 512) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=max_tokens, help=f"tokens to generate at most (default: {max_tokens})")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
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
    from quickdraft.options import EngineOptions

    options = EngineOptions.from_args(args)
    say(f"loading {args.model} ...")
    llm = LLM(args.model, options, log=say)
    cfg = llm.target.config
    say(f"loaded in {llm.target.load_seconds:.1f} s ({llm.target.path}): {cfg.model_type}, {cfg.layer_pattern()}; "
        f"drafter: {describe_drafter(llm.drafter)}")
    for note in llm.target.model.load_notes:
        say(note)
    return llm


def add_concurrency_arg(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-concurrency", default="auto", metavar="N",
                   help="requests generated at once, in shared passes (continuous batching; each answer is "
                        "bitwise what it is alone); more wait in a FIFO queue (auto, the default: up to "
                        f"{DEFAULT_MAX_CONCURRENCY}, as many as the KV memory of a context each fits in a quarter of the memory)")


def info(msg: str) -> None:
    """Progress and statistics go to stderr so stdout stays pipe-friendly."""
    print(msg, file=sys.stderr, flush=True)


def describe_drafter(drafter: Drafter | None) -> str:
    """The drafter as the start-up line names it: "auto (ngram, draft)" for one that chooses."""
    if drafter is None:
        return "none"
    parts = drafter.parts()
    return f"{drafter.name} ({', '.join(p.name for p in parts)})" if parts else drafter.name
