"""The prepared GPU check: runs quickdraft's CUDA path end to end in a few minutes.

For sessions that are lent a GPU (see scripts/gpu_check.sh, which sets up the machine and calls
this). Every section is independent: a failure is recorded and the next section still runs, and
everything lands in one JSON file. Runs on CPU too (``--device cpu --quick``) so the script
itself is tested where there is no GPU.

Sections:
  correctness  tiny random models (llama, qwen2, qwen3 and the MoE types quickdraft has):
               CUDA fp32 logits vs CPU fp32 logits; greedy output of plain vs n-gram vs draft-model
               speculative decoding on the device (must be identical: lossless)
  api          LLM(...).generate on the device: greedy identical across draft none / ngram / a draft
               model, streaming == generate, seeded sampling with penalties repeats itself
  ggml         GGUF blocks (Q4_0/Q8_0/Q4_K/Q6_K...) kept quantized on the device (torch reference
               path) vs the CPU kernels / reference on the same random weights
  passes       a random model with Qwen2.5-Coder-1.5B's shape in bf16: time of 1..64-row passes
               (the cost model's input: how many drafted tokens a verification can afford on a GPU)
               and plain decode tokens/s, eager vs torch.compile
  graphs       CUDA graphs for decode/verify passes: greedy output with them == without (plain,
               n-gram) on tiny models, and 1..16-row pass times eager vs replayed at 1.5B shape
  fp8          FP8Linear (E4M3, per-channel scales) on the device: torch._scaled_mm where the
               GPU has FP8 (sm89+) vs dequantizing, error vs bf16, time at 1/8/64 rows
  tp           tensor parallelism over NCCL when the machine has >= 2 GPUs

    python benchmarks/gpu_check.py --out gpu_check.json            # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --quick --out x.json  # dry run here
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/tiny.py builds the tiny random checkpoints

from quickdraft.engine import Engine  # noqa: E402
from quickdraft.loading.load import load_model  # noqa: E402
from quickdraft.sampling import SamplingParams  # noqa: E402

QWEN15B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2, head_dim=128, rope_theta=1e6,
               tie_word_embeddings=True, attention_bias=True)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def greedy(
    model: Any, tokenizer: Any, prompt: list[int], n: int, drafter: Any = None, k: int = 0, cuda_graphs: str = "auto"
) -> tuple[list[int], float]:
    engine = Engine(model, tokenizer, cuda_graphs=cuda_graphs)
    out: list[int] = []
    step = None
    for step in engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True), drafter, k):
        out += step.token_ids
    assert step is not None
    return out, step.stats.tau


# ------------------------------------------------------------------------------------ sections


def check_correctness(device: str, quick: bool) -> dict[str, Any]:
    from tiny import make_tiny_hf_model

    from quickdraft.config import model_types
    from quickdraft.speculative.draft_model import DraftModelDrafter
    from quickdraft.speculative.ngram import NGramDrafter

    archs = ["llama", "qwen2", "qwen3"] + [a for a in ("mixtral", "qwen3_moe", "qwen2_moe") if a in model_types()]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs[:2] if quick else archs:
            try:
                folder = make_tiny_hf_model(Path(tmp), arch)
                draft_folder = make_tiny_hf_model(Path(tmp), arch, seed=1, num_hidden_layers=1, name=f"{arch}-draft")
            except Exception as exc:  # this transformers may lack the architecture
                out[arch] = {"skipped": f"{type(exc).__name__}: {exc}"}
                continue
            cpu = load_model(str(folder), dtype="float32", device="cpu", max_context=256)
            dev = load_model(str(folder), dtype="float32", device=device, max_context=256)
            ids = torch.arange(3, 40)
            ref, _ = cpu.model(ids, cpu.model.new_cache())
            got, _ = dev.model(ids.to(device), dev.model.new_cache())
            prompt = cpu.tokenizer.encode("def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2)")
            plain, _ = greedy(dev.model, dev.tokenizer, prompt, 48)
            ngram, tau_ngram = greedy(dev.model, dev.tokenizer, prompt, 48, NGramDrafter(), 4)
            draft = load_model(str(draft_folder), dtype="float32", device=device, max_context=256)
            drafted, tau_draft = greedy(dev.model, dev.tokenizer, prompt, 48,
                                        DraftModelDrafter(draft.model, dev.config.vocab_size), 4)
            out[arch] = {
                "max_abs_logit_diff_vs_cpu": float((got.cpu() - ref).abs().max()),
                "ngram_identical": ngram == plain, "ngram_tau": tau_ngram,
                "draft_model_identical": drafted == plain, "draft_model_tau": tau_draft,
            }
    return out


def check_api(device: str, quick: bool) -> dict[str, Any]:
    """The user's path on the device: LLM(...).generate with draft none / ngram / a draft model, greedy
    (all identical) and seeded sampling with penalties (runs; same seed, same drafter: same answer)."""
    from tiny import make_tiny_hf_model

    from quickdraft.api import LLM

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_tiny_hf_model(Path(tmp), "qwen2"))
        draft_folder = str(make_tiny_hf_model(Path(tmp), "qwen2", seed=1, num_hidden_layers=1, name="qwen2-draft"))
        prompt = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2)"
        greedy_params = SamplingParams(max_tokens=40, ignore_eos=True)
        sampled = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7,
                                 repetition_penalty=1.1, frequency_penalty=0.2)
        answers: dict[str, Any] = {}
        for name, draft in (("none", "none"), ("ngram", "ngram"), ("draft_model", draft_folder)):
            llm = LLM(folder, draft=draft, dtype="float32", device=device, max_context=256)
            answers[name] = llm.generate(prompt, greedy_params)[0].token_ids
            first = llm.generate(prompt, sampled)[0].token_ids
            again = llm.generate(prompt, sampled)[0].token_ids
            streamed = [t for step in llm.stream(prompt, greedy_params) for t in step.token_ids]
            out[name] = {"greedy_identical_to_none": answers[name] == answers["none"],
                         "stream_identical": streamed == answers[name],
                         "sampled_tokens": len(first), "same_seed_same_answer": first == again}
    return out


def check_ggml(device: str, quick: bool) -> dict[str, Any]:
    import gguf
    from test_kernels import random_raw  # random valid blocks (finite fp16 scale fields)

    from quickdraft.quant.ggml import GGMLLinear

    out: dict[str, Any] = {}
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
        qtype = gguf.GGMLQuantizationType[name]
        raw = torch.from_numpy(random_raw(qtype, 256, 1024))
        cpu = GGMLLinear(qtype, raw.clone(), 1024)
        dev = GGMLLinear(qtype, raw.clone(), 1024).to(device)
        x = torch.randn(8, 1024)
        ref = cpu(x)
        got = dev(x.to(device)).cpu()
        out[name] = {"max_abs_diff": float((got - ref).abs().max()), "ref_max": float(ref.abs().max())}
    return out


def random_model(device: str, dtype: torch.dtype, quick: bool) -> Any:
    from quickdraft.config import ModelConfig
    from quickdraft.models import build_model

    shape = dict(QWEN15B)
    if quick:
        shape.update(num_hidden_layers=2, vocab_size=4096)
    cfg = ModelConfig(**shape)  # type: ignore[arg-type]
    with torch.device("meta"):
        model = build_model(cfg, 2048)
    model.materialize(device, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def check_passes(device: str, quick: bool, compile_model: bool = False) -> dict[str, Any]:
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = random_model(device, dtype, quick)
    new_cache = model.new_cache
    repeats = 3 if quick else 10
    out: dict[str, Any] = {"shape": "Qwen2.5-1.5B (random weights)" if not quick else "2 layers", "dtype": str(dtype)}

    def pass_seconds(fwd: Callable[..., Any]) -> dict[int, float]:
        res = {}
        for rows in (1, 2, 4, 8, 16, 32, 64):
            cache = new_cache()
            ctx = torch.randint(0, 1000, (256,), device=device)
            fwd(ctx, cache)
            ids = torch.randint(0, 1000, (rows,), device=device)

            def once(ids: torch.Tensor = ids, cache: Any = cache) -> None:
                cache.truncate(256)
                fwd(ids, cache)

            res[rows] = timed(once, device, repeats)
        return res

    if compile_model:
        model = torch.compile(model, dynamic=True)
    eager = pass_seconds(lambda ids, cache: model(ids, cache))
    out["ms"] = {r: s * 1e3 for r, s in eager.items()}
    out["ratio_vs_1_row"] = {r: s / eager[1] for r, s in eager.items()}
    # plain greedy decode, one token per pass (random weights: the content is meaningless, the speed is not)
    n = 32 if quick else 128
    cache = new_cache()
    model(torch.randint(0, 1000, (64,), device=device), cache, num_logits=1)
    tok = torch.tensor([5], device=device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        logits, _ = model(tok, cache)
        tok = logits[-1:].argmax(-1)
    sync(device)
    out["plain_decode_tokens_per_s"] = n / (time.perf_counter() - t0)
    return out


def check_fp8(device: str, quick: bool) -> dict[str, Any]:
    from quickdraft.quant import fp8

    out: dict[str, Any] = {}
    dev = torch.device(device)
    if dev.type == "cuda":
        out["capability"] = list(torch.cuda.get_device_capability(dev))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    n, k = (1536, 8960) if not quick else (256, 512)
    w = torch.randn(n, k) * 0.02
    layer = fp8.FP8Linear.from_float(w).to(device)
    ref_w = fp8.dequantize_fp8(layer.weight.cpu(), layer.weight_scale.cpu(), layer.block).to(dtype)
    for rows in (1, 8, 64):
        x = torch.randn(rows, k, dtype=dtype, device=device)
        res: dict[str, Any] = {}
        for mode in ("weight-only", "fp8"):
            try:
                with fp8.using_activation_mode(mode):
                    y = layer(x)
                    res[f"{mode}_ms"] = timed(lambda: layer(x), device, 5 if quick else 20) * 1e3  # noqa: B023
                ref = (x.float() @ ref_w.float().to(device).T)
                res[f"{mode}_rel_err"] = float((y.float() - ref).norm() / ref.norm())
            except Exception as exc:
                res[f"{mode}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        dense = w.to(device=device, dtype=dtype)
        res["bf16_linear_ms"] = timed(lambda: torch.nn.functional.linear(x, dense), device, 5 if quick else 20) * 1e3  # noqa: B023
        out[f"rows_{rows}"] = res
    return out


def check_tp(device: str, quick: bool) -> dict[str, Any]:
    if torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        return {"skipped": "needs >= 2 GPUs (CPU tensor parallelism is covered by tests/test_tp.py)"}
    import subprocess

    from tiny import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_hf_model(Path(tmp), "qwen2")
        code = ("import sys; from quickdraft.api import LLM; from quickdraft.sampling import SamplingParams;"
                f"llm = LLM({str(folder)!r}, draft='ngram', dtype='float32', tensor_parallel=2);"
                "print(llm.generate(['def f(x):'], SamplingParams(max_tokens=24))[0].token_ids)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return {"returncode": proc.returncode, "stdout": proc.stdout[-500:], "stderr": proc.stderr[-1500:]}


def check_graphs(device: str, quick: bool) -> dict[str, Any]:
    """CUDA graphs (quickdraft/models/graphs.py): greedy output with and without them (plain,
    n-gram, a tree-drafting oracle), and decode / verify pass times, eager vs replayed."""
    from tiny import make_tiny_hf_model

    from quickdraft.models.graphs import StepGraphs
    from quickdraft.speculative.ngram import NGramDrafter

    out: dict[str, Any] = {}
    capture = torch.device(device).type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2", "qwen3")[: 1 if quick else 3]:
            loaded = load_model(str(make_tiny_hf_model(Path(tmp), arch)), dtype="float32", device=device, max_context=256)
            prompt = loaded.tokenizer.encode("def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2)")
            eager, _ = greedy(loaded.model, loaded.tokenizer, prompt, 48, cuda_graphs="off")
            engine = Engine(loaded.model, loaded.tokenizer, cuda_graphs="on")
            params = SamplingParams(max_tokens=48, ignore_eos=True)
            plain = [t for st in engine.generate(prompt, params) for t in st.token_ids]
            ngram = [t for st in engine.generate(prompt, params, NGramDrafter(), 4) for t in st.token_ids]
            g = engine.graphs
            out[arch] = {
                "graphs_on": g is not None, "disabled": g.disabled if g else None,
                "replays": g.replays if g else 0, "shapes": len(g._graphs) if g else 0,
                "plain_identical_to_eager": plain == eager, "ngram_identical_to_eager": ngram == eager,
            }
    dtype = torch.bfloat16 if capture else torch.float32
    model = random_model(device, dtype, quick)
    cache = model.new_cache()
    graphs = StepGraphs(model, cache, capture=capture)
    ctx = torch.randint(0, 1000, (256,), device=device)
    repeats = 3 if quick else 20
    times: dict[str, dict[int, float]] = {"eager_ms": {}, "graph_ms": {}}
    for rows in (1, 2, 4, 8, 16):
        ids = torch.randint(0, 1000, (rows,), device=device)
        cache.reset()
        model(ctx, cache)

        def eager_pass(ids: torch.Tensor = ids) -> None:
            cache.truncate(256)
            model(ids, cache)

        def graph_pass(ids: torch.Tensor = ids) -> None:
            cache.truncate(256)
            graphs.run(ids, None, None, (), None)

        times["eager_ms"][rows] = timed(eager_pass, device, repeats) * 1e3
        times["graph_ms"][rows] = timed(graph_pass, device, repeats) * 1e3
        cache.truncate(256)
        want, _ = model(ids, cache)
        cache.truncate(256)
        got = graphs.run(ids, None, None, (), None)
        times.setdefault("max_abs_logit_diff", {})[rows] = float((got[0] - want).abs().max()) if got else None
    out["passes"] = times
    out["speedup_1_row"] = times["eager_ms"][1] / times["graph_ms"][1]
    out["disabled"] = graphs.disabled
    return out


def check_compiled(device: str, quick: bool) -> dict[str, Any]:
    """The passes again through torch.compile (last: a failing compile can leave torch in a bad state)."""
    return check_passes(device, quick, compile_model=True)


SECTIONS = {"correctness": check_correctness, "api": check_api, "ggml": check_ggml, "passes": check_passes, "graphs": check_graphs,
            "fp8": check_fp8, "tp": check_tp, "compiled": check_compiled}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (dry run)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    report: dict[str, Any] = {
        "command": " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else platform.processor(),
    }
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = SECTIONS[name](args.device, args.quick)
        except Exception as exc:
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        report[name + "_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"== {name} ({report[name + '_seconds']} s)\n{json.dumps(report[name], indent=1, default=str)[:3000]}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
