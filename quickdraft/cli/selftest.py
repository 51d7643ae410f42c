"""``quickdraft selftest``: prove losslessness on the user's own model, drafter and machine.

1. Greedy: speculative output equals plain output token for token, for the configured drafter
   and for each underlying drafter at a fixed k. The plain run's speed is set against this
   machine's measured read bandwidth (the decode roofline: bytes read per token x tokens/s).
2. Sampling: at a real position of the user's prompt, the first token emitted by the rejection
   sampler (target p and the drafter's q, temperature > 0) follows p: its total variation from p
   over many trials must be as small as that of direct samples from p.
Exit status 0 when every check passes, 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import torch

from quickdraft.cli.common import add_model_args, info, load_llm
from quickdraft.roofline import roofline
from quickdraft.sampling import SamplingParams, probs_from_logits, process_logits, sample_at

if TYPE_CHECKING:
    from quickdraft.api import LLM
    from quickdraft.speculative.base import Drafter

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, then a version with memoization.",
    "List five facts about the Moon, one per line, each line starting with 'Fact:'.",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="check that speculative decoding is lossless on your setup",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=None, help="prompt to test (repeatable)")
    p.add_argument("--max-tokens", "-n", type=int, default=64)
    p.add_argument("--trials", type=int, default=20000, help="draws for the sampling distribution check")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    llm = load_llm(args, info)
    if llm.drafter is None:
        info("--draft none: nothing to test; pick --draft auto, ngram or a draft model")
        return 1
    for _label, d, _k in _drafters(llm):
        if d.variant:  # an EAGLE-3 head: which of the published variants it runs
            print(f"drafter {d.name}: head variant: {d.variant}", flush=True)
    prompts = args.prompt or list(PROMPTS)
    ok = all([_greedy_check(llm, p, args.max_tokens) for p in prompts])
    ok = _seeded_check(llm, prompts[0], args.max_tokens) and ok
    ok = _distribution_check(llm, prompts[0], args.trials) and ok
    print("selftest: PASS (lossless)" if ok else "selftest: FAIL", flush=True)
    return 0 if ok else 1


def _drafters(llm: LLM) -> list[tuple[str, Drafter, int]]:
    """(label, drafter, k): the configured one, then each underlying drafter at a fixed k = 4."""
    assert llm.drafter is not None  # (run() returns first without one)
    out = [(f"{llm.drafter.name} (k={llm.num_draft})", llm.drafter, llm.num_draft)]
    for part in llm.drafter.parts():
        out.append((f"{part.name} (k=4)", part, 4))
    return out


def _greedy_check(llm: LLM, prompt: str, max_tokens: int) -> bool:
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain_steps = list(llm.engine.generate(ids, params))
    plain = [t for s in plain_steps for t in s.token_ids]
    plain_stats = plain_steps[-1].stats
    if plain_stats.tokens_per_second > 0:  # where plain decoding stands against the memory bandwidth
        context = len(ids) + len(plain) // 2
        print(roofline(llm.target.model, plain_stats.tokens_per_second, context).line(), flush=True)
    return _each_drafter_matches(llm, ids, params, plain, "greedy")


def _each_drafter_matches(llm: LLM, ids: list[int], params: SamplingParams, plain: list[int], what: str) -> bool:
    """Every drafter's output for ``ids`` equals ``plain``, token for token; one line each."""
    ok = True
    for label, drafter, k in _drafters(llm):
        steps = list(llm.engine.generate(ids, params, drafter, k))
        spec = [t for s in steps for t in s.token_ids]
        stats = steps[-1].stats
        same = spec == plain
        ok &= same
        where = "" if same else f" first difference at token {_first_diff(plain, spec)}"
        print(f"{what:7s} {label:22s} {'identical' if same else 'MISMATCH'} over {len(plain)} tokens "
              f"(drafted {stats.drafted}, accepted {stats.accepted}, tau {stats.tau:.2f}){where}", flush=True)
    return ok


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _seeded_check(llm: LLM, prompt: str, max_tokens: int) -> bool:
    """Seeded sampling: every drafter's answer is plain sampling's, token for token."""
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=0.8, top_k=40, seed=1234, max_tokens=max_tokens, ignore_eos=True)
    plain = [t for s in llm.engine.generate(ids, params) for t in s.token_ids]
    return _each_drafter_matches(llm, ids, params, plain, "seeded")


def _distribution_check(llm: LLM, prompt: str, trials: int) -> bool:
    """The position-keyed draw follows p: the first token drawn at ``trials`` positions (each with
    its own random numbers) against the real p, next to torch's own sampler."""
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=2)
    ids = torch.tensor(llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    model = llm.target.model
    logits, _ = model(ids, model.new_cache(), num_logits=1)
    empty = torch.empty(0, dtype=torch.long)
    p = probs_from_logits(process_logits(logits, params, ids, empty))[0]  # [V]
    support = torch.nonzero(p > 0).squeeze(1)  # exact: outside it p = 0 and nothing is drawn
    ps = p[support]
    keyed = sample_at(ps.expand(trials, -1), 1234, range(trials))  # [N]
    direct = torch.multinomial(ps, trials, replacement=True, generator=torch.Generator().manual_seed(1234))
    tv_keyed, tv_direct = _tv(keyed, ps), _tv(direct, ps)
    ok = tv_keyed <= 2 * tv_direct + 0.01
    print(f"sampling first-token TV to p: position-keyed {tv_keyed:.4f}, torch.multinomial {tv_direct:.4f} "
          f"over {trials} trials ({len(support)} tokens in play): {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    hist = torch.bincount(samples, minlength=p.shape[0]).float() / samples.numel()
    return 0.5 * float((hist - p).abs().sum())


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace()))
