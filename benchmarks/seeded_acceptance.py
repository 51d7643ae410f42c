"""Acceptance and tok/s of the draft model (k=4) and auto at temperature 0.7 / 1.0 on a code and a chat prompt."""
import json
import sys

import quickdraft
from quickdraft.api import LLM
from quickdraft.sampling import SamplingParams

side = sys.argv[1]
prompts = ["Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
           "Explain in a short paragraph why the sky is blue."]
out = {"side": side, "file": quickdraft.__file__, "runs": []}
for draft in ("qwen2.5-coder-0.5b-instruct", "auto"):
    llm = LLM("qwen2.5-coder-1.5b-instruct", draft=draft, num_draft=4 if draft != "auto" else None, max_context=2048)
    for t in (0.7, 1.0):
        for i, p in enumerate(prompts):
            for seed in (1, 2):
                r = llm.chat([{"role": "user", "content": p}], SamplingParams(temperature=t, seed=seed, max_tokens=64, ignore_eos=True))
                s = r.stats
                out["runs"].append({"draft": draft, "t": t, "prompt": i, "seed": seed, "tau": s.tau, "drafted": s.drafted,
                                    "accepted": s.accepted, "tok_s": s.tokens_per_second})
                print(side, draft, t, i, seed, f"tau {s.tau:.2f} acc {s.accepted}/{s.drafted} {s.tokens_per_second:.1f} tok/s", flush=True)
with open(f"benchmarks/results/seeded/{side}.json", "w") as f:
    json.dump(out, f, indent=1)
