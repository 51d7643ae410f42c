"""The native fused ops of a decode / verify step (quickdraft/kernels/ops_cpu.cpp): RMSNorm, RoPE
and attention over the cache, against the torch formulas they replace, and batch invariant."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from quickdraft import kernels
from quickdraft.config import ModelConfig
from quickdraft.models.forward_pass import Step, causal_mask
from quickdraft.models.layers import RMSNorm, Rope

requires_kernels = pytest.mark.skipif(kernels.load() is None, reason="native kernels unavailable")


def _ops():
    mod = kernels.load()
    assert mod is not None
    return mod


@requires_kernels
def test_rms_norm_matches_torch_and_is_row_invariant():
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(7, 96) * 3
    with torch.inference_mode():
        fast = norm(x)  # the native op (inference, fp32, CPU)
    with torch.no_grad(), torch.enable_grad():
        slow = norm(x)  # autograd on: the torch formula
    assert slow.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=2e-6, atol=1e-6)
    with torch.inference_mode():
        assert all(torch.equal(norm(x[i : i + 1]), fast[i : i + 1]) for i in range(7))
        assert torch.equal(_ops().rms_norm(torch.zeros(2, 96), norm.weight, 1e-6), torch.zeros(2, 96))


@requires_kernels
def test_argmax_rows_is_torch_argmax():
    """The kernels' argmax gives torch.argmax's index on every row: the first of tied maxima (anywhere in a
    vector or in the tail), the first NaN in a row holding NaNs, 0 for a row of -inf, -0.0 tied with 0.0,
    rows of 1 to 8 * 1024 + 7 values; greedy_tokens takes it for CPU float32 rows."""
    from quickdraft.sampling import greedy_tokens

    g = torch.Generator().manual_seed(3)
    for v in (1, 3, 8, 9, 15, 16, 17, 1000, 8 * 1024 + 7):
        x = torch.randn(12, v, generator=g)
        top = x.max(dim=1).values
        if v > 1:
            x[1, v - 1] = top[1] + 1  # the maximum in the tail (or the last vector)
            x[2, :] = 5.0  # every value tied: the first
            x[3, v // 2] = x[3, v - 1] = top[3] + 2  # tied in the middle and at the end
            x[4, 1:] = float("nan")  # NaN from index 1
            x[5, v - 1] = float("nan")
            x[6, 0], x[6, v - 1] = -0.0, 0.0
            x[6, 1:v - 1] = -1.0
        x[7] = float("-inf")
        x[8, 0] = float("inf")
        x[9, v - 1] = float("inf")
        x[10] = float("nan")
        got = _ops().argmax_rows(x)
        assert torch.equal(got, x.argmax(dim=1)), v
        assert torch.equal(greedy_tokens(x), got)
    with pytest.raises(RuntimeError, match="empty row"):
        _ops().argmax_rows(torch.zeros(2, 0))


@requires_kernels
def test_rope_matches_torch_bitwise():
    cfg = ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    )
    rope = Rope(cfg, 64)
    x = torch.randn(5, 4, 16).transpose(0, 1)  # [heads, T, D], strided like the projections' views
    pos = torch.tensor([3, 9, 10, 11, 40])
    fast = _ops().rope(x, rope.cos, rope.sin, pos)
    half = 8
    ref = x * rope.cos[pos] + torch.cat([-x[..., half:], x[..., :half]], -1) * rope.sin[pos]
    assert torch.equal(fast, ref)
    with pytest.raises(RuntimeError, match="outside the rope table"):
        _ops().rope(x, rope.cos, rope.sin, torch.tensor([0, 1, 2, 3, 64]))


def _sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=True)[0]


@requires_kernels
@pytest.mark.parametrize("d", [64, 128, 72])
def test_attend_chain_window_and_tree(d):
    """Each query row over its slots agrees with SDPA; a row's result is bitwise the same alone or
    with other rows; a tree row equals the chain row that sees the same keys in the same order."""
    g = torch.Generator().manual_seed(d)
    hq, hkv, start, t = 6, 2, 37, 5
    k = torch.randn(hkv, 64, d, generator=g)
    v = torch.randn(hkv, 64, d, generator=g)
    q = torch.randn(hq, t, d, generator=g)
    scale = 1 / math.sqrt(d)
    ops = _ops()
    out = ops.attend(q, k[:, : start + t], v[:, : start + t], start, 0, scale, None, None)
    assert out.shape == (t, hq * d)
    for i in range(t):
        end = start + i + 1
        ref = _sdpa(q[:, i : i + 1], k[:, :end], v[:, :end], scale)[:, 0]
        torch.testing.assert_close(out[i].view(hq, d), ref, rtol=1e-5, atol=1e-6)
        alone = ops.attend(q[:, i : i + 1], k[:, :end], v[:, :end], end - 1, 0, scale, None, None)
        assert torch.equal(alone[0], out[i])
    win = ops.attend(q, k[:, : start + t], v[:, : start + t], start, 8, scale, None, None)
    for i in range(t):
        end = start + i + 1
        ref = _sdpa(q[:, i : i + 1], k[:, end - 8 : end], v[:, end - 8 : end], scale)[:, 0]
        torch.testing.assert_close(win[i].view(hq, d), ref, rtol=1e-5, atol=1e-6)
    # tree: rows see the prefix and some of the pass's slots, listed in slot order
    rows = [torch.arange(start + 1), torch.cat([torch.arange(start), torch.tensor([start + 2])]),
            torch.cat([torch.arange(start), torch.tensor([start, start + 3])])]
    flat = torch.cat(rows)
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
    tree = ops.attend(q[:, :3], k[:, : start + 4], v[:, : start + 4], start, 0, scale, flat, offsets)
    for i, r in enumerate(rows):
        ref = _sdpa(q[:, i : i + 1], k[:, r], v[:, r], scale)[:, 0]
        torch.testing.assert_close(tree[i].view(hq, d), ref, rtol=1e-5, atol=1e-6)
    # the same keys in consecutive slots (after compaction): bitwise the chain result
    kc, vc = k[:, rows[2]].contiguous(), v[:, rows[2]].contiguous()
    chain = ops.attend(q[:, 2:3], kc, vc, len(rows[2]) - 1, 0, scale, None, None)
    assert torch.equal(chain[0], tree[2])


@requires_kernels
@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_attend_with_sinks_is_sink_attention_and_row_invariant(cache):
    """GPT-OSS's sinks: each row's softmax over its slots and one more key of value zero scored by
    its head's sink equals SinkAttention's torch formula (chain rows, a window, tree rows, 1-17 rows
    blocked or not), a row alone is bitwise the same row in the pass, and very negative sinks give
    plain attention."""
    from quickdraft.models.gpt_oss import SinkAttention

    g = torch.Generator().manual_seed(11)
    hq, hkv, d, start, t = 8, 2, 64, 40, 17
    k = torch.randn(hkv, start + t, d, generator=g).to(getattr(torch, cache))
    v = torch.randn(hkv, start + t, d, generator=g).to(getattr(torch, cache))
    q = torch.randn(hq, t, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 3
    layer = SinkAttention.__new__(SinkAttention)  # (its sdpa reads nh, nkv, scale and sinks only)
    torch.nn.Module.__init__(layer)
    layer.nh, layer.nkv, layer.scale, layer.sinks = hq, hkv, 1 / math.sqrt(d), torch.nn.Parameter(sinks)
    ops = _ops()
    for window in (0, 9):
        out = ops.attend(q, k, v, start, window, layer.scale, None, None, None, None, sinks)
        for i in range(t):
            end = start + i + 1
            lo = max(0, end - window) if window else 0
            with torch.no_grad():
                ref = layer.sdpa(q[:, i : i + 1], k[:, lo:end].float(), v[:, lo:end].float(), None)[:, 0]
            torch.testing.assert_close(out[i].view(hq, d), ref, rtol=1e-5, atol=1e-6)
            alone = ops.attend(q[:, i : i + 1], k[:, :end], v[:, :end], end - 1, window, layer.scale, None, None,
                               None, None, sinks)
            assert torch.equal(alone[0], out[i])
    rows = [torch.arange(start + 1), torch.cat([torch.arange(start), torch.tensor([start + 2])])]
    flat = torch.cat(rows)
    offsets = torch.tensor([0, len(rows[0]), len(rows[0]) + len(rows[1])])
    tree = ops.attend(q[:, :2], k, v, start, 0, layer.scale, flat, offsets, None, None, sinks)
    for i, r in enumerate(rows):
        with torch.no_grad():
            ref = layer.sdpa(q[:, i : i + 1], k[:, r].float(), v[:, r].float(), None)[:, 0]
        torch.testing.assert_close(tree[i].view(hq, d), ref, rtol=1e-5, atol=1e-6)
    plain = ops.attend(q, k, v, start, 0, layer.scale, None, None)
    gone = ops.attend(q, k, v, start, 0, layer.scale, None, None, None, None, torch.full((hq,), -1e30))
    assert torch.equal(plain, gone)
    with pytest.raises(RuntimeError, match="sinks must be"):
        ops.attend(q, k, v, start, 0, layer.scale, None, None, None, None, torch.zeros(hq - 1))


@requires_kernels
def test_attend_rejects_bad_input():
    ops = _ops()
    q, k = torch.randn(4, 2, 16), torch.randn(2, 10, 16)
    with pytest.raises(RuntimeError, match="rows reach past the keys"):
        ops.attend(q, k, k, 9, 0, 0.25, None, None)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        ops.attend(torch.randn(3, 2, 16), k, k, 0, 0, 0.25, None, None)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.attend(q, k, k, 0, 0, 0.25, torch.tensor([0, 11]), torch.tensor([0, 1, 2]))


@requires_kernels
def test_step_flat_slots_follow_the_tree_mask():
    mask = causal_mask(4, 3, torch.device("cpu"))
    assert mask is not None
    mask[2, 5] = False  # row 2 does not see row 1 (a sibling)
    step = Step(positions=torch.tensor([4, 5, 5]), start=4, mask=mask, cache=None, tree=True)  # type: ignore[arg-type]
    flat, offsets = step.flat_slots(None)
    assert offsets.tolist() == [0, 5, 11, 17]
    assert flat[11:].tolist() == [0, 1, 2, 3, 4, 6]
    assert Step(positions=torch.arange(3), start=0, mask=None, cache=None).flat_slots(None) == (None, None)  # type: ignore[arg-type]


@requires_kernels
def test_attend_writes_the_new_keys_first():
    """With k_new / v_new the op stores them at start .. start + T - 1 (strided inputs) and then
    attends exactly as over a cache written beforehand."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, start, t = 4, 2, 32, 10, 3
    k = torch.randn(hkv, 20, d, generator=g)
    v = torch.randn(hkv, 20, d, generator=g)
    kn = torch.randn(t, hkv, d, generator=g).transpose(0, 1)  # [Hkv, T, D] views, like the projections'
    vn = torch.randn(t, hkv, d, generator=g).transpose(0, 1)
    q = torch.randn(hq, t, d, generator=g)
    ops = _ops()
    k2, v2 = k.clone(), v.clone()
    out = ops.attend(q, k2, v2, start, 0, 0.2, None, None, kn, vn)
    assert torch.equal(k2[:, start : start + t], kn) and torch.equal(v2[:, start : start + t], vn)
    assert torch.equal(k2[:, start + t :], k[:, start + t :])  # nothing else touched
    ref = ops.attend(q, k2[:, : start + t], v2[:, : start + t], start, 0, 0.2, None, None)
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="reach past the cache"):
        ops.attend(q, k2, v2, 18, 0, 0.2, None, None, kn, vn)


@requires_kernels
def test_attend_over_a_float16_cache_is_the_float32_result_of_its_values():
    """An fp16 cache: new keys and values are rounded as torch's .half() rounds them, then every
    row (chain, window, tree) computes bitwise what it computes over an fp32 cache holding the same
    (widened) values, and a row alone equals the same row in a pass."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, start, t = 12, 2, 64, 30, 4
    k = torch.randn(hkv, 48, d, generator=g) * 3
    v = torch.randn(hkv, 48, d, generator=g) * 3
    kn = torch.randn(t, hkv, d, generator=g).transpose(0, 1) * 3
    vn = torch.randn(t, hkv, d, generator=g).transpose(0, 1) * 3
    q = torch.randn(hq, t, d, generator=g)
    ops = _ops()
    kh, vh = k.half(), v.half()
    out = ops.attend(q, kh, vh, start, 0, 0.125, None, None, kn, vn)
    assert torch.equal(kh[:, start : start + t], kn.half()) and torch.equal(vh[:, start : start + t], vn.half())
    kf, vf = kh.float(), vh.float()  # the same values in fp32
    assert torch.equal(out, ops.attend(q, kf[:, : start + t], vf[:, : start + t], start, 0, 0.125, None, None))
    for i in range(t):
        end = start + i + 1
        alone = ops.attend(q[:, i : i + 1], kh[:, :end], vh[:, :end], end - 1, 0, 0.125, None, None)
        assert torch.equal(alone[0], out[i])
        ref = _sdpa(q[:, i : i + 1], kf[:, :end], vf[:, :end], 0.125)[:, 0]
        torch.testing.assert_close(out[i].view(hq, d), ref, rtol=1e-5, atol=1e-5)
    win = ops.attend(q, kh[:, : start + t], vh[:, : start + t], start, 8, 0.125, None, None)
    assert torch.equal(win, ops.attend(q, kf[:, : start + t], vf[:, : start + t], start, 8, 0.125, None, None))
    rows = torch.cat([torch.arange(start), torch.tensor([start + 1])])
    offsets = torch.tensor([0, rows.numel()])
    tree = ops.attend(q[:, :1], kh[:, : start + 2], vh[:, : start + 2], start, 0, 0.125, rows, offsets)
    assert torch.equal(tree, ops.attend(q[:, :1], kf[:, : start + 2], vf[:, : start + 2], start, 0, 0.125, rows, offsets))
    with pytest.raises(RuntimeError, match="one type"):
        ops.attend(q, kh, vf, start, 0, 0.125, None, None)


@requires_kernels
@pytest.mark.parametrize("t", [1, 4, 19])
def test_attend_over_a_q8_0_cache_is_the_float32_result_of_its_values(t):
    """A q8_0 cache (--kv-dtype q8_0): new keys and values are quantized as quantize_q8_0 does, bit
    for bit (zero blocks included), and every row (chain across several key tiles, window, tree)
    computes bitwise what it computes over an fp32 cache holding the dequantized values (q * d is
    exact in fp32); a row alone equals the same row in a pass."""
    from quickdraft.cache import dequantize_q8_0, quantize_q8_0

    g = torch.Generator().manual_seed(11)
    hq, hkv, d, start = 6, 2, 64, 150
    k = torch.randn(hkv, start + 24, d, generator=g) * 3
    v = torch.randn(hkv, start + 24, d, generator=g) * 3
    kn = torch.randn(t, hkv, d, generator=g).transpose(0, 1) * 3
    vn = torch.randn(t, hkv, d, generator=g).transpose(0, 1) * 3
    kn[0, 0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    q = torch.randn(hq, t, d, generator=g)
    ops = _ops()
    kq, vq = quantize_q8_0(k), quantize_q8_0(v)
    assert kq.dtype == torch.uint8 and kq.shape == (hkv, start + 24, d // 32 * 34)
    out = ops.attend(q, kq, vq, start, 0, 0.125, None, None, kn, vn)
    assert torch.equal(kq[:, start : start + t], quantize_q8_0(kn)) and torch.equal(vq[:, start : start + t], quantize_q8_0(vn))
    kf, vf = dequantize_q8_0(kq), dequantize_q8_0(vq)
    assert (kf[0, start, :32] == 0).all()
    torch.testing.assert_close(kf[:, :start], k[:, :start], rtol=0, atol=3 * k.abs().max().item() / 254)
    assert torch.equal(out, ops.attend(q, kf[:, : start + t], vf[:, : start + t], start, 0, 0.125, None, None))
    for i in {0, t - 1}:
        end = start + i + 1
        alone = ops.attend(q[:, i : i + 1], kq[:, :end], vq[:, :end], end - 1, 0, 0.125, None, None)
        assert torch.equal(alone[0], out[i])
        ref = _sdpa(q[:, i : i + 1], kf[:, :end], vf[:, :end], 0.125)[:, 0]
        torch.testing.assert_close(out[i].view(hq, d), ref, rtol=1e-5, atol=1e-5)
    win = ops.attend(q, kq[:, : start + t], vq[:, : start + t], start, 70, 0.125, None, None)
    assert torch.equal(win, ops.attend(q, kf[:, : start + t], vf[:, : start + t], start, 70, 0.125, None, None))
    rows = torch.cat([torch.arange(start), torch.tensor([start + t - 1])])
    offsets = torch.tensor([0, rows.numel()])
    tree = ops.attend(q[:, :1], kq[:, : start + t], vq[:, : start + t], start, 0, 0.125, rows, offsets)
    assert torch.equal(tree, ops.attend(q[:, :1], kf[:, : start + t], vf[:, : start + t], start, 0, 0.125, rows, offsets))
    with pytest.raises(RuntimeError, match="q8_0: of 32"):
        ops.attend(torch.randn(2, 1, 48), quantize_q8_0(torch.randn(1, 4, 64))[..., :51], quantize_q8_0(torch.randn(1, 4, 64))[..., :51], 3, 0, 0.1, None, None)
