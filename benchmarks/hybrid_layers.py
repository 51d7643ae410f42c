"""What a hybrid model's layers cost: one Gated DeltaNet (linear-attention) layer vs one gated
full-attention layer of Qwen3.5's shapes, per pass of 1 / 4 / 8 rows after a context of 128 and of
2,048 tokens; and a whole random Qwen3.5-shaped model's plain decode vs speculative decoding with an
n-gram drafter on a repetitive prompt.

No Qwen3.5 checkpoint is installable here (the pinned packages in ../shared/MODELS.md carry none),
so the weights are random (fp32, the torch path: Qwen3.5's layers have no native kernels yet).
Shapes: Qwen3.5-0.8B's (hidden 1024, 8 heads x 256 with 2 KV heads, 16 x 128 linear q/k and value
heads, intermediate 3584) unless given. Timings alternate the two layer types pass by pass, median
of ``--repeats``; then a 1-row pass of the whole model against one of an MTP head of its layout
(what ``--draft mtp`` costs per drafted token). JSON with the command and versions goes to
benchmarks/results/hybrid/.

    .venv/bin/python benchmarks/hybrid_layers.py [--layers 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft.bench.report import environment
from quickdraft.cache import HybridCache
from quickdraft.config import DEFAULT_DRAFT_VOCAB, ModelConfig
from quickdraft.engine import Engine
from quickdraft.loading.load import resolve
from quickdraft.models.forward_pass import Step, causal_mask
from quickdraft.models.qwen3_5 import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    CausalLM,
    GatedDeltaNetFields,
)
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.tokenizer import Tokenizer

OUT = Path(__file__).parent / "results" / "hybrid"


def config(layers: int, vocab: int) -> ModelConfig:
    kinds = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(layers))
    return ModelConfig(
        model_type="qwen3_5", vocab_size=vocab, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, rope_theta=1e7, max_position_embeddings=4096,
        layer_types=kinds, partial_rotary_factor=0.25, qk_norm=True,
        family=GatedDeltaNetFields(attn_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                                   linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16),
    )


def random_model(cfg: ModelConfig, max_len: int) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(cfg, max_len)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "linear_attn" in name else 0.0))
            elif p.dim() == 1:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model.eval()


def time_layers(model: CausalLM, context: int, rows: int, repeats: int) -> dict[str, float]:
    """Median ms of one pass of ``rows`` rows through the first linear and the first full layer."""
    cfg = model.config
    cache = model.make_cache(context + rows + 1)
    x = torch.randn(context, cfg.hidden_size)
    model.prefill(torch.randint(0, cfg.vocab_size, (context,)), cache)
    layers = {kind: next(i for i, k in enumerate(cfg.layer_types or ()) if k == kind)
              for kind in (LINEAR_ATTENTION, FULL_ATTENTION)}
    times: dict[str, list[float]] = {k: [] for k in layers}
    x = torch.randn(rows, cfg.hidden_size)
    with torch.inference_mode():
        for _ in range(repeats):
            for kind, i in layers.items():
                start, _ = cache.reserve(rows)
                step = Step(positions=torch.arange(start, start + rows), start=start, mask=causal_mask(start, rows, x.device),
                            cache=cache)
                assert isinstance(cache, HybridCache)
                cache.recurrent.begin_rows(start, step.row_parents())
                layer = model.model.layers[i]
                t0 = time.perf_counter()
                layer(x, i, step)
                times[kind].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def time_mtp(model: CausalLM, context: int, repeats: int) -> tuple[float, float, float]:
    """Median ms of a 1-row pass of the whole target and of its MTP head (random weights, the
    checkpoint's layout: fc, two norms, one gated-attention layer, norm, the target's lm_head),
    and of the head with its output cut to DEFAULT_DRAFT_VOCAB tokens."""
    from quickdraft.models.gemma3 import GemmaRMSNorm
    from quickdraft.models.qwen3_5 import DecoderLayer
    from quickdraft.speculative.mtp import MTPHead

    cfg = model.config
    head = MTPHead(model, DecoderLayer(cfg, model.model.rope, linear=False, index=0), GemmaRMSNorm)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    ids = torch.randint(0, cfg.vocab_size, (context + 1,))
    cache = model.make_cache(context + 2)
    model.prefill(ids[:context], cache)
    hcache = head.new_cache(context + 2)
    feats = torch.randn(context + 1, cfg.hidden_size)
    head(feats[:context], feats[:context], hcache)
    target_ms, head_ms, cut_ms = [], [], []
    cut = MTPHead(model, DecoderLayer(cfg, model.model.rope, linear=False, index=0), GemmaRMSNorm)
    cut.load_state_dict(head.state_dict())
    cut.cut_vocab(torch.arange(DEFAULT_DRAFT_VOCAB))  # as --draft auto cuts it (--draft-vocab)
    ccache = cut.new_cache(context + 2)
    cut(feats[:context], feats[:context], ccache)
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids[context:], cache)
            target_ms.append((time.perf_counter() - t0) * 1e3)
            cache.truncate(context)
            for h, c, out in ((head, hcache, head_ms), (cut, ccache, cut_ms)):
                t0 = time.perf_counter()
                h(feats[context:], feats[context:], c)
                out.append((time.perf_counter() - t0) * 1e3)
                c.truncate(context)
    return statistics.median(target_ms), statistics.median(head_ms), statistics.median(cut_ms)


def decode(model: CausalLM, tokenizer: Tokenizer, prompt: list[int], tokens: int, k: int) -> tuple[float, float]:
    engine = Engine(model, tokenizer)
    drafter = NGramDrafter(max_ngram=3, min_ngram=1) if k else None
    t0 = time.perf_counter()
    steps = list(engine.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), drafter, k))
    n = sum(len(s.token_ids) for s in steps)
    return n / (time.perf_counter() - t0), steps[-1].stats.tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--name", default="qwen3_5-shapes")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = Tokenizer.from_gguf(resolve("qwen2.5-coder-0.5b-instruct"))  # Qwen's vocabulary, for the engine
    cfg = config(args.layers, tokenizer.vocab_size)
    model = random_model(cfg, 2200)
    table = []
    for context in (128, 2048):
        for rows in (1, 4, 8):
            ms = time_layers(model, context, rows, args.repeats)
            table.append({"context": context, "rows": rows, "linear_ms": ms[LINEAR_ATTENTION], "full_ms": ms[FULL_ATTENTION]})
            print(f"context {context:5d}, {rows} rows: Gated DeltaNet layer {ms[LINEAR_ATTENTION]:7.2f} ms, "
                  f"gated attention layer {ms[FULL_ATTENTION]:7.2f} ms", flush=True)
    target_ms, head_ms, cut_ms = time_mtp(model, 128, args.repeats)
    print(f"1-row pass after 128 tokens: the {args.layers}-layer target {target_ms:.1f} ms, its MTP head {head_ms:.1f} ms "
          f"({head_ms / target_ms:.2f}x; the target's whole output head), cut to {DEFAULT_DRAFT_VOCAB} tokens "
          f"{cut_ms:.1f} ms ({cut_ms / target_ms:.2f}x)", flush=True)
    prompt = (list(range(100, 160)) * 3)[:160]  # repeats: the n-grams find matches in the prompt
    plain, _ = decode(model, tokenizer, prompt, 48, 0)
    spec, tau = decode(model, tokenizer, prompt, 48, 4)
    print(f"{args.layers}-layer random model, 48 tokens: plain {plain:.2f} tok/s, n-gram k=4 {spec:.2f} tok/s "
          f"(tau {tau:.2f}, random weights: drafts rarely right)")
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "environment": environment(), "config": cfg.to_json_dict(),
              "layers": table, "mtp_pass_ms": {"target": target_ms, "head": head_ms, "head_cut_vocab": cut_ms},
              "decode": {"plain_tok_s": plain, "ngram_tok_s": spec, "ngram_tau": tau}}
    (OUT / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(f"saved {OUT / (args.name + '.json')}")


if __name__ == "__main__":
    main()
