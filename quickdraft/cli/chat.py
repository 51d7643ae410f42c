"""``quickdraft chat``: an interactive, multi-turn chat in the terminal, history kept."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from quickdraft.cli.common import add_model_args, add_sampling_args, info, load_llm, sampling_params
from quickdraft.cli.generate import format_stats
from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.api import LLM
    from quickdraft.engine import StepOutput
    from quickdraft.sampling import SamplingParams

HELP = "commands: /reset clears the history, /exit (or Ctrl-D) quits"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat", description="Chat with the model. " + HELP)
    p.add_argument("--system", default=None, help="system message")
    add_model_args(p)
    add_sampling_args(p, max_tokens=1024)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(args, info)
    info(HELP)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    while True:
        try:
            line = input("\n> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(base)
            info("history cleared")
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = _answer(llm, history, params)
        except QuickdraftError as exc:  # e.g. the conversation outgrew the context: keep the session
            history.pop()
            info(f"error: {exc} (use /reset to start over)")
            continue
        history.append({"role": "assistant", "content": answer})


def _answer(llm: LLM, history: list[dict[str, str]], params: SamplingParams) -> str:
    parts: list[str] = []
    step: StepOutput | None = None
    try:
        for step in llm.stream_chat(history, params):
            parts.append(step.text)
            sys.stdout.write(step.text)
            sys.stdout.flush()
    except KeyboardInterrupt:  # stop this answer, keep the session and what was said
        info("\n[interrupted]")
    print()
    if step is not None:
        info(format_stats(step.stats, step.finish_reason))
    return "".join(parts)
