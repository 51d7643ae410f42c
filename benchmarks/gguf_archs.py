"""The 2026 families as GGUF files, quickdraft vs llama.cpp on the same file: GPT-OSS (MXFP4
experts, sinks, alternating sliding windows), Gemma 4 (per-layer embeddings, KV sharing, two
head sizes; the 26B-A4B's experts beside the MLP) and Qwen3.5 (Gated DeltaNet hybrids, dense and
MoE), random weights in the formats the released GGUFs use.

No GPT-OSS, Gemma 4 or Qwen3.5 checkpoint is installable here (../shared/MODELS.md pins none), so
the file holds random valid blocks of the real models' layer shapes, fewer layers, and the real
models' vocabulary size (``--vocab real``, the default: 201,088 / 262,144 / 248,320 rows of
embedding and output head, the tests' tiny BPE padded with unused tokens, so the head weighs in a
decode step as in the released files; ``--vocab tiny``: the 300-token tokenizer alone, the layers
only). ``--size`` picks the released model of a family (default: the first below). Both engines
read the same file:

* ``gpt-oss``: gpt-oss-20b's layer (hidden 2880, 64 query / 8 KV heads of 64, sinks, window 128
  on every other layer, 32 experts of width 2880, top 4, YaRN), experts MXFP4, attention Q8_0;
* ``qwen35 --size 0.8b``: Qwen3.5-0.8B's layers (hidden 1024, Gated DeltaNet layers of 16 x 128
  q/k and value heads between gated full-attention layers of 8 x 256 / 2 KV heads every 4th, MLP
  3584), matrices Q8_0;
* ``qwen35 --size 4b``: Qwen3.5-4B's (hidden 2560, 32 layers in the release; Gated DeltaNet 16 q/k
  heads and 32 value heads of 128; full attention 16 x 256 / 4 KV heads every 4th; MLP 9216;
  RoPE on 64 dims, base 1e7), matrices Q8_0. Source: the GGUF metadata of a Qwen3.5-4B Q4_K_M file
  (ollama.com/turintech/qwen3.5-4b-artemis:q4_k_m: qwen35.embedding_length 2560, block_count 32,
  head_count 16 / head_count_kv 4, key_length 256, feed_forward_length 9216, ssm.group_count 16,
  ssm.time_step_rank 32, ssm.inner_size 4096, ssm.state_size 128);
* ``qwen35moe``: Qwen3.5-35B-A3B's (hidden 2048, 40 layers in the release, Gated DeltaNet 16 q/k
  and 32 value heads of 128, full attention 16 x 256 / 2 KV heads every 4th, 256 routed experts
  of width 512, top 8 renormalised, a shared expert of 512 with its sigmoid gate, no dense MLP:
  llama.cpp's converter writes no ``feed_forward_length``). Sources: transformers 5's
  Qwen3_5MoeTextConfig defaults (documented as Qwen/Qwen3.5-35B-A3B's) and the metadata and
  tensor table of a released Qwen3.6-35B-A3B UD-Q4_K_M file (the same ``qwen35moe`` layout),
  whose formats the file copies: routed gate / up Q4_K, down Q5_K; the shared expert, attention
  and Gated DeltaNet projections Q8_0 (alpha / beta float32); router float32; head Q6_K;
* ``gemma4 --size e2b``: gemma-4-E2B's layer (hidden 1536, 8 query / 1 KV head, head size 256 /
  512 on full layers, MLP 6144, double-wide on KV-sharing layers, per-layer inputs of 256, window
  512), matrices Q8_0, the last layers reusing keys and values;
* ``gemma4 --size 26b-a4b``: gemma-4-26B-A4B's (hidden 2816, 30 layers in the release, every 6th
  full and the last one full here; 16 query heads, 8 KV heads of 256 on sliding layers, 2 of 512
  on full ones with keys as values; window 1024; a GELU MLP of 2112 beside 128 experts of 704, top
  8, with the router's scales; no per-layer inputs or KV sharing). Source: the GGUF metadata of
  ollama.com/library/gemma4:26b-a4b-it-q4_K_M (gemma4.embedding_length 2816, block_count 30,
  head_count 16, key_length 512 / key_length_swa 256, sliding_window 1024, expert_count 128,
  expert_used_count 8, expert_feed_forward_length 704, feed_forward_length 2112, shared_kv_layers
  0, embedding_length_per_layer_input 0; its sliding_window_pattern begins with 5 sliding layers, and
  the release has 25 sliding + 5 full); the full layers' 2 KV heads as a Gemma 4 GGUF reader
  describes the file (github.com/ave-veritas-et-enodatio/go-inference-lab-bench,
  models/arch/gemma4.arch.toml). Formats: llama.cpp's Q4_K_M rule for experts (gate / up Q4_K;
  down Q4_K, whose 704-wide rows fall back to Q5_0 in llama-quant.cpp), the rest Q8_0, router
  float32.

Layer kinds with fewer layers than the release: Qwen3.5's every 4th is full attention (``--layers
4``: 3 Gated DeltaNet + 1 full); Gemma 4 26B-A4B's every 6th and the last.

quickdraft first picks this machine's kernel settings on the file as a user's first start does
(``quickdraft.kernels.tuning``: kept per file in the cache, the choice printed and saved).
Measured, alternating the two engines ``--rounds`` times: quickdraft's decode tokens/s (``dtype
auto``: the blocks kept, q8 activations, plain greedy, after a 64-token prompt) and llama.cpp's
``llama-bench -p 0 -n N`` (tg, same threads); prefill: quickdraft's time to the first token of a
``--prefill``-token prompt and ``llama-bench -p N -n 0`` (pp). Also quickdraft with its default drafter (``auto``) on
a repetitive prompt (random weights: little to accept, so this shows the drafter's overhead). JSON
with the command and versions goes to benchmarks/results/gguf_archs/.

The shipped drafters, priced on these shapes (random weights accept nothing, so what is measured is
the draft step's cost; the speed-up is projected at llama.cpp's published 0.79 acceptance):

* ``--mtp`` (``qwen35``): Qwen3.5's multi-token-prediction block after the layers, in llama.cpp's
  converter layout, run as ``--draft mtp`` runs it (one full-attention layer, the target's output
  head cut to ``--draft-vocab`` tokens);
* ``--assistant`` (``gemma4``, E2B): gemma-4-E2B-it's assistant (``gemma4_assistant``, the drafter
  Google released with it) at its released shape (:data:`ASSISTANT_E2B_TEXT`: 4 layers of hidden
  256, 4 query heads of 256 / 512 over the target's 1 KV head, MLP 2048; centroid-masked head of
  2048 clusters, 32 kept, over the tied 262,144-row embedding; 78M parameters), random weights,
  written beside the GGUF as the Hugging Face folder ``--draft PATH`` takes (config.json and
  bfloat16 safetensors, as released: no GGUF of it loads in llama.cpp or quickdraft; quickdraft
  runs it in the target's activation dtype, float32 on the CPU kernels' path) and loaded as the
  drafter of the target file.

Each drafter (a chain drafter, its cost model off) is priced two ways, as shares of a plain target
step (the inverse of the plain decode's median tokens/s): ``direct``, its own work per drafted
token timed alone (:func:`draft_seconds`: the median of ``--draft-repeats`` calls of its
``propose(1)`` after a 64-token prompt, its root row run each time: one row through the head or
the assistant's layers, its output head, the token picked; also propose(2), propose(3)), and
``derived``, a decode step drafting one token minus a plain step x T(2)/T(1) (noisier, and it
charges the engine's speculative bookkeeping to the drafter). The projected speed-up of chains of
1-3 is computed from the direct share: (1 + a + ... + a^k) / (T(k+1)/T(1) + k x share).

    .venv/bin/python benchmarks/gguf_archs.py --arch gpt-oss --layers 4
    .venv/bin/python benchmarks/gguf_archs.py --arch gemma4 --layers 6 --llama-bench ~/.cache/quickdraft/llamacpp-native/bin/llama-bench
    .venv/bin/python benchmarks/gguf_archs.py --arch gemma4 --size 26b-a4b --layers 6
    .venv/bin/python benchmarks/gguf_archs.py --arch qwen35 --size 4b --layers 8
    .venv/bin/python benchmarks/gguf_archs.py --arch qwen35moe --layers 4
    .venv/bin/python benchmarks/gguf_archs.py --arch qwen35 --layers 24 --mtp --prefill 0
    .venv/bin/python benchmarks/gguf_archs.py --arch gemma4 --layers 6 --assistant --prefill 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from tiny import gguf_tokenizer_metadata, tokenizer_vocab_size  # noqa: E402  (the tests' tiny BPE)

OUT = Path(__file__).parent / "results" / "gguf_archs"
DEFAULT_BENCH = Path.home() / ".cache/quickdraft/llamacpp-native/bin/llama-bench"
# the fork ikawrakow/ik_llama.cpp, built on this machine (see --ik-llama-bench)
DEFAULT_IK_BENCH = Path.home() / ".cache/quickdraft/ik_llama/build/bin/llama-bench"
# llama.cpp built for AVX2 only (what a user's build is on an AVX2 CPU; see --llama-bench-avx2)
DEFAULT_AVX2_BENCH = Path.home() / ".cache/quickdraft/llamacpp-avx2/build/bin/llama-bench"


def random_blocks(qtype: Any, rows: int, cols: int, rng: np.random.Generator, lead: tuple[int, ...] = ()) -> np.ndarray:
    """Random valid blocks of ``qtype`` for a [*lead, rows, cols] matrix (weights of scale ~1/sqrt(cols))."""
    import gguf

    Q = gguf.GGMLQuantizationType
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    nb = int(np.prod(lead, dtype=np.int64)) * rows * (cols // bs)
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)

    def half(at: int, value: float) -> None:  # an fp16 field of every block
        raw[:, at:at + 2] = np.full(nb, value / cols**0.5, dtype=np.float16).view(np.uint8).reshape(nb, 2)

    # the scales below give random bytes' weights a standard deviation of about 1/sqrt(cols)
    if qtype == Q.Q8_0:  # fp16 d, 32 int8: |w| ~ d * 64
        half(0, 1.0 / 64)
    elif qtype == Q.MXFP4:  # E8M0 e: w = 2^(e - 128) * {0 .. 12}
        raw[:, 0] = np.uint8(128 - 3 - int(np.log2(cols) / 2))
    elif qtype == Q.Q5_0:  # fp16 d, then 5-bit q: w = d * (q - 16)
        half(0, 1.0 / 9.2)
    elif qtype in (Q.Q4_K, Q.Q5_K):  # fp16 d, dmin, 6-bit sub-block scales sc / mins m: w = d sc q - dmin m
        qmax = 15 if qtype == Q.Q4_K else 31
        d = 1.0 / (257 if qtype == Q.Q4_K else 524)
        half(0, d)
        half(2, d * qmax / 2)  # (dmin m cancels d sc q on average)
    elif qtype == Q.Q6_K:  # ..., int8 sub-block scales, fp16 d last: w = d sc (q - 32)
        half(ts - 2, 1.0 / 1369)
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return raw.reshape(*lead, rows, cols // bs * ts)


# The released models' vocabularies (their output heads are a real share of a decode step):
# gpt-oss-20b's o200k_harmony, Gemma 4's, Qwen3.5's.
REAL_VOCAB = {"gpt-oss": 201_088, "gemma4": 262_144, "qwen35": 248_320, "qwen35moe": 248_320}
# --size: the released model whose layer shapes a file takes (the first is each family's default)
SIZES = {"gpt-oss": ("20b",), "gemma4": ("e2b", "26b-a4b"), "qwen35": ("0.8b", "4b"), "qwen35moe": ("35b-a3b",)}


def gemma4_windows(w: Any, hd: int, ghd: int, window: int, swa: list[bool]) -> None:
    """Gemma 4's two head sizes (sliding ``hd``, full ``ghd``), their RoPE and the sliding pattern."""
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_rope_dimension_count(ghd)
    w.add_rope_dimension_count_swa(hd)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_sliding_window(window)
    w.add_sliding_window_pattern(swa)


def write_gguf(arch: str, layers: int, path: Path, seed: int = 0, vocab: int | None = None,
               mtp: bool = False, size: str | None = None) -> dict[str, Any]:
    """The random file (``vocab``: rows of the embedding and head, the tiny tokenizer's padded
    with unused tokens; None: the tiny tokenizer's own; ``mtp``: Qwen3.5's multi-token-prediction
    block after the layers, as llama.cpp's converter writes it; ``size``: one of :data:`SIZES`,
    default the family's first); returns its shape summary."""
    import gguf

    Q = gguf.GGMLQuantizationType
    size = size or SIZES[arch][0]
    if size not in SIZES[arch]:
        raise SystemExit(f"--size {size}: {arch} files come in {', '.join(SIZES[arch])}")
    rng = np.random.default_rng(seed)
    vocab = max(vocab or 0, tokenizer_vocab_size())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random-{arch}")
    w.add_context_length(32768)  # (room for long prompts: benchmarks/hybrid_turn2.py)
    if mtp and arch != "qwen35":
        raise SystemExit("--mtp: only qwen35 files carry a multi-token-prediction block here")
    w.add_block_count(layers + int(mtp))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    gguf_tokenizer_metadata(w, pad_to=vocab)

    def f32(name: str, *shape: int, value: float | None = None) -> None:
        a = np.full(shape, value, dtype=np.float32) if value is not None else (rng.standard_normal(shape) * 0.1).astype(np.float32)
        w.add_tensor(name, a)

    def quant(name: str, qtype: Any, rows: int, cols: int, lead: tuple[int, ...] = ()) -> None:
        w.add_tensor(name, random_blocks(qtype, rows, cols, rng, lead), raw_dtype=qtype)

    def attention(hidden: int, ff: int | list[int] | None, heads: int, kv_heads: int | list[int], head_dim: int) -> None:
        w.add_embedding_length(hidden)
        if ff is not None:  # (None: Qwen3.5-MoE's converter writes no feed_forward_length)
            w.add_feed_forward_length(ff)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    if arch == "gpt-oss":
        h, nh, nkv, hd, experts, top, inter = 2880, 64, 8, 64, 32, 4, 2880
        attention(h, inter, nh, nkv, hd)
        w.add_rope_freq_base(150000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_expert_count(experts)
        w.add_expert_used_count(top)
        w.add_expert_feed_forward_length(inter)
        w.add_sliding_window(128)
        quant("token_embd.weight", Q.Q8_0, vocab, h)
        quant("output.weight", Q.Q8_0, vocab, h)
        f32("output_norm.weight", h, value=1.0)
        for i in range(layers):
            b = f"blk.{i}."
            f32(b + "attn_norm.weight", h, value=1.0)
            f32(b + "post_attention_norm.weight", h, value=1.0)
            for name, rows in (("attn_q", nh * hd), ("attn_k", nkv * hd), ("attn_v", nkv * hd)):
                quant(b + name + ".weight", Q.Q8_0, rows, h)
                f32(b + name + ".bias", rows)
            quant(b + "attn_output.weight", Q.Q8_0, h, nh * hd)
            f32(b + "attn_output.bias", h)
            f32(b + "attn_sinks.weight", nh)
            f32(b + "ffn_gate_inp.weight", experts, h)
            f32(b + "ffn_gate_inp.bias", experts)
            for name, rows, cols in (("ffn_gate_exps", inter, h), ("ffn_up_exps", inter, h), ("ffn_down_exps", h, inter)):
                quant(b + name + ".weight", Q.MXFP4, rows, cols, (experts,))
                f32(b + name + ".bias", experts, rows)
        shape = {"hidden": h, "heads": nh, "kv_heads": nkv, "head_dim": hd, "experts": experts, "top_k": top,
                 "expert_width": inter, "window": 128, "experts_format": "MXFP4", "attention_format": "Q8_0"}
    elif arch == "gemma4" and size == "26b-a4b":
        h, nh, hd, ghd, inter, window = 2816, 16, 256, 512, 2112, 1024
        nkv, gkv, experts, top, expert_inter = 8, 2, 128, 8, 704
        # every 6th layer full (25 sliding + 5 full of 30), the last one full; full layers use their
        # keys as values (no attn_v) and 2 KV heads of 512; no per-layer inputs, no KV sharing
        swa = [(i + 1) % 6 != 0 for i in range(layers)]
        swa[-1] = False
        attention(h, [inter] * layers, nh, [nkv if s else gkv for s in swa], ghd)
        gemma4_windows(w, hd, ghd, window, swa)
        w.add_shared_kv_layers(0)
        w.add_embedding_length_per_layer_input(0)
        w.add_final_logit_softcapping(30.0)
        w.add_expert_count(experts)
        w.add_expert_used_count(top)
        w.add_expert_feed_forward_length(expert_inter)
        rot = ghd // 8
        w.add_tensor("rope_freqs.weight", np.array([1.0] * rot + [1e30] * (ghd // 2 - rot), dtype=np.float32))
        quant("token_embd.weight", Q.Q8_0, vocab, h)
        f32("output_norm.weight", h, value=1.0)
        for i in range(layers):
            b, d, kv = f"blk.{i}.", (hd if swa[i] else ghd), (nkv if swa[i] else gkv)
            for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
                      "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                f32(b + n + ".weight", h, value=1.0)
            f32(b + "layer_output_scale.weight", 1, value=1.0)
            quant(b + "attn_q.weight", Q.Q8_0, nh * d, h)
            f32(b + "attn_q_norm.weight", d, value=1.0)
            quant(b + "attn_k.weight", Q.Q8_0, kv * d, h)
            f32(b + "attn_k_norm.weight", d, value=1.0)
            if swa[i]:
                quant(b + "attn_v.weight", Q.Q8_0, kv * d, h)
            quant(b + "attn_output.weight", Q.Q8_0, h, nh * d)
            quant(b + "ffn_gate.weight", Q.Q8_0, inter, h)  # (the dense GELU MLP beside the experts)
            quant(b + "ffn_up.weight", Q.Q8_0, inter, h)
            quant(b + "ffn_down.weight", Q.Q8_0, h, inter)
            f32(b + "ffn_gate_inp.weight", experts, h)  # the router, its input scale, per-expert scales
            f32(b + "ffn_gate_inp.scale", h, value=1.0)
            f32(b + "ffn_down_exps.scale", experts, value=1.0)
            # Q4_K_M: Q4_K, but 704-wide down rows are no multiple of 256: llama.cpp's fallback Q5_0
            quant(b + "ffn_gate_up_exps.weight", Q.Q4_K, 2 * expert_inter, h, (experts,))
            quant(b + "ffn_down_exps.weight", Q.Q5_0, h, expert_inter, (experts,))
        shape = {"size": size, "hidden": h, "heads": nh, "kv_heads": [nkv, gkv], "head_dim": hd, "global_head_dim": ghd,
                 "intermediate": inter, "window": window, "experts": experts, "top_k": top,
                 "expert_width": expert_inter, "experts_format": "Q4_K gate / up, Q5_0 down", "format": "Q8_0"}
    elif arch == "gemma4":
        h, nh, nkv, hd, ghd, inter, ple, window = 1536, 8, 1, 256, 512, 6144, 256, 512
        # E2B's layout, shortened: a full layer every 5th, the last third reusing the keys and values
        # of the last sliding and the last full layer before them (which llama.cpp takes to be the
        # last two), the last layer a full one
        shared = layers // 3
        first_shared = layers - shared
        if first_shared < 2:
            raise SystemExit("gemma4 needs at least 3 --layers")
        swa = [(i + 1) % 5 != 0 for i in range(first_shared)]
        swa[first_shared - 2:] = [True, False]
        swa += [True] * (shared - 1) + [False] * min(shared, 1)
        ff = [2 * inter if i >= first_shared else inter for i in range(layers)]
        attention(h, ff, nh, [nkv] * layers, ghd)
        gemma4_windows(w, hd, ghd, window, swa)
        w.add_shared_kv_layers(shared)
        w.add_embedding_length_per_layer_input(ple)
        w.add_final_logit_softcapping(30.0)
        rot = ghd // 8
        w.add_tensor("rope_freqs.weight", np.array([1.0] * rot + [1e30] * (ghd // 2 - rot), dtype=np.float32))
        quant("token_embd.weight", Q.Q8_0, vocab, h)
        f32("output_norm.weight", h, value=1.0)
        quant("per_layer_token_embd.weight", Q.Q8_0, vocab, layers * ple)
        quant("per_layer_model_proj.weight", Q.Q8_0, layers * ple, h)
        f32("per_layer_proj_norm.weight", ple, value=1.0)
        for i in range(layers):
            b, d = f"blk.{i}.", (hd if swa[i] else ghd)
            for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
                f32(b + n + ".weight", h, value=1.0)
            f32(b + "layer_output_scale.weight", 1, value=1.0)
            quant(b + "attn_q.weight", Q.Q8_0, nh * d, h)
            f32(b + "attn_q_norm.weight", d, value=1.0)
            if i < first_shared:
                quant(b + "attn_k.weight", Q.Q8_0, nkv * d, h)
                quant(b + "attn_v.weight", Q.Q8_0, nkv * d, h)
                f32(b + "attn_k_norm.weight", d, value=1.0)
            quant(b + "attn_output.weight", Q.Q8_0, h, nh * d)
            quant(b + "ffn_gate.weight", Q.Q8_0, ff[i], h)
            quant(b + "ffn_up.weight", Q.Q8_0, ff[i], h)
            quant(b + "ffn_down.weight", Q.Q8_0, h, ff[i])
            quant(b + "inp_gate.weight", Q.Q8_0, ple, h)
            quant(b + "proj.weight", Q.Q8_0, h, ple)
        shape = {"hidden": h, "heads": nh, "kv_heads": nkv, "head_dim": hd, "global_head_dim": ghd,
                 "intermediate": inter, "per_layer_input": ple, "window": window, "kv_shared_layers": shared,
                 "format": "Q8_0", "size": size}
    elif arch in ("qwen35", "qwen35moe"):
        moe = arch == "qwen35moe"
        # hidden, query / KV heads of the full-attention layers and their size, MLP width (dense sizes);
        # Gated DeltaNet key heads, value heads, their sizes
        h, nh, nkv, hd, inter, nk, nv, dk, dv = {
            "0.8b": (1024, 8, 2, 256, 3584, 16, 16, 128, 128),
            "4b": (2560, 16, 4, 256, 9216, 16, 32, 128, 128),
            "35b-a3b": (2048, 16, 2, 256, None, 16, 32, 128, 128),
        }[size]
        conv = 4
        experts, top, expert_inter, shared_inter = 256, 8, 512, 512  # (qwen35moe)
        kinds = [(i + 1) % 4 != 0 for i in range(layers)]  # True: Gated DeltaNet; every 4th full attention
        attention(h, inter, nh, nkv, hd)
        w.add_rope_dimension_count(hd // 4)
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_rope_freq_base(10_000_000.0)
        w.add_ssm_conv_kernel(conv)
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(dv * nv)
        w.add_array(f"{arch}.attention.recurrent_layers", kinds + [False] * int(mtp))
        w.add_uint32(f"{arch}.full_attention_interval", 4)
        if moe:
            w.add_expert_count(experts)
            w.add_expert_used_count(top)
            w.add_expert_feed_forward_length(expert_inter)
            w.add_expert_shared_feed_forward_length(shared_inter)
        if mtp:  # one full-attention block after the layers, fed [embedding, hidden state] through eh_proj
            kinds.append(False)
            w.add_uint32(f"{arch}.nextn_predict_layers", 1)
            quant(f"blk.{layers}.nextn.eh_proj.weight", Q.Q8_0, h, 2 * h)
            for name in ("enorm", "hnorm", "shared_head_norm"):
                f32(f"blk.{layers}.nextn.{name}.weight", h, value=0.0)
        # Qwen3.5-35B-A3B's Q4_K_M file: the head Q6_K, the router and the Gated DeltaNet's alpha / beta
        # projections float32; everything else outside the routed experts Q8_0 (as every matrix of the
        # dense files here)
        quant("token_embd.weight", Q.Q8_0, vocab, h)
        quant("output.weight", Q.Q6_K if moe else Q.Q8_0, vocab, h)
        f32("output_norm.weight", h, value=0.0)  # (norms stored as 1 + w)
        for i in range(len(kinds)):
            b = f"blk.{i}."
            f32(b + "attn_norm.weight", h, value=1.0)
            f32(b + "post_attention_norm.weight", h, value=1.0)
            if kinds[i]:
                quant(b + "attn_qkv.weight", Q.Q8_0, 2 * nk * dk + nv * dv, h)
                quant(b + "attn_gate.weight", Q.Q8_0, nv * dv, h)
                for name in ("ssm_beta", "ssm_alpha"):
                    if moe:
                        f32(b + name + ".weight", nv, h)
                    else:
                        quant(b + name + ".weight", Q.Q8_0, nv, h)
                f32(b + "ssm_conv1d.weight", 2 * nk * dk + nv * dv, conv)
                f32(b + "ssm_dt.bias", nv)
                f32(b + "ssm_a", nv, value=-1.0)
                f32(b + "ssm_norm.weight", dv, value=1.0)
                quant(b + "ssm_out.weight", Q.Q8_0, h, nv * dv)
            else:
                quant(b + "attn_q.weight", Q.Q8_0, 2 * nh * hd, h)  # (queries and their gates)
                quant(b + "attn_k.weight", Q.Q8_0, nkv * hd, h)
                quant(b + "attn_v.weight", Q.Q8_0, nkv * hd, h)
                quant(b + "attn_output.weight", Q.Q8_0, h, nh * hd)
                f32(b + "attn_q_norm.weight", hd, value=1.0)
                f32(b + "attn_k_norm.weight", hd, value=1.0)
            if moe:  # routed experts (gate, up Q4_K; down Q5_K) and the shared one with its sigmoid gate
                f32(b + "ffn_gate_inp.weight", experts, h)
                quant(b + "ffn_gate_exps.weight", Q.Q4_K, expert_inter, h, (experts,))
                quant(b + "ffn_up_exps.weight", Q.Q4_K, expert_inter, h, (experts,))
                quant(b + "ffn_down_exps.weight", Q.Q5_K, h, expert_inter, (experts,))
                f32(b + "ffn_gate_inp_shexp.weight", h)
                quant(b + "ffn_gate_shexp.weight", Q.Q8_0, shared_inter, h)
                quant(b + "ffn_up_shexp.weight", Q.Q8_0, shared_inter, h)
                quant(b + "ffn_down_shexp.weight", Q.Q8_0, h, shared_inter)
            else:
                quant(b + "ffn_gate.weight", Q.Q8_0, inter, h)
                quant(b + "ffn_up.weight", Q.Q8_0, inter, h)
                quant(b + "ffn_down.weight", Q.Q8_0, h, inter)
        shape = {"size": size, "hidden": h, "heads": nh, "kv_heads": nkv, "head_dim": hd, "linear_heads": [nk, nv],
                 "linear_head_dims": [dk, dv], "intermediate": inter, "format": "Q8_0", "mtp_layers": int(mtp)}
        if moe:
            shape.update(experts=experts, top_k=top, expert_width=expert_inter, shared_expert_width=shared_inter,
                         experts_format="Q4_K gate / up, Q5_K down", head_format="Q6_K")
    else:
        raise SystemExit(f"unknown --arch {arch}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"arch": arch, "layers": layers, "vocab": vocab, **shape}


# gemma-4-E2B-it's assistant (google/gemma-4-E2B-it-assistant, model_type gemma4_assistant): the
# text_config of its released config.json, as tabulated (E2B column) in github.com/john-rocky/
# CoreML-LLM, docs/GEMMA4_MTP_OFFICIAL_KB.md ("verified from config.json of each repo"); the
# outer fields (backbone 1536, ordered embeddings: 2048 centroids, 32 kept) are the same table's
# and transformers 5's Gemma4AssistantConfig defaults. 78M parameters (the model card's figure;
# 67M of them the tied 262,144 x 256 embedding / head), released as bf16 safetensors.
ASSISTANT_E2B_TEXT = {
    "model_type": "gemma4_text", "hidden_size": 256, "intermediate_size": 2048, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "attention_k_eq_v": False, "sliding_window": 512, "max_position_embeddings": 131072,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "num_kv_shared_layers": 4,
    "final_logit_softcapping": None, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
    "use_double_wide_mlp": False, "enable_moe_block": False,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"}},
}
ASSISTANT_E2B = {"backbone_hidden_size": 1536, "num_centroids": 2048, "centroid_intermediate_top_k": 32}


def write_assistant(folder: Path, vocab: int, seed: int = 0) -> dict[str, Any]:
    """gemma-4-E2B-it's assistant (:data:`ASSISTANT_E2B_TEXT`) with random weights, as a Hugging
    Face folder (config.json, model.safetensors in bfloat16 as released: no GGUF of it loads in
    llama.cpp or quickdraft) with ``vocab`` rows of the tied embedding / head. The centroid-masked
    head (``use_ordered_embeddings``) needs the vocabulary in 2048 equal clusters (262,144 = 2048 x
    128): another ``vocab`` (``--vocab tiny``) gets the plain tied head. Returns its shape summary."""
    import torch
    from safetensors.torch import save_file

    text = {**ASSISTANT_E2B_TEXT, "vocab_size": vocab}
    centroids = ASSISTANT_E2B["num_centroids"]
    ordered = vocab % centroids == 0
    h, inter, nh, hd, ghd = (text[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                "head_dim", "global_head_dim"))
    hb = ASSISTANT_E2B["backbone_hidden_size"]
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int, scale: float | None = None) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=g) * (scale if scale is not None else cols**-0.5)
        return w.to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": matrix(vocab, h, 1.0), "model.norm.weight": ones(h),
               "pre_projection.weight": matrix(h, 2 * hb), "post_projection.weight": matrix(hb, h)}
    for i, kind in enumerate(text["layer_types"]):
        b, d = f"model.layers.{i}.", (hd if kind == "sliding_attention" else ghd)
        tensors.update({
            b + "layer_scalar": ones(1), b + "self_attn.q_proj.weight": matrix(nh * d, h),
            b + "self_attn.q_norm.weight": ones(d), b + "self_attn.o_proj.weight": matrix(h, nh * d),
            b + "mlp.gate_proj.weight": matrix(inter, h), b + "mlp.up_proj.weight": matrix(inter, h),
            b + "mlp.down_proj.weight": matrix(h, inter),
            **{b + n + ".weight": ones(h) for n in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm")}})
    if ordered:
        tensors["masked_embedding.centroids.weight"] = matrix(centroids, h)
        tensors["masked_embedding.token_ordering"] = torch.randperm(vocab, generator=g)
    config = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
              **ASSISTANT_E2B, "use_ordered_embeddings": ordered, "tie_word_embeddings": True,
              "dtype": "bfloat16", "text_config": text}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(folder / "model.safetensors"))
    params = sum(t.numel() for n, t in tensors.items() if not n.endswith("token_ordering"))
    return {"hidden": h, "layers": text["num_hidden_layers"], "heads": nh, "kv_heads": text["num_key_value_heads"],
            "head_dim": hd, "global_head_dim": ghd, "intermediate": inter, "backbone_hidden": hb, "vocab": vocab,
            "head": (f"centroid-masked ({ASSISTANT_E2B['centroid_intermediate_top_k']} of {centroids} clusters)"
                     if ordered else "plain tied"), "parameters": params, "format": "bfloat16 safetensors"}


def quickdraft_decode(loaded: Any, tokens: int, drafter: Any, repetitive: bool,
                      num_draft: int | None = None) -> tuple[float, float]:
    """(decode tokens/s after the first token, tau) of ``tokens`` greedy tokens after a 64-token
    prompt; ``drafter`` "none", "auto", "mtp" (as the CLI builds it) or a Drafter (drafting
    ``num_draft`` tokens a step)."""
    import torch

    from quickdraft.assemble.drafters import build_drafter
    from quickdraft.engine import Engine
    from quickdraft.options import EngineOptions
    from quickdraft.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, tokenizer_vocab_size(), (16 if repetitive else 64,), generator=g).tolist()
    if repetitive:
        prompt = prompt * 4
    if isinstance(drafter, str):
        d, k = build_drafter(EngineOptions(draft=drafter, num_draft=num_draft), loaded)
    else:
        d, k = drafter, num_draft or 1
    engine = Engine(loaded.model, loaded.tokenizer)
    steps = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True), d, k)
    first = next(steps)
    t0, n = time.perf_counter(), 0
    tau = 1.0
    for s in steps:
        n += len(s.token_ids)
        tau = s.stats.tau
    del first
    return n / (time.perf_counter() - t0), tau


def quickdraft_prefill(loaded: Any, tokens: int) -> float:
    """Prompt tokens/s of a ``tokens``-token prompt: the time to its first token (no prefix cache)."""
    import torch

    from quickdraft.engine import Engine
    from quickdraft.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, tokenizer_vocab_size(), (tokens,), generator=g).tolist()
    engine = Engine(loaded.model, loaded.tokenizer)
    t0 = time.perf_counter()
    next(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    return tokens / (time.perf_counter() - t0)


def active_bytes(path: Path, shape: dict[str, Any]) -> int:
    """Bytes a decode step reads from the file: every matrix and vector, but one row of each token
    embedding table (unless it is also the output head), and of the routed experts (``*_exps``)
    only the top-k's share (random weights route evenly)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)  # (the head is the embedding table: read whole)
    total = 0
    for t in tensors:
        n = int(t.n_bytes)
        if "token_embd" in t.name and not (tied and t.name == "token_embd.weight"):
            n //= int(t.shape[-1])  # (token_embd, per_layer_token_embd: one row a token)
        elif "_exps" in t.name and shape.get("experts"):
            n = n * shape["top_k"] // shape["experts"]
        total += n
    return total


PUBLISHED_ACCEPTANCE = 0.79  # llama.cpp's draft-mtp on Qwen3.5 (aggregate acceptance per drafted token)


def pass_ratios(loaded: Any) -> dict[int, float]:
    """T(k)/T(1) of the target's passes of k = 1, 2, 3, 4, 8 rows (what a chain of k-1 drafts costs)."""
    from quickdraft.speculative.policy import measure_pass_seconds

    seconds = measure_pass_seconds(loaded.model, rows=(1, 2, 3, 4, 8), repeats=3)
    return {k: v / seconds[1] for k, v in seconds.items()}


def draft_seconds(loaded: Any, drafter: Any, repeats: int, chains: tuple[int, ...] = (1, 2, 3)) -> dict[int, float]:
    """The drafter's own work, timed directly: seconds of ``drafter.propose(k)`` (a chain drafter,
    its cost model off: exactly k tokens) for each k in ``chains``, the median of ``repeats`` after
    two warm-ups, the k interleaved. The drafter first follows a greedy request (a 64-token prompt,
    8 tokens) on the engine, so it holds the target's features (and the Gemma 4 assistant the
    target's keys and values) as in a decode step. Before each call it forgets its root row (its
    rows' count cut back by one), so propose(k) runs what a decode step drafting k tokens runs
    after a rejected draft: the root row (the newest token and the feature before it) through the
    head (the MTP layer, or the assistant's layers) and its output head, the token picked from the
    logits, then k - 1 passes of one drafted row each. propose(1) is one drafted token's cost; no
    target pass, verification or engine bookkeeping is in it. (After an accepted draft the MTP
    layer's root pass also re-reads the accepted rows: a few more rows in the same one pass.)"""
    import torch

    from quickdraft.engine import Engine
    from quickdraft.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, tokenizer_vocab_size(), (64,), generator=g).tolist()
    engine = Engine(loaded.model, loaded.tokenizer)
    for _ in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), drafter,
                             max(chains)):
        pass
    drafter.propose(1)  # (its rows caught up with the features fed by the request's last step)
    cuda = loaded.model.device.type == "cuda"
    times: dict[int, list[float]] = {k: [] for k in chains}
    for _ in range(repeats + 2):
        for k in chains:
            drafter.cache.truncate(drafter.fed - 1)  # forget the root row: propose runs it again
            t0 = time.perf_counter()
            draft = drafter.propose(k)
            if cuda:
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
            if int(draft.tokens.numel()) != k:
                raise SystemExit(f"{drafter.name}: propose({k}) drafted {int(draft.tokens.numel())} tokens after the "
                                 "request; the timing needs a chain drafter with its cost model off")
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def draft_cost(loaded: Any, drafter: Any, tokens: int, passes: dict[int, float], plain_step: float, rounds: int,
               repeats: int) -> dict[str, Any]:
    """A drafter's draft step as a share of a plain target step, two ways, and the speed-up chains
    of 1-3 would bring at the published acceptance, from the direct share.

    direct: :func:`draft_seconds` of ``drafter`` (a chain drafter, cost model off; propose(1): one
    drafted token).
    derived: random weights accept nothing, so a decode step drafting one token (``drafter`` at
    k = 1 on the engine) yields one token; its time is a 2-row target pass plus the draft step,
    so the draft step is that time minus a plain step x T(2)/T(1) (``passes``). This charges the
    drafter the engine's speculative bookkeeping too (verification, feeding features, commits) and
    carries the noise of two decode timings.

    projected[k] = (1 + a + ... + a^k) / (T(k+1)/T(1) + k x direct share), a = 0.79."""
    steps = [1.0 / quickdraft_decode(loaded, tokens, drafter, repetitive=False, num_draft=1)[0]
             for _ in range(rounds)]
    derived = max(0.0, statistics.median(steps) - plain_step * passes[2])
    chain = draft_seconds(loaded, drafter, repeats)
    share = chain[1] / plain_step
    a = PUBLISHED_ACCEPTANCE
    projected = {k: sum(a**i for i in range(k + 1)) / (passes[k + 1] + k * share) for k in (1, 2, 3)}
    return {"plain_step_seconds": plain_step,
            "direct": {"step_seconds": chain[1], "step_share": share, "propose_seconds": chain, "repeats": repeats,
                       "what": "median seconds of the drafter's propose(k) (chain, cost model off) after a "
                               "64-token prompt, its root row run again each time; step = propose(1)"},
            "derived": {"step_seconds": derived, "step_share": derived / plain_step, "decode_step_seconds": steps,
                        "what": "a decode step drafting one token (random weights: one token a step) minus a "
                                "plain step x T(2)/T(1)"},
            "projected": projected, "projected_from": "direct step_share"}


def print_draft_cost(name: str, cost: dict[str, Any]) -> None:
    d, r = cost["direct"], cost["derived"]
    print(f"  {name} draft step, direct: {1000 * d['step_seconds']:.2f} ms = {100 * d['step_share']:.1f}% of a "
          f"target step (goal <= 10%); chains: " + ", ".join(
              f"propose({k}) {1000 * s:.2f} ms" for k, s in d["propose_seconds"].items()))
    print(f"  {name} draft step, derived (decode step - plain step x T(2)/T(1)): {1000 * r['step_seconds']:.2f} ms "
          f"= {100 * r['step_share']:.1f}%")
    print(f"  projected speed-up at {PUBLISHED_ACCEPTANCE} acceptance per token (direct share): "
          + ", ".join(f"chain {k} {x:.2f}x" for k, x in cost["projected"].items()))


def peak_memory(path: Path, prefill: int, tokens: int) -> dict[str, float]:
    """quickdraft's resident memory in a process of its own: loading ``path``, then a plain decode of ``tokens``
    tokens and a ``prefill``-token prefill; against the file, the KV cache an engine of the model allocates and
    (hybrids) the recurrent states the prefill leaves: the live one and a checkpoint every STATE_EVERY tokens
    (what turn 2 of a chat continues from; up to MAX_CHECKPOINTS). The peak is ``quickdraft bench``'s
    ``peak_rss_mb``: the process's own high-water mark (getrusage's ru_maxrss carries over the parent's through
    fork and exec, so inside a benchmark that has loaded the model it read the benchmark's peak)."""
    code = """
import json, sys
sys.path.insert(0, sys.argv[1])
import gguf_archs as ga
from quickdraft.engine import Engine
from quickdraft.loading.load import load_model
loaded = load_model(sys.argv[2], max_context=max(512, int(sys.argv[3]) + 64))
after_load = int(open("/proc/self/statm").read().split()[1]) * 4096
ga.quickdraft_decode(loaded, int(sys.argv[4]), "none", repetitive=False)
if int(sys.argv[3]):
    ga.quickdraft_prefill(loaded, int(sys.argv[3]))
from quickdraft.bench.runner import peak_rss_mb
peak_rss = round(peak_rss_mb() * 2**20)
from quickdraft.cache import MAX_CHECKPOINTS, STATE_EVERY, HybridCache
engine = Engine(loaded.model, loaded.tokenizer)
state = 0
if isinstance(engine.cache, HybridCache):
    rec = engine.cache.recurrent
    one = sum(t.numel() * t.element_size() for pair in rec.shape.zeros("meta", rec.dtype) for t in pair)
    state = one * (1 + min(int(sys.argv[3]) // STATE_EVERY, MAX_CHECKPOINTS))
print(json.dumps({"after_load": after_load, "peak_rss": peak_rss, "kv": engine.kv_bytes, "state": state}))
"""
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(path), str(prefill), str(tokens)],
                         capture_output=True, text=True, check=True)
    memory = json.loads(out.stdout.strip().splitlines()[-1])
    memory["file"] = path.stat().st_size
    memory["ratio"] = memory["peak_rss"] / (memory["file"] + memory["kv"] + memory["state"])
    return memory


def llama_bench(binary: Path, path: Path, threads: int, decode: int = 0, prompt: int = 0) -> float | None:
    """llama-bench's tokens/s: of ``decode`` generated tokens (tg), or of a ``prompt``-token prompt (pp);
    None (with a line saying why) where this build cannot run the file."""
    out = subprocess.run([str(binary), "-m", str(path), "-p", str(prompt), "-n", str(decode), "-t", str(threads),
                          "-r", "1", "-o", "json"], capture_output=True, text=True,
                         env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)})
    try:
        rows = json.loads(out.stdout)
        return float(rows[0]["avg_ts"])
    except (ValueError, LookupError, TypeError):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  {binary} cannot run {path.name} (exit {out.returncode}): {last}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=tuple(SIZES), required=True)
    ap.add_argument("--size", default=None,
                    help="the released model whose layer shapes the file takes: " + "; ".join(
                        f"{a}: {' | '.join(s)}" for a, s in SIZES.items()) + " (default: the first)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_BENCH)
    ap.add_argument("--ik-llama-bench", type=Path, default=DEFAULT_IK_BENCH,
                    help="a second opponent: llama-bench of the fork ikawrakow/ik_llama.cpp built on this machine "
                         "(skipped where the file is absent or the build cannot run the family)")
    ap.add_argument("--llama-bench-avx2", type=Path, default=None,
                    help="one more opponent: llama.cpp's llama-bench built for AVX2 only (cmake -DGGML_NATIVE=OFF "
                         "-DGGML_AVX2=ON -DGGML_AVX512=OFF ...), llama.cpp as an AVX2 CPU runs it; the side-by-side "
                         "for QUICKDRAFT_ISA=avx2 (default: " + str(DEFAULT_AVX2_BENCH) + " when QUICKDRAFT_ISA=avx2 "
                         "is set and the file exists)")
    ap.add_argument("--file", type=Path, default=None, help="where to write the random GGUF (default: /tmp)")
    ap.add_argument("--vocab", default="real",
                    help="rows of the embedding and output head: real (the released model's), tiny (the tests' "
                         "300-token tokenizer's) or a number")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement (0: none)")
    ap.add_argument("--mtp", action="store_true",
                    help="qwen35: a multi-token-prediction block after the layers; measure its draft step and the "
                         "speed-up projected at the published acceptance")
    ap.add_argument("--assistant", action="store_true",
                    help="gemma4 (e2b): also write gemma-4-E2B-it's assistant (random weights, the released shape) "
                         "as a Hugging Face folder beside the file, load it as the drafter and measure its draft "
                         "step and the speed-up projected at the published acceptance")
    ap.add_argument("--draft-repeats", type=int, default=50,
                    help="--mtp / --assistant: timed proposals per chain length of the direct draft-step timing")
    ap.add_argument("--name", default=None,
                    help="result file name without .json (default: ARCH[-SIZE]-Nl[-vocab-V][-mtp|-assistant])")
    args = ap.parse_args()
    if args.assistant and (args.arch, args.size or SIZES[args.arch][0]) != ("gemma4", "e2b"):
        raise SystemExit("--assistant: the assistant written here is gemma-4-E2B-it's: use it with --arch gemma4 "
                         "(--size e2b)")
    vocab = REAL_VOCAB[args.arch] if args.vocab == "real" else None if args.vocab == "tiny" else int(args.vocab)

    import torch

    from quickdraft.bench.report import environment

    torch.set_num_threads(args.threads)
    size = args.size or SIZES[args.arch][0]
    tag = args.arch if size == SIZES[args.arch][0] else f"{args.arch}-{size}"  # (the default size: names as before)
    path = args.file or Path(f"/tmp/quickdraft-random-{tag}-{args.layers}-{vocab or 'tiny'}"
                             f"{'-mtp' if args.mtp else ''}.gguf")
    shape = write_gguf(args.arch, args.layers, path, vocab=vocab, mtp=args.mtp, size=size)
    print(f"{path} ({path.stat().st_size / 2**30:.2f} GiB): {shape}")
    folder = path.with_name(path.stem + "-assistant")
    if args.assistant:
        shape["assistant"] = write_assistant(folder, shape["vocab"])
        print(f"{folder} ({(folder / 'model.safetensors').stat().st_size / 2**20:.0f} MiB): {shape['assistant']}")
    from quickdraft.loading.load import load_model

    t0 = time.perf_counter()
    loaded = load_model(str(path), max_context=max(512, args.prefill + 64))
    print(f"quickdraft loaded it in {time.perf_counter() - t0:.1f} s: {loaded.config.layer_pattern()}")
    from quickdraft.kernels.tuning import tune as tune_kernels

    choice = tune_kernels(loaded.model, loaded.path, print)  # the kernels a user's first start picks (kept)
    kernels_line = choice.line() if choice is not None else None
    if kernels_line:
        print(kernels_line)
    avx2_bench = args.llama_bench_avx2 or (DEFAULT_AVX2_BENCH if os.environ.get("QUICKDRAFT_ISA") == "avx2"
                                           else None)
    opponents = {name: binary for name, binary in (("llama.cpp", args.llama_bench),
                                                   ("ik_llama.cpp", args.ik_llama_bench),
                                                   ("llama.cpp AVX2", avx2_bench))
                 if binary is not None and binary.is_file()}
    # Nothing the run wrote (the file, the prepared copy the load made: GBs for the MoE files) may still be
    # on its way to disk, on the same 2 cores, when the timings start (a guard: 0.0 s in the runs of 19:22).
    t0 = time.perf_counter()
    os.sync()
    print(f"written back to disk in {time.perf_counter() - t0:.1f} s (before any timing)")
    runs: dict[str, list[float]] = {"quickdraft": [], "quickdraft-auto": [], "quickdraft prefill": []}
    for name in opponents:
        runs[name], runs[f"{name} prefill"] = [], []
    taus: list[float] = []
    for r in range(args.rounds):
        runs["quickdraft"].append(quickdraft_decode(loaded, args.tokens, "none", repetitive=False)[0])
        speed, tau = quickdraft_decode(loaded, args.tokens, "auto", repetitive=True)
        runs["quickdraft-auto"].append(speed)
        taus.append(tau)
        if args.prefill:
            runs["quickdraft prefill"].append(quickdraft_prefill(loaded, args.prefill))
        for name, binary in list(opponents.items()):
            speeds = [llama_bench(binary, path, args.threads, decode=args.tokens)]
            if args.prefill:
                speeds.append(llama_bench(binary, path, args.threads, prompt=args.prefill))
            if None in speeds:  # this build does not run the family: drop it
                del opponents[name], runs[name], runs[f"{name} prefill"]
                continue
            runs[name].append(speeds[0])
            if args.prefill:
                runs[f"{name} prefill"].append(speeds[1])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items() if v))
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    passes = pass_ratios(loaded)
    from quickdraft.kernels import load as load_kernels

    kernels = load_kernels()
    probe = kernels.read_bandwidth(1 << 30, args.threads, 3) if kernels is not None else float("nan")
    step_bytes = active_bytes(path, shape)
    memory = peak_memory(path, args.prefill, args.tokens)
    bandwidth = {k: step_bytes * med[k] / 1e9 for k in ("quickdraft", *opponents)}
    mtp = assistant = None
    if args.mtp:  # the engine's --draft mtp drafter (its output head cut to --draft-vocab tokens), chains
        from quickdraft.assemble.drafters import build_drafter
        from quickdraft.options import EngineOptions

        drafter, _ = build_drafter(EngineOptions(draft="mtp", num_draft=3), loaded)
        drafter.mode = "chain"
        mtp = draft_cost(loaded, drafter, args.tokens, passes, 1.0 / med["quickdraft"], args.rounds,
                         args.draft_repeats)
        mtp["draft_vocab"] = drafter.head.config.draft_vocab_size
    if args.assistant:  # --draft FOLDER's assistant drafter alone (not beside n-gram lookup), chains
        from quickdraft.speculative.gemma4_assistant import build_assistant_drafter

        drafter = build_assistant_drafter(folder, loaded.model, num_draft=3, mode="chain")
        assistant = draft_cost(loaded, drafter, args.tokens, passes, 1.0 / med["quickdraft"], args.rounds,
                               args.draft_repeats)
        assistant["variant"] = drafter.variant
    print(f"\n{tag}, {args.layers} layers, vocabulary {shape['vocab']}, {args.threads} threads, tokens/s "
          f"(median of {args.rounds}; prefill: a {args.prefill}-token prompt):")
    for k, v in med.items():
        print(f"  {k:18s} {v:8.2f}")
    for name in opponents:
        print(f"  quickdraft / {name}: {med['quickdraft'] / med[name]:.2f}x")
        if f"{name} prefill" in med:
            print(f"  prefill, quickdraft / {name}: {med['quickdraft prefill'] / med[f'{name} prefill']:.2f}x")
    print(f"  a decode step reads {step_bytes / 2**20:.0f} MiB: " + ", ".join(
        f"{k} {v:.1f} GB/s ({v / probe:.0%} of the {probe:.1f} GB/s read probe)" for k, v in bandwidth.items()))
    print(f"  memory (a quickdraft process of its own): {memory['after_load'] / 2**30:.2f} GiB loaded, peak "
          f"{memory['peak_rss'] / 2**30:.2f} GiB = {memory['ratio']:.2f}x the file "
          f"({memory['file'] / 2**30:.2f} GiB) + the engine's KV cache ({memory['kv'] / 2**30:.2f} GiB)"
          + (f" + the prefill's recurrent states ({memory['state'] / 2**30:.2f} GiB)" if memory["state"] else ""))
    print("  T(k)/T(1), target passes of k rows: " + ", ".join(f"k={k} {v:.2f}" for k, v in passes.items() if k > 1))
    if mtp is not None:
        print_draft_cost(f"MTP (output head of {mtp['draft_vocab']} tokens)", mtp)
    if assistant is not None:
        print_draft_cost(f"Gemma 4 assistant ({assistant['variant']})", assistant)
    OUT.mkdir(parents=True, exist_ok=True)
    name = args.name or (f"{tag}-{args.layers}l{'' if args.vocab == 'real' else '-vocab-' + args.vocab}"
                         f"{'-mtp' if args.mtp else ''}{'-assistant' if args.assistant else ''}")
    out = OUT / f"{name}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "environment": environment(), "shape": shape,
                               "opponents": {name: str(binary) for name, binary in opponents.items()},
                               "tokens": args.tokens, "prefill": args.prefill, "threads": args.threads,
                               "runs": runs, "median": med, "pass_ratios": passes, "mtp": mtp,
                               "assistant": assistant,
                               "step_bytes": step_bytes, "memory": memory, "read_probe_gbs": probe, "decode_gbs": bandwidth,
                               "auto_tau": taus, "kernels": kernels_line}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
