"""Run by tests/test_tp.py in a subprocess: one model, plain or tensor-parallel, prints JSON results.

    python tests/tp_run.py MODEL_DIR TP
"""

from __future__ import annotations

import json
import sys

import torch

from quickdraft.api import LLM
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter


def main() -> None:
    folder, tp = sys.argv[1], int(sys.argv[2])
    llm = LLM(folder, draft="none", dtype="float32", tensor_parallel=tp, threads=2, max_context=256)
    model = llm.target.model
    ids = torch.tensor(llm.tokenizer.encode("def fibonacci(n): return n if n < 2 else"))
    cache = model.new_cache()
    prefill, _ = model(ids, cache)
    # a pass over 3 candidate rows, then keep rows 0 and 2 (what a tree step's compact does)
    start = cache.length
    model(torch.tensor([5, 6, 7]), cache)
    cache.compact(start, torch.tensor([0, 2]))
    after, _ = model(torch.tensor([9]), cache)
    prompt = "def fibonacci(n):"
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = llm.generate([prompt], params)[0].token_ids
    llm.drafter, llm.num_draft = NGramDrafter(), 4
    spec = llm.generate([prompt], params)[0]
    print(json.dumps({
        "prefill": prefill.tolist(), "after_compact": after.tolist(),
        "plain": plain, "ngram": spec.token_ids, "accepted": spec.stats.accepted,
    }))


if __name__ == "__main__":
    main()
