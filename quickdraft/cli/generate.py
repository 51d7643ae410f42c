"""``quickdraft generate PROMPT``: stream one answer to stdout; progress and stats to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from quickdraft.cli.common import add_model_args, add_sampling_args, info, load_llm, sampling_params
from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.engine import RequestStats


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Stream the model's answer to PROMPT on stdout (chat template applied "
                                   "unless --raw). Use '-' to read the prompt from stdin.")
    p.add_argument("prompt", help="the prompt text, or - for stdin")
    p.add_argument("--system", default=None, help="system message (chat template only)")
    p.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress or stats on stderr")
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = sampling_params(args)  # validate before the (slow) model load
    if args.raw and args.system:
        raise QuickdraftError("--system needs the chat template; drop --raw or --system")
    say = (lambda _m: None) if args.quiet else info
    llm = load_llm(args, say)
    if args.raw or (llm.tokenizer.chat_template is None and not args.system):
        if not args.raw:  # a base model (e.g. gemma-3-270m): there is no chat format to apply
            say("the model has no chat template; completing the prompt as plain text (as with --raw)")
        steps = llm.stream(prompt, params)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        steps = llm.stream_chat(messages, params)
    step = None
    for step in steps:
        sys.stdout.write(step.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if step is not None:
        say(format_stats(step.stats, step.finish_reason))
    return 0


def format_stats(stats: RequestStats, finish_reason: str | None) -> str:
    line = (f"[{stats.output_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s, "
            f"first token {stats.ttft:.2f} s, prompt {stats.prompt_tokens} tokens "
            f"({stats.cached_tokens} cached), finish: {finish_reason}")
    if stats.drafted:
        line += (f", drafter {stats.drafter}: tau {stats.tau:.2f}, "
                 f"acceptance {100 * stats.acceptance_rate:.0f}% ({stats.accepted}/{stats.drafted})")
    return line + "]"
