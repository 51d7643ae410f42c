"""Load-time canary: does this EAGLE-3 head actually draft well for this target?

A head trained for another model of the same shape, read with the wrong aux layer convention, or
simply untrained loads without any shape error and then drafts garbage: every step pays for the
head and the wider verify pass and gains nothing. So after loading we decode a few dozen tokens
greedily with the head as a fixed chain drafter and measure tau (tokens per target pass). A
working head gives tau well above 2; a useless one about 1. Below MIN_TAU the factory warns loudly
and uses the next drafter instead.

Greedy speculative decoding is lossless, so the canary's text is exactly what plain decoding would
produce; only its speed tells the head's quality. It runs on its own small KV cache.
"""

from __future__ import annotations

from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter, TreeShape
from quickdraft.speculative.eagle3.head import Eagle3Head
from quickdraft.speculative.policy import TargetCost
from quickdraft.tokenizer import Tokenizer

MIN_TAU = 1.3
CANARY_TOKENS = 48
CANARY_CHAIN = 5  # drafted tokens per step
CANARY_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def canary_prompt(tokenizer: Tokenizer) -> list[int]:
    try:
        return tokenizer.encode_chat([{"role": "user", "content": CANARY_PROMPT}], add_generation_prompt=True)
    except QuickdraftError:  # no chat template: plain text
        return tokenizer.encode(CANARY_PROMPT)


def canary_tau(target: LoadedModel, head: Eagle3Head, tokens: int = CANARY_TOKENS) -> float:
    """tau of a short greedy decode with ``head`` drafting fixed chains of CANARY_CHAIN tokens."""
    model = target.model
    prompt = canary_prompt(target.tokenizer)
    length = min(model.max_len, len(prompt) + tokens + CANARY_CHAIN + 2)
    if len(prompt) >= length - 2:
        prompt = prompt[-(length // 2) :]
    drafter = Eagle3Drafter(
        head, model, mode="chain", shape=TreeShape(1, CANARY_CHAIN, CANARY_CHAIN),
        cost=TargetCost({1: 1.0}), head_seconds=0.0, policy=False,
    )
    engine = Engine(model, target.tokenizer, max_len=length)  # a small cache of its own
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    stats = None
    for step in engine.generate(prompt, params, drafter, CANARY_CHAIN):
        stats = step.stats
    return stats.tau if stats is not None and stats.target_passes else 0.0
