// The Gated DeltaNet token step (Qwen3.5 / Qwen3-Next linear attention) in one native call per
// layer and pass.
//
// The Python layer runs ~30 small torch ops per row and layer (the causal convolution, SiLU,
// L2 norms, the gates, the delta rule over each head's [Dk, Dv] state, the gated RMSNorm), each a
// few microseconds of dispatch, and reads the 64 KiB state of a head four times. Here a row is:
//   conv  = sum_j window[:, j] * w[:, j]            (window = the previous K-1 inputs, then this one)
//   q,k,v = silu(conv) split; q, k L2-normalised per key head (x / sqrt(sum x^2 + 1e-6)), q / sqrt(Dk)
//   per value head h (its key head: h % Hk tiled, h / (Hv / Hk) grouped):
//     beta = sigmoid(b[h]),  decay = exp(a_scale[h] * softplus(a[h] + dt_bias[h]))
//     S = S_prev * decay;  r = S^T k;  S += k (beta (v - r))^T;  o = S^T q      (one pass each way)
//   out = norm_w * rms(o) * silu(z)    per head (rms: o / sqrt(mean(o^2) + eps))
// in fp32, one fixed order of operations per row whatever the pass holds (batch invariance: a row
// of a prefill chunk, a verification chain, a tree or a pass over several sequences gives the same
// bits). A row continues its parent row's state, or the state it is handed; the rows without a
// parent are handed their start windows and states in row order.
//
// Two phases. First every row's convolution, SiLU and norms, rows split over threads: a row's
// window is the inputs along its path (its ancestors' rows of ``mixed``, then its start window),
// so rows need nothing from each other. Then the delta rule, value heads split over threads and
// each head walking the rows in order, its [Dk, Dv] state staying in the core's cache. A row read by the
// row after it (a chain) is read in the same pass that writes it: one pass over a head's state per row, not two.
// The rows ``keep`` names get their new window and state as new tensors (the cache keeps them per
// row: a rollback picks one, so nothing the cache holds is updated in place); the others return
// None and their state lives only in a per-head scratch the next row continues in place (a row is
// kept anyway when a row other than the next continues it). A prefill chunk keeps its last row and
// the cache's checkpoints, not 1 MiB of state per row and layer.
// Results agree with the torch layer within fp32 rounding (tests/test_qwen3_5.py), not bitwise:
// a model runs one of the two paths for all its passes.

#include <omp.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops_api.h"
#include "simd_exp.h"
#define QD_DELTA_NS qd_delta_avx2
#include "delta_head.h"

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // (torch's threshold)

// sum of x[0..n)^2 in 8 interleaved partial sums (the order the compiler vectorises), then in order
inline float sum_squares(const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += x[i + l] * x[i + l];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

void check_f32(const torch::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == numel,
              name, " must be a contiguous CPU float32 tensor of ", numel, " elements");
}

// x = silu(x) over n floats, eight at a time (the tail one by one: the same for every row).
inline void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, silu8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = silu(x[i]);
}

// The gated RMSNorm of one head's output: o = w * (o * inv) * silu(z).
inline void gate(float* o, const float* z, const float* w, float inv, int64_t n) {
  int64_t j = 0;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; j + 8 <= n; j += 8) {
    const __m256 on = _mm256_mul_ps(_mm256_loadu_ps(o + j), vinv);
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(w + j), on), silu8(_mm256_loadu_ps(z + j))));
  }
  for (; j < n; ++j) o[j] = w[j] * (o[j] * inv) * silu(z[j]);
}

// q[c] = in[c * stride] * w[c * wstride] and q[c] += in[c * stride] * w[c * wstride], c < n: one tap of the
// convolution over every channel (stride 1, a row of the pass, gets a loop of its own the compiler vectorises).
inline void strided_mul(const float* in, int64_t stride, const float* w, int64_t wstride, float* q, int64_t n) {
  if (stride == 1)
    for (int64_t c = 0; c < n; ++c) q[c] = in[c] * w[c * wstride];
  else
    for (int64_t c = 0; c < n; ++c) q[c] = in[c * stride] * w[c * wstride];
}
inline void strided_mul_add(const float* in, int64_t stride, const float* w, int64_t wstride, float* q, int64_t n) {
  if (stride == 1)
    for (int64_t c = 0; c < n; ++c) q[c] += in[c] * w[c * wstride];
  else
    for (int64_t c = 0; c < n; ++c) q[c] += in[c * stride] * w[c * wstride];
}

// One input of a row's convolution window, per channel c: base[c * stride].
struct Tap {
  const float* base;
  int64_t stride;
};

// -> [out [T, Hv*Dv], conv windows (T: [C, K-1] or None), states (T: [Hv, Dk, Dv] or None)]
std::vector<torch::Tensor> gated_delta_rows(const torch::Tensor& mixed, const torch::Tensor& z, const torch::Tensor& b,
                                            const torch::Tensor& a, const torch::Tensor& conv_w,
                                            const torch::Tensor& a_scale, const torch::Tensor& dt_bias,
                                            const torch::Tensor& norm_w, double eps, int64_t nk, int64_t dk,
                                            int64_t nv, int64_t dv, bool tiled, const std::vector<int64_t>& parents,
                                            const std::vector<torch::Tensor>& start_convs,
                                            const std::vector<torch::Tensor>& start_states,
                                            const std::vector<bool>& keep) {
  const int64_t T = mixed.size(0), C = 2 * nk * dk + nv * dv;
  TORCH_CHECK(nk > 0 && nv % nk == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(mixed.dim() == 2 && mixed.size(1) == C, "mixed must be [T, 2*Hk*Dk + Hv*Dv]");
  const int64_t K = conv_w.numel() / C;
  TORCH_CHECK(K >= 1 && conv_w.numel() == C * K, "conv weight must be [C, K]");
  check_f32(mixed, "mixed", T * C);
  check_f32(z, "z", T * nv * dv);
  check_f32(b, "b", T * nv);
  check_f32(a, "a", T * nv);
  check_f32(conv_w, "conv weight", C * K);
  check_f32(a_scale, "a_scale", nv);
  check_f32(dt_bias, "dt_bias", nv);
  check_f32(norm_w, "norm weight", dv);
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == T, "one parent per row");
  TORCH_CHECK(static_cast<int64_t>(keep.size()) == T, "one keep flag per row");
  std::vector<int64_t> start_of(T, -1);  // a row without a parent: its place in start_convs / start_states
  std::vector<char> kept(keep.begin(), keep.end());
  int64_t starts = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(parents[t] < t, "a row's parent comes before it");
    if (parents[t] < 0)
      start_of[t] = starts++;
    else if (parents[t] != t - 1)
      kept[parents[t]] = 1;  // continued out of order: its state must outlive the next row
  }
  TORCH_CHECK(static_cast<int64_t>(start_convs.size()) == starts && static_cast<int64_t>(start_states.size()) == starts,
              "one start window and state per row without a parent");
  for (int64_t s = 0; s < starts; ++s) {
    check_f32(start_convs[s], "a start window", C * (K - 1));
    check_f32(start_states[s], "a start state", nv * dk * dv);
  }
  auto opts = mixed.options();
  auto out = torch::empty({T, nv * dv}, opts);
  std::vector<torch::Tensor> convs(T), states(T);
  for (int64_t t = 0; t < T; ++t)
    if (kept[t]) {
      convs[t] = torch::empty({C, K - 1}, opts);
      states[t] = torch::empty({nv, dk, dv}, opts);
    }
  // Each row's window, oldest first: its ancestors' inputs, then (past the pass's start) its start window.
  std::vector<Tap> taps(T * std::max<int64_t>(K - 1, 1));
  const float* xp = mixed.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    int64_t row = t;
    for (int64_t j = K - 2; j >= 0; --j) {  // the input j places before this row's, newest first
      const int64_t p = parents[row];
      if (p >= 0) {
        taps[t * (K - 1) + j] = {xp + p * C, 1};
        row = p;
      } else {  // the rest from the start window of the path's first row: its newest columns
        const float* win = start_convs[start_of[row]].data_ptr<float>();
        for (int64_t m = j; m >= 0; --m) taps[t * (K - 1) + m] = {win + (K - 1) - (j - m) - 1, K - 1};
        break;
      }
    }
  }
  qd_api::ReleaseGil nogil;
  const float* wp = conv_w.data_ptr<float>();
  const float* asp = a_scale.data_ptr<float>();
  const float* dtp = dt_bias.data_ptr<float>();
  const float* nwp = norm_w.data_ptr<float>();
  const int64_t rep = nv / nk;
  const float qscale = 1.0f / std::sqrt(static_cast<float>(dk));
  std::vector<float> qkv(T * C);
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; ++t) {  // phase 1: the convolution, SiLU and norms of every row
    const Tap* tap = taps.data() + t * (K - 1);
    const float* x = xp + t * C;
    float* q = qkv.data() + t * C;
    // per channel: tap 0 times its weight, then each later tap's product added in order (this row's
    // input last); the channels run innermost, one tap at a time
    if (K > 1) {
      strided_mul(tap[0].base, tap[0].stride, wp, K, q, C);
      for (int64_t j = 1; j < K - 1; ++j) strided_mul_add(tap[j].base, tap[j].stride, wp + j, K, q, C);
      strided_mul_add(x, 1, wp + K - 1, K, q, C);
    } else {
      strided_mul(x, 1, wp, K, q, C);
    }
    silu_inplace(q, C);
    if (kept[t] && K > 1) {  // the window this row leaves: the previous K-2 inputs, then its own
      float* w = convs[t].data_ptr<float>();
      for (int64_t j = 0; j + 1 < K - 1; ++j) {
        const float* in = tap[j + 1].base;
        const int64_t stride = tap[j + 1].stride;
        for (int64_t c = 0; c < C; ++c) w[c * (K - 1) + j] = in[c * stride];
      }
      for (int64_t c = 0; c < C; ++c) w[c * (K - 1) + K - 2] = x[c];
    }
    float* k = q + nk * dk;
    for (int64_t h = 0; h < nk; ++h) {
      const float qn = 1.0f / std::sqrt(sum_squares(q + h * dk, dk) + 1e-6f);
      const float kn = 1.0f / std::sqrt(sum_squares(k + h * dk, dk) + 1e-6f);
      for (int64_t i = 0; i < dk; ++i) {
        q[h * dk + i] = q[h * dk + i] * qn * qscale;
        k[h * dk + i] = k[h * dk + i] * kn;
      }
    }
  }
  const float* bp = b.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  auto decay_of = [&](int64_t t, int64_t h) { return std::exp(asp[h] * softplus(ap[t * nv + h] + dtp[h])); };
  const bool wide = qd_api::wide_vectors();  // the AVX-512 build of the delta rule (the same bits, 16 floats a vector)
  const auto head_read = wide ? qd_abi::delta_head_read_avx512 : qd_delta_avx2::head_read;
  const auto head_write = wide ? qd_abi::delta_head_write_avx512 : qd_delta_avx2::head_write;
#pragma omp parallel
  {
    std::vector<float> r(dv), next_r(dv), scratch(dk * dv);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < nv; ++h) {  // phase 2: each value head through the rows in order
      const int64_t kh = tiled ? h % nk : h / rep;
      bool have_r = false;  // r already holds this row's head_read (fused into its parent's head_write)
      float carried = 0.0f;  // and this row's decay, computed for that read
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = parents[t];
        const float* prev = p < 0 ? start_states[start_of[t]].data_ptr<float>() + h * dk * dv
                            : kept[p]  ? states[p].data_ptr<float>() + h * dk * dv
                                       : scratch.data();
        float* next = kept[t] ? states[t].data_ptr<float>() + h * dk * dv : scratch.data();
        const float* q = qkv.data() + t * C;
        const float* k = q + nk * dk;
        const float* v = k + nk * dk;
        const float beta = sigmoid(bp[t * nv + h]);
        const float decay = have_r ? carried : decay_of(t, h);
        float* o = out.data_ptr<float>() + t * nv * dv + h * dv;
        if (!have_r) head_read(prev, k + kh * dk, decay, dk, dv, r.data());
        have_r = t + 1 < T && parents[t + 1] == t;  // the next row continues this one: read it in this pass
        const float* next_k = have_r ? qkv.data() + (t + 1) * C + nk * dk + kh * dk : nullptr;
        carried = have_r ? decay_of(t + 1, h) : 0.0f;
        head_write(prev, next, k + kh * dk, q + kh * dk, v + h * dv, beta, decay, dk, dv, r.data(), o, next_k, carried,
                   next_r.data());
        std::swap(r, next_r);
        const float inv = 1.0f / std::sqrt(sum_squares(o, dv) / static_cast<float>(dv) + static_cast<float>(eps));
        const float* zh = z.data_ptr<float>() + t * nv * dv + h * dv;
        gate(o, zh, nwp, inv, dv);
      }
    }
  }
  std::vector<torch::Tensor> result{out};
  result.insert(result.end(), convs.begin(), convs.end());
  result.insert(result.end(), states.begin(), states.end());
  return result;
}

}  // namespace

std::vector<torch::Tensor> qd_api::gated_delta_rows(
    const torch::Tensor& mixed, const torch::Tensor& z, const torch::Tensor& b, const torch::Tensor& a,
    const torch::Tensor& conv_w, const torch::Tensor& a_scale, const torch::Tensor& dt_bias, const torch::Tensor& norm_w,
    double eps, int64_t nk, int64_t dk, int64_t nv, int64_t dv, bool tiled, const std::vector<int64_t>& parents,
    const std::vector<torch::Tensor>& start_convs, const std::vector<torch::Tensor>& start_states,
    const std::vector<bool>& keep) {
  return ::gated_delta_rows(mixed, z, b, a, conv_w, a_scale, dt_bias, norm_w, eps, nk, dk, nv, dv, tiled, parents,
                            start_convs, start_states, keep);
}

void register_delta(pybind11::module& m) {
  m.def("gated_delta_rows", &gated_delta_rows,
        "Gated DeltaNet rows (convolution, gates, delta rule, gated RMSNorm), each continuing its parent row's "
        "state or the one it is handed -> [out [T, Hv*Dv], T windows [C, K-1], T states [Hv, Dk, Dv]] (None for the "
        "rows keep leaves out)",
        pybind11::arg("mixed"), pybind11::arg("z"), pybind11::arg("b"), pybind11::arg("a"), pybind11::arg("conv_w"),
        pybind11::arg("a_scale"), pybind11::arg("dt_bias"), pybind11::arg("norm_w"), pybind11::arg("eps"),
        pybind11::arg("nk"), pybind11::arg("dk"), pybind11::arg("nv"), pybind11::arg("dv"), pybind11::arg("tiled"),
        pybind11::arg("parents"), pybind11::arg("start_convs"), pybind11::arg("start_states"), pybind11::arg("keep"));
}
