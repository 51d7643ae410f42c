// A whole decoder stack (the Llama / Qwen2 / Qwen3 / Mistral layer) in one native call per pass.
//
// The Python model runs ~20 small calls per layer (norms, q/k/v, RoPE, attention, residuals, MLP)
// and each costs microseconds of interpreter and dispatch time: ~5 ms of a 36 ms decode step of a
// 28-layer model. DecoderStack holds the layers' weights (GGML blocks as the q8 GEMM takes them,
// norm weights, RoPE tables) and runs every layer of a decode or verification pass from C++, with
// the Python path's own functions (the q8 GEMM, rms_norm, rope, attend) and the same torch ops for
// the rest (silu, *; the residual adds are made by the GEMM as it stores, the one rounding torch's +
// makes): bitwise the Python path's results (tests/test_native_stack.py).

#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "ops_api.h"

namespace {

using qd_api::WeightSpec;
using OptTensor = c10::optional<torch::Tensor>;

// The layer loop every stack runs: x [T, H] (CPU float32) through x = layer(i, x) for i < n, with the
// inputs of the layers in capture (index n: the last layer's output).
template <class Layer>
std::tuple<torch::Tensor, std::vector<torch::Tensor>> run_layers(torch::Tensor x, int64_t n,
                                                                 const std::vector<int64_t>& capture, Layer&& layer) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "x must be a CPU float32 tensor [T, H]");
  std::vector<torch::Tensor> captured;
  const auto wants = [&](int64_t i) { return std::find(capture.begin(), capture.end(), i) != capture.end(); };
  x = x.contiguous();
  for (int64_t i = 0; i < n; ++i) {
    if (wants(i)) captured.push_back(x);
    x = layer(i, x);
  }
  if (wants(n)) captured.push_back(x);
  return {x, captured};
}

// One key and one value cache view per layer (a stack whose layers differ in head shape).
void check_layer_caches(const std::vector<torch::Tensor>& k_layers, const std::vector<torch::Tensor>& v_layers,
                        int64_t n) {
  TORCH_CHECK(static_cast<int64_t>(k_layers.size()) == n && static_cast<int64_t>(v_layers.size()) == n,
              "one key and one value cache per layer");
}

// input norm, post-attention norm, q norm, k norm (None: no q/k norms), [q, k, v], o, [gate, up], down
using LayerSpec = std::tuple<torch::Tensor, torch::Tensor, OptTensor, OptTensor, std::vector<WeightSpec>, WeightSpec,
                             std::vector<WeightSpec>, WeightSpec>;

class DecoderStack {
 public:
  DecoderStack(std::vector<LayerSpec> layers, torch::Tensor cos, torch::Tensor sin, double eps, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double scale, int64_t window)
      : layers_(std::move(layers)),
        cos_(std::move(cos)),
        sin_(std::move(sin)),
        eps_(eps),
        nh_(heads),
        nkv_(kv_heads),
        hd_(head_dim),
        scale_(scale),
        window_(window) {
    TORCH_CHECK(!layers_.empty(), "a decoder stack needs layers");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H] -> (hidden state after the last layer [T, H], the inputs of the layers in capture;
  // index num_layers = the output). Writes the pass's keys / values into slots start .. start+T-1
  // of k_cache / v_cache [layers, kv heads, S, D]. slots / offsets: tree rows (as attend takes them).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run(torch::Tensor x, const torch::Tensor& positions,
                                                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                                            int64_t start, const OptTensor& slots,
                                                            const OptTensor& offsets, std::vector<int64_t> capture) {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == num_layers() &&
                    v_cache.size(0) == num_layers(),
                "the caches must be [layers, kv heads, S, D] for ", num_layers(), " layers");
    const int64_t T = x.size(0);
    return run_layers(x, num_layers(), capture, [&](int64_t i, torch::Tensor x) {
      const auto& [in_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down] = layers_[i];
      auto p = qd_api::linear_multi(qd_api::rms_norm(x, in_norm, eps_), qkv);
      torch::Tensor q = p[0].view({T, nh_, hd_}).transpose(0, 1);  // [Hq, T, D]
      torch::Tensor k = p[1].view({T, nkv_, hd_}).transpose(0, 1);
      torch::Tensor v = p[2].view({T, nkv_, hd_}).transpose(0, 1);
      if (q_norm.has_value() && q_norm->defined()) {
        q = qd_api::rms_norm(q.contiguous(), *q_norm, eps_);
        k = qd_api::rms_norm(k.contiguous(), *k_norm, eps_);
      }
      q = qd_api::rope(q, cos_, sin_, positions);
      k = qd_api::rope(k, cos_, sin_, positions);
      const auto att = qd_api::attend(q, k_cache.select(0, i), v_cache.select(0, i), start, window_, scale_, slots,
                                      offsets, k, v);
      x = qd_api::linear_multi(att, {o}, x)[0];  // x + o(att), added as it is stored
      const auto gu = qd_api::linear_multi(qd_api::rms_norm(x, post_norm, eps_), gate_up);
      torch::Tensor h = gu[0];  // silu(gate) * up, in place: the same elementwise ops, no new tensors
      at::silu_(h);
      h.mul_(gu[1]);
      return qd_api::linear_multi(h, {down}, x)[0];
    });
  }

 private:
  std::vector<LayerSpec> layers_;
  torch::Tensor cos_, sin_;
  double eps_;
  int64_t nh_, nkv_, hd_;
  double scale_;
  int64_t window_;
};

// A float32 linear (weight [N, K], no bias) as quickdraft.models.batch_invariance.blocked_linear
// computes it for passes of up to NATIVE_CHAIN_ROWS rows: blocks of kRowBlock rows, zero-padded.
constexpr int64_t kRowBlock = 8;
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& w, const OptTensor& b = c10::nullopt) {
  const int64_t T = x.size(0), pad = (kRowBlock - T % kRowBlock) % kRowBlock;
  const torch::Tensor xp = pad ? at::cat({x, x.new_zeros({pad, x.size(1)})}) : x;
  std::vector<torch::Tensor> blocks;
  for (int64_t i = 0; i < T + pad; i += kRowBlock) blocks.push_back(at::linear(xp.narrow(0, i, kRowBlock), w, b));
  return (blocks.size() > 1 ? at::cat(blocks) : blocks[0]).narrow(0, 0, T);
}

// A projection the Python layer runs either as a q8 GGML block matrix or as a float32 Linear.
struct Proj {
  std::optional<WeightSpec> q8;
  OptTensor w, b;
  torch::Tensor operator()(const torch::Tensor& x) const {
    return q8.has_value() ? qd_api::linear_multi(x, {*q8})[0] : blocked_linear(x, *w, b);
  }
};

// An element-wise function of x [T, n] with each row padded to a multiple of lanes
// (quickdraft.models.moe.rowwise: torch's vectorised path for every element at any T).
template <class F>
torch::Tensor rowwise(const torch::Tensor& x, int64_t lanes, F&& f) {
  const int64_t n = x.size(-1);
  if (n % lanes == 0) return f(x);
  return f(at::constant_pad_nd(x, {0, lanes - n % lanes}, 0)).narrow(-1, 0, n);
}

// Routed experts (quickdraft.models.moe.SparseMoE: the router, its top k, each chosen expert once
// over its rows in grouped GEMM calls, outputs summed per row in rank order) and an optional shared
// expert with its sigmoid gate, in the same torch ops and kernels: bitwise the Python block.
struct ExpertBlock {
  Proj router;
  int64_t routing;  // 0: softmax then top k (renormalised or not), 1: top k then softmax
  bool renormalize;
  int64_t top_k;
  std::vector<std::vector<WeightSpec>> experts;  // [gate, up, down] each
  int64_t activation;  // 0: silu(gate) * up; 1: GPT-OSS's clamped swiglu (alpha, limit); 2: tanh-gelu(gate) * up
  double alpha, limit;
  int64_t row_lanes;
  std::vector<WeightSpec> shared;  // [gate, up, down] or empty
  Proj shared_gate;                // (used where shared_gate.w or .q8 is set)
  // Gemma 4's router: its input normed without a weight (norm_eps), times router_scale [H] and
  // router_root, and each chosen expert's weight times expert_scale [E]
  OptTensor router_scale, expert_scale;
  double router_root, norm_eps;

  torch::Tensor activate(const torch::Tensor& gate, const torch::Tensor& up) const {
    if (activation == 0) return at::silu(gate) * up;
    if (activation == 2) return at::gelu(gate, "tanh") * up;
    const torch::Tensor g = at::clamp(gate, c10::nullopt, limit);
    const torch::Tensor u = at::clamp(up, -limit, limit);
    return (u + 1) * (g * rowwise(g * alpha, row_lanes, [](const torch::Tensor& t) { return at::sigmoid(t); }));
  }

  torch::Tensor operator()(const torch::Tensor& x) const { return (*this)(x, x); }

  // the router reads r, the experts x (Gemma 4: the layer's input and its second pre-feedforward norm)
  torch::Tensor operator()(const torch::Tensor& r, const torch::Tensor& x) const {
    const int64_t T = x.size(0), H = x.size(1), k = top_k;
    torch::Tensor logits;
    if (router_scale.has_value())
      logits = router(r * at::rsqrt(r.pow(2).mean(-1, true) + norm_eps) * *router_scale * router_root);
    else
      logits = router(r);
    torch::Tensor weights, chosen;
    if (routing == 0) {
      std::tie(weights, chosen) = at::topk(at::softmax(logits, -1), k, -1);
      if (renormalize) weights = weights / weights.sum(-1, true);
    } else {
      torch::Tensor top;
      std::tie(top, chosen) = at::topk(logits, k, -1);
      weights = at::softmax(top, -1);
    }
    if (expert_scale.has_value()) weights = weights * expert_scale->index({chosen});
    // each chosen expert's slots (row * k + rank), experts in the order they first appear
    const auto ch = chosen.contiguous();
    const int64_t* cp = ch.data_ptr<int64_t>();
    std::vector<int64_t> group_of(experts.size(), -1), expert_of;
    std::vector<std::vector<int64_t>> slots;
    for (int64_t s = 0; s < T * k; ++s) {
      const int64_t e = cp[s];
      TORCH_CHECK(e >= 0 && e < static_cast<int64_t>(experts.size()), "router chose expert ", e);
      if (group_of[e] < 0) {
        group_of[e] = static_cast<int64_t>(expert_of.size());
        expert_of.push_back(e);
        slots.emplace_back();
      }
      slots[group_of[e]].push_back(s);
    }
    const int64_t G = static_cast<int64_t>(expert_of.size());
    std::vector<int64_t> counts, order, src;
    for (const auto& g : slots) {
      counts.push_back(static_cast<int64_t>(g.size()));
      for (int64_t s : g) {
        order.push_back(s);
        src.push_back(s / k);
      }
    }
    const torch::Tensor rows = x.index_select(0, torch::tensor(src, torch::kInt64));
    std::vector<WeightSpec> in_specs, down_specs;
    std::vector<int64_t> in_groups, down_groups;
    for (int64_t g = 0; g < G; ++g) {
      const auto& ex = experts[expert_of[g]];
      in_specs.push_back(ex[0]);
      in_specs.push_back(ex[1]);
      in_groups.insert(in_groups.end(), {g, g});
      down_specs.push_back(ex[2]);
      down_groups.push_back(g);
    }
    const auto in = qd_api::linear_grouped(rows.contiguous(), counts, in_specs, in_groups);
    std::vector<torch::Tensor> gates, ups;
    for (int64_t g = 0; g < G; ++g) {
      gates.push_back(in[2 * g]);
      ups.push_back(in[2 * g + 1]);
    }
    const torch::Tensor hidden = activate(at::cat(gates), at::cat(ups));
    const auto down = qd_api::linear_grouped(hidden.contiguous(), counts, down_specs, down_groups);
    torch::Tensor ys = x.new_empty({T * k, H});
    ys.index_copy_(0, torch::tensor(order, torch::kInt64), at::cat(down));
    ys = ys.view({T, k, H});
    torch::Tensor out = ys.select(1, 0) * weights.narrow(1, 0, 1);
    for (int64_t r = 1; r < k; ++r) out = out + ys.select(1, r) * weights.narrow(1, r, 1);
    if (!shared.empty()) {
      const auto gu = qd_api::linear_multi(x, {shared[0], shared[1]});
      torch::Tensor sh = qd_api::linear_multi(at::silu(gu[0]) * gu[1], {shared[2]})[0];
      if (shared_gate.q8.has_value() || shared_gate.w.has_value())
        sh = rowwise(shared_gate(x), row_lanes, [](const torch::Tensor& t) { return at::sigmoid(t); }) * sh;
      out = out + sh;
    }
    return out;
  }
};

// Qwen3.5's hybrid stack (Gated DeltaNet layers between gated full-attention layers; norms times
// 1 + w; a dense SiLU MLP) in one native call per pass, as DecoderStack does for the standard layer:
// the Python layers' own kernels (q8 GEMMs, rms_norm, rope, attend, gated_delta_rows) and the same
// torch ops for the rest (sigmoid, silu, *, cat, and the fixed 8-row blocks of a float32 linear),
// so bitwise their results (tests/test_native_stack.py). The recurrent state stays the cache's: the
// caller hands each Gated DeltaNet layer the states its rows without a parent continue and gets
// back the states of the rows ``keep`` names, per layer.
class HybridStack {
 public:
  HybridStack(torch::Tensor cos, torch::Tensor sin, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double scale, int64_t window)
      : cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), nh_(heads), nkv_(kv_heads), hd_(head_dim),
        scale_(scale), window_(window) {}

  // A Gated DeltaNet layer: proj [qkv, z] (+ [b, a] when q8), or b_w / a_w float32 [Hv, H].
  void add_delta(torch::Tensor in_norm, torch::Tensor post_norm, std::vector<WeightSpec> proj, OptTensor b_w,
                 OptTensor a_w, torch::Tensor conv_w, torch::Tensor a_log, torch::Tensor dt_bias, torch::Tensor norm_w,
                 double norm_eps, int64_t nk, int64_t dk, int64_t nv, int64_t dv, bool tiled, WeightSpec out,
                 std::vector<WeightSpec> gate_up, std::optional<WeightSpec> down, std::optional<ExpertBlock> experts) {
    TORCH_CHECK(proj.size() == 4 || (proj.size() == 2 && b_w.has_value() && a_w.has_value()),
                "a Gated DeltaNet layer takes [qkv, z, b, a] blocks or [qkv, z] and float32 b / a");
    TORCH_CHECK(experts.has_value() || down.has_value(), "a layer has a dense MLP or routed experts");
    kinds_.push_back(static_cast<int64_t>(deltas_.size()));
    experts_.push_back(std::move(experts));
    deltas_.push_back({std::move(in_norm), std::move(post_norm), std::move(proj), std::move(b_w), std::move(a_w),
                       std::move(conv_w), std::move(a_log), std::move(dt_bias), std::move(norm_w), norm_eps, nk, dk, nv,
                       dv, tiled, std::move(out), std::move(gate_up), std::move(down)});
  }

  // A gated full-attention layer: qkv [q and its gate (2 x heads x D), k, v].
  void add_attention(torch::Tensor in_norm, torch::Tensor post_norm, torch::Tensor q_norm, torch::Tensor k_norm,
                     std::vector<WeightSpec> qkv, WeightSpec o, std::vector<WeightSpec> gate_up,
                     std::optional<WeightSpec> down, std::optional<ExpertBlock> experts) {
    TORCH_CHECK(experts.has_value() || down.has_value(), "a layer has a dense MLP or routed experts");
    kinds_.push_back(-1 - static_cast<int64_t>(attns_.size()));
    experts_.push_back(std::move(experts));
    attns_.push_back({std::move(in_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), std::move(qkv),
                      std::move(o), std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(kinds_.size()); }

  // x [T, H] -> (hidden state after the last layer, the captured layer inputs, per Gated DeltaNet
  // layer [T windows, T states] (undefined where keep is false)). Keys / values go into slots
  // start.. of k_cache / v_cache [attention layers, kv heads, S, D]; parents / start_convs /
  // start_states / keep: as gated_delta_rows takes them, the starts per Gated DeltaNet layer.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>> run(
      torch::Tensor x, const torch::Tensor& positions, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
      int64_t start, const OptTensor& slots, const OptTensor& offsets, std::vector<int64_t> capture,
      const std::vector<int64_t>& parents, const std::vector<std::vector<torch::Tensor>>& start_convs,
      const std::vector<std::vector<torch::Tensor>>& start_states, const std::vector<bool>& keep) {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == static_cast<int64_t>(attns_.size()) &&
                    v_cache.size(0) == static_cast<int64_t>(attns_.size()),
                "the caches must be [attention layers, kv heads, S, D] for ", attns_.size(), " layers");
    TORCH_CHECK(start_convs.size() == deltas_.size() && start_states.size() == deltas_.size(),
                "one list of start windows and states per Gated DeltaNet layer");
    const int64_t T = x.size(0);
    std::vector<std::vector<torch::Tensor>> rows;
    auto [out, captured] = run_layers(x, num_layers(), capture, [&](int64_t i, torch::Tensor x) {
      const int64_t kind = kinds_[i];
      const auto& [in_norm, post_norm, gate_up, down] =
          kind >= 0 ? std::tie(deltas_[kind].in_norm, deltas_[kind].post_norm, deltas_[kind].gate_up, deltas_[kind].down)
                    : std::tie(attns_[-1 - kind].in_norm, attns_[-1 - kind].post_norm, attns_[-1 - kind].gate_up,
                               attns_[-1 - kind].down);
      const torch::Tensor h = qd_api::rms_norm(x, in_norm, eps_, 1.0);
      if (kind >= 0) {
        const Delta& d = deltas_[kind];
        auto p = qd_api::linear_multi(h, d.proj);
        if (d.proj.size() == 2) {
          p.push_back(blocked_linear(h, *d.b_w));
          p.push_back(blocked_linear(h, *d.a_w));
        }
        auto r = qd_api::gated_delta_rows(p[0].contiguous(), p[1].contiguous(), p[2].contiguous(), p[3].contiguous(),
                                          d.conv_w, d.a_log.exp().neg(), d.dt_bias, d.norm_w, d.norm_eps, d.nk, d.dk,
                                          d.nv, d.dv, d.tiled, parents, start_convs[kind], start_states[kind], keep);
        x = qd_api::linear_multi(r[0], {d.out}, x)[0];  // x + out_proj(o), added as it is stored
        rows.emplace_back(r.begin() + 1, r.end());
      } else {
        const int64_t a_index = -1 - kind;
        const Attn& a = attns_[a_index];
        auto p = qd_api::linear_multi(h, a.qkv);
        const torch::Tensor qg = p[0].view({T, nh_, 2 * hd_});
        torch::Tensor q = qg.narrow(2, 0, hd_).transpose(0, 1);  // [Hq, T, D]
        const torch::Tensor gate = qg.narrow(2, hd_, hd_).reshape({T, nh_ * hd_});
        torch::Tensor k = p[1].view({T, nkv_, hd_}).transpose(0, 1);
        torch::Tensor v = p[2].view({T, nkv_, hd_}).transpose(0, 1);
        q = rope(qd_api::rms_norm(q.contiguous(), a.q_norm, eps_, 1.0), positions);
        k = rope(qd_api::rms_norm(k.contiguous(), a.k_norm, eps_, 1.0), positions);
        const auto att = qd_api::attend(q, k_cache.select(0, a_index), v_cache.select(0, a_index), start, window_,
                                        scale_, slots, offsets, k, v);
        x = qd_api::linear_multi(att * at::sigmoid(gate), {a.o}, x)[0];
      }
      const torch::Tensor hn = qd_api::rms_norm(x, post_norm, eps_, 1.0);
      if (experts_[i].has_value()) return x + (*experts_[i])(hn);
      const auto gu = qd_api::linear_multi(hn, gate_up);
      torch::Tensor m = gu[0];  // silu(gate) * up, in place
      at::silu_(m);
      m.mul_(gu[1]);
      return qd_api::linear_multi(m, {*down}, x)[0];
    });
    return {out, captured, rows};
  }

 private:
  struct Delta {
    torch::Tensor in_norm, post_norm;
    std::vector<WeightSpec> proj;
    OptTensor b_w, a_w;
    torch::Tensor conv_w, a_log, dt_bias, norm_w;
    double norm_eps;
    int64_t nk, dk, nv, dv;
    bool tiled;
    WeightSpec out;
    std::vector<WeightSpec> gate_up;
    std::optional<WeightSpec> down;
  };
  struct Attn {
    torch::Tensor in_norm, post_norm, q_norm, k_norm;
    std::vector<WeightSpec> qkv;
    WeightSpec o;
    std::vector<WeightSpec> gate_up;
    std::optional<WeightSpec> down;
  };

  // RoPE over the first cos.size(1) dims of each head (all of them, or Qwen3.5's partial rotary)
  torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& positions) const {
    const int64_t dim = cos_.size(1);
    if (dim == hd_) return qd_api::rope(x, cos_, sin_, positions);
    return at::cat({qd_api::rope(x.narrow(2, 0, dim), cos_, sin_, positions), x.narrow(2, dim, hd_ - dim)}, -1);
  }

  std::vector<int64_t> kinds_;  // per layer: its index among deltas_ (>= 0), or -1 - its index among attns_
  std::vector<std::optional<ExpertBlock>> experts_;  // per layer: routed experts instead of the dense MLP
  std::vector<Delta> deltas_;
  std::vector<Attn> attns_;
  torch::Tensor cos_, sin_;
  double eps_;
  int64_t nh_, nkv_, hd_;
  double scale_;
  int64_t window_;
};

// Gemma 4's stack (gemma-4-E2B / E4B: q/k norms, a weightless value norm, scale 1, sliding and full
// layers with their own head sizes and RoPE tables, KV-sharing layers that only read, norms after
// attention and MLP, the tanh-GELU MLP, per-layer inputs, a per-layer scalar) in one native call per
// pass, with the Python layers' own kernels and torch ops: bitwise their results
// (tests/test_native_stack.py); the 26B-A4B's routed experts beside the MLP through ExpertBlock.
class Gemma4Stack {
 public:
  Gemma4Stack(double eps, int64_t row_lanes) : eps_(eps), row_lanes_(row_lanes) {}

  // norms: input, post-attention, pre-feedforward, post-feedforward. k absent: a layer reading another
  // layer's keys and values; v absent (k present): values are the projected keys.
  void add_layer(std::vector<torch::Tensor> norms, WeightSpec q, std::optional<WeightSpec> k,
                 std::optional<WeightSpec> v, torch::Tensor q_norm, OptTensor k_norm, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, int64_t window, double scale, torch::Tensor cos, torch::Tensor sin, WeightSpec o,
                 std::vector<WeightSpec> gate_up, WeightSpec down, std::optional<WeightSpec> input_gate_q8,
                 OptTensor input_gate_w, std::optional<WeightSpec> input_proj_q8, OptTensor input_proj_w,
                 OptTensor input_norm, torch::Tensor scalar, std::optional<ExpertBlock> experts) {
    TORCH_CHECK(norms.size() == (experts.has_value() ? 7u : 4u),
                "a Gemma 4 layer has four norms (seven with routed experts)");
    TORCH_CHECK(k.has_value() || !v.has_value(), "a layer reading shared keys has no value projection");
    layers_.push_back({std::move(norms), std::move(q), std::move(k), std::move(v), std::move(q_norm),
                       std::move(k_norm), heads, kv_heads, head_dim, window, scale, std::move(cos), std::move(sin),
                       std::move(o), std::move(gate_up), std::move(down),
                       Proj{std::move(input_gate_q8), std::move(input_gate_w)},
                       Proj{std::move(input_proj_q8), std::move(input_proj_w)}, std::move(input_norm),
                       std::move(scalar), std::move(experts)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H] -> (hidden state after the last layer, the captured layer inputs). k_layers / v_layers:
  // each layer's cache [kv heads, S, D] (a sharing layer's: its source's); slots / offsets: tree rows
  // for full layers, window_slots / window_offsets for sliding ones; layer_inputs [T, layers, P] or None.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run(
      torch::Tensor x, const torch::Tensor& positions, const std::vector<torch::Tensor>& k_layers,
      const std::vector<torch::Tensor>& v_layers, int64_t start, const OptTensor& slots, const OptTensor& offsets,
      const OptTensor& window_slots, const OptTensor& window_offsets, const OptTensor& layer_inputs,
      std::vector<int64_t> capture) {
    check_layer_caches(k_layers, v_layers, num_layers());
    const int64_t T = x.size(0);
    return run_layers(x, num_layers(), capture, [&](int64_t i, torch::Tensor x) {
      const Layer& L = layers_[i];
      const torch::Tensor h = qd_api::rms_norm(x, L.norms[0], eps_);
      std::vector<WeightSpec> proj{L.q};
      if (L.k.has_value()) proj.push_back(*L.k);
      if (L.v.has_value()) proj.push_back(*L.v);
      const auto p = qd_api::linear_multi(h, proj);
      torch::Tensor q = p[0].view({T, L.nh, L.hd}).transpose(0, 1);  // [Hq, T, D]
      OptTensor k, v;
      q = qd_api::rope(qd_api::rms_norm(q.contiguous(), L.q_norm, eps_), L.cos, L.sin, positions);
      if (L.k.has_value()) {
        const torch::Tensor kr = p[1].view({T, L.nkv, L.hd}).transpose(0, 1);
        const torch::Tensor vr = (L.v.has_value() ? p[2] : p[1]).view({T, L.nkv, L.hd}).transpose(0, 1);
        v = vr * at::rsqrt(vr.pow(2).mean(-1, true) + eps_);  // the weightless value norm (torch's ops)
        k = qd_api::rope(qd_api::rms_norm(kr.contiguous(), *L.k_norm, eps_), L.cos, L.sin, positions);
      }
      const bool sliding = L.window > 0;
      const auto att = qd_api::attend(q, k_layers[i], v_layers[i], start, L.window, L.scale,
                                      sliding ? window_slots : slots, sliding ? window_offsets : offsets, k, v);
      x = x + qd_api::rms_norm(qd_api::linear_multi(att, {L.o})[0], L.norms[1], eps_);
      const auto gu = qd_api::linear_multi(qd_api::rms_norm(x, L.norms[2], eps_), L.gate_up);
      torch::Tensor m = qd_api::linear_multi(at::gelu(gu[0], "tanh") * gu[1], {L.down})[0];
      if (L.experts.has_value()) {  // routed experts beside the MLP, from the same input
        const torch::Tensor routed = (*L.experts)(x, qd_api::rms_norm(x, L.norms[4], eps_));
        m = qd_api::rms_norm(m, L.norms[5], eps_) + qd_api::rms_norm(routed, L.norms[6], eps_);
      }
      x = x + qd_api::rms_norm(m, L.norms[3], eps_);
      if (L.input_norm.has_value()) {
        TORCH_CHECK(layer_inputs.has_value(), "a Gemma 4 stack with per-layer inputs needs them");
        const torch::Tensor g =
            rowwise(L.input_gate(x), row_lanes_, [](const torch::Tensor& t) { return at::gelu(t, "tanh"); }) *
            layer_inputs->select(1, i);
        x = x + qd_api::rms_norm(L.input_proj(g), *L.input_norm, eps_);
      }
      return x * L.scalar;
    });
  }

 private:
  struct Layer {
    std::vector<torch::Tensor> norms;
    WeightSpec q;
    std::optional<WeightSpec> k, v;
    torch::Tensor q_norm;
    OptTensor k_norm;
    int64_t nh, nkv, hd, window;
    double scale;
    torch::Tensor cos, sin;
    WeightSpec o;
    std::vector<WeightSpec> gate_up;
    WeightSpec down;
    Proj input_gate, input_proj;
    OptTensor input_norm;
    torch::Tensor scalar;
    std::optional<ExpertBlock> experts;
  };

  std::vector<Layer> layers_;
  double eps_;
  int64_t row_lanes_;
};

// GPT-OSS's stack (the standard layer with q/k/v/o biases, per-head sinks, sliding windows on every
// other layer, and routed experts as its MLP) in one native call per pass: bitwise the Python layers
// (tests/test_native_stack.py).
class GptOssStack {
 public:
  GptOssStack(torch::Tensor cos, torch::Tensor sin, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double scale)
      : cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), nh_(heads), nkv_(kv_heads), hd_(head_dim),
        scale_(scale) {}

  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, std::vector<WeightSpec> qkv, WeightSpec o,
                 torch::Tensor sinks, int64_t window, ExpertBlock experts) {
    layers_.push_back({std::move(in_norm), std::move(post_norm), std::move(qkv), std::move(o), std::move(sinks), window,
                       std::move(experts)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run(
      torch::Tensor x, const torch::Tensor& positions, const std::vector<torch::Tensor>& k_layers,
      const std::vector<torch::Tensor>& v_layers, int64_t start, const OptTensor& slots, const OptTensor& offsets,
      const OptTensor& window_slots, const OptTensor& window_offsets, std::vector<int64_t> capture) {
    check_layer_caches(k_layers, v_layers, num_layers());
    const int64_t T = x.size(0);
    return run_layers(x, num_layers(), capture, [&](int64_t i, torch::Tensor x) {
      const Layer& L = layers_[i];
      const auto p = qd_api::linear_multi(qd_api::rms_norm(x, L.in_norm, eps_), L.qkv);
      const torch::Tensor q = qd_api::rope(p[0].view({T, nh_, hd_}).transpose(0, 1), cos_, sin_, positions);
      const torch::Tensor k = qd_api::rope(p[1].view({T, nkv_, hd_}).transpose(0, 1), cos_, sin_, positions);
      const torch::Tensor v = p[2].view({T, nkv_, hd_}).transpose(0, 1);
      const bool sliding = L.window > 0;
      const auto att = qd_api::attend(q, k_layers[i], v_layers[i], start, L.window, scale_, sliding ? window_slots : slots,
                                      sliding ? window_offsets : offsets, k, v, L.sinks);
      x = x + qd_api::linear_multi(att, {L.o})[0];
      return x + L.experts(qd_api::rms_norm(x, L.post_norm, eps_));
    });
  }

 private:
  struct Layer {
    torch::Tensor in_norm, post_norm;
    std::vector<WeightSpec> qkv;
    WeightSpec o;
    torch::Tensor sinks;
    int64_t window;
    ExpertBlock experts;
  };
  std::vector<Layer> layers_;
  torch::Tensor cos_, sin_;
  double eps_;
  int64_t nh_, nkv_, hd_;
  double scale_;
};

}  // namespace

void register_decode(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<std::vector<LayerSpec>, torch::Tensor, torch::Tensor, double, int64_t, int64_t, int64_t,
                          double, int64_t>(),
           pybind11::arg("layers"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("eps"),
           pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"),
           pybind11::arg("window"))
      .def("num_layers", &DecoderStack::num_layers)
      // the whole pass without the GIL (torch's C++ ops and the kernels never need it)
      .def("run", &DecoderStack::run, "(hidden [T, H], captured layer inputs) for one decode / verify pass",
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("x"), pybind11::arg("positions"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
           pybind11::arg("start"), pybind11::arg("slots") = pybind11::none(),
           pybind11::arg("offsets") = pybind11::none(), pybind11::arg("capture") = std::vector<int64_t>{});
  pybind11::class_<ExpertBlock>(m, "ExpertBlock")
      .def(pybind11::init([](std::optional<WeightSpec> router_q8, OptTensor router_w, OptTensor router_b, int64_t routing,
                             bool renormalize, int64_t top_k, std::vector<std::vector<WeightSpec>> experts,
                             int64_t activation, double alpha, double limit, int64_t row_lanes,
                             std::vector<WeightSpec> shared, std::optional<WeightSpec> shared_gate_q8,
                             OptTensor shared_gate_w, OptTensor router_scale, OptTensor expert_scale,
                             double router_root, double norm_eps) {
             for (const auto& e : experts) TORCH_CHECK(e.size() == 3, "an expert is [gate, up, down]");
             TORCH_CHECK(shared.empty() || shared.size() == 3, "a shared expert is [gate, up, down]");
             TORCH_CHECK(router_q8.has_value() || router_w.has_value(), "routed experts need a router");
             return ExpertBlock{Proj{std::move(router_q8), std::move(router_w), std::move(router_b)}, routing,
                                renormalize, top_k, std::move(experts), activation, alpha, limit, row_lanes,
                                std::move(shared), Proj{std::move(shared_gate_q8), std::move(shared_gate_w), c10::nullopt},
                                std::move(router_scale), std::move(expert_scale), router_root, norm_eps};
           }),
           pybind11::arg("router_q8"), pybind11::arg("router_w"), pybind11::arg("router_b"), pybind11::arg("routing"),
           pybind11::arg("renormalize"), pybind11::arg("top_k"), pybind11::arg("experts"), pybind11::arg("activation"),
           pybind11::arg("alpha"), pybind11::arg("limit"), pybind11::arg("row_lanes"), pybind11::arg("shared"),
           pybind11::arg("shared_gate_q8"), pybind11::arg("shared_gate_w"), pybind11::arg("router_scale") = pybind11::none(),
           pybind11::arg("expert_scale") = pybind11::none(), pybind11::arg("router_root") = 1.0,
           pybind11::arg("norm_eps") = 0.0);

  pybind11::class_<GptOssStack>(m, "GptOssStack")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, int64_t, int64_t, int64_t, double>(),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("eps"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"))
      .def("add_layer", &GptOssStack::add_layer, pybind11::arg("in_norm"), pybind11::arg("post_norm"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("sinks"), pybind11::arg("window"),
           pybind11::arg("experts"))
      .def("num_layers", &GptOssStack::num_layers)
      .def("run", &GptOssStack::run, "(hidden [T, H], captured layer inputs) for one pass",
           pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("k_layers"), pybind11::arg("v_layers"), pybind11::arg("start"), pybind11::arg("slots"),
           pybind11::arg("offsets"), pybind11::arg("window_slots"), pybind11::arg("window_offsets"),
           pybind11::arg("capture"));

  pybind11::class_<HybridStack>(m, "HybridStack")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, int64_t, int64_t, int64_t, double, int64_t>(),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("eps"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"), pybind11::arg("window"))
      .def("add_delta", &HybridStack::add_delta, pybind11::arg("in_norm"), pybind11::arg("post_norm"),
           pybind11::arg("proj"), pybind11::arg("b_w"), pybind11::arg("a_w"), pybind11::arg("conv_w"),
           pybind11::arg("a_log"), pybind11::arg("dt_bias"), pybind11::arg("norm_w"), pybind11::arg("norm_eps"),
           pybind11::arg("nk"), pybind11::arg("dk"), pybind11::arg("nv"), pybind11::arg("dv"), pybind11::arg("tiled"),
           pybind11::arg("out"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("experts"))
      .def("add_attention", &HybridStack::add_attention, pybind11::arg("in_norm"), pybind11::arg("post_norm"),
           pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("qkv"), pybind11::arg("o"),
           pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("experts"))
      .def("num_layers", &HybridStack::num_layers)
      .def("run", &HybridStack::run, "(hidden [T, H], captured layer inputs, per Gated DeltaNet layer [windows, states])",
           pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("start"), pybind11::arg("slots"),
           pybind11::arg("offsets"), pybind11::arg("capture"), pybind11::arg("parents"), pybind11::arg("start_convs"),
           pybind11::arg("start_states"), pybind11::arg("keep"));
  pybind11::class_<Gemma4Stack>(m, "Gemma4Stack")
      .def(pybind11::init<double, int64_t>(), pybind11::arg("eps"), pybind11::arg("row_lanes"))
      .def("add_layer", &Gemma4Stack::add_layer, pybind11::arg("norms"), pybind11::arg("q"), pybind11::arg("k"),
           pybind11::arg("v"), pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("window"), pybind11::arg("scale"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("o"), pybind11::arg("gate_up"),
           pybind11::arg("down"), pybind11::arg("input_gate_q8"), pybind11::arg("input_gate_w"),
           pybind11::arg("input_proj_q8"), pybind11::arg("input_proj_w"), pybind11::arg("input_norm"),
           pybind11::arg("scalar"), pybind11::arg("experts") = pybind11::none())
      .def("num_layers", &Gemma4Stack::num_layers)
      .def("run", &Gemma4Stack::run, "(hidden [T, H], captured layer inputs) for one pass",
           pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("k_layers"), pybind11::arg("v_layers"), pybind11::arg("start"), pybind11::arg("slots"),
           pybind11::arg("offsets"), pybind11::arg("window_slots"), pybind11::arg("window_offsets"),
           pybind11::arg("layer_inputs"), pybind11::arg("capture"));
}
