// Small fused CPU ops for the decode / verify step: RMSNorm and RoPE in one call each.
//
// At one token per step a 1.5B model's layer is ~50 torch ops, and each op costs a few
// microseconds of dispatch whatever its size: RMSNorm is 6 of them, RoPE (q and k) 16. These
// replace them with one call each, computing the same formulas in fp32:
//   rms_norm: y = w * (x * (1 / sqrt(mean(x^2) + eps)))   (mean: fixed 8-lane order, one row alone)
//   rope:     y[d] = x[d] * cos[p, d] + rot[d] * sin[p, d],  rot = [-x[D/2:], x[:D/2]]
// Every row is computed on its own with one fixed sequence of float operations, so a row's result
// does not depend on the other rows of the call (batch invariance, as in the GEMMs).

#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

namespace {

// sum of x[0..n)^2 in a fixed order: 8 lanes over the multiples of 8, lanes added pairwise, then
// the tail in order.
float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += x[i] * x[i];
  return r;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous CPU float32 tensor [..., H]");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == H,
              "weight must be a contiguous float32 tensor [H]");
  auto y = torch::empty_like(x);
  const int64_t T = H ? x.numel() / H : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = xp + t * H;
    float* yr = yp + t * H;
    const float r = 1.0f / std::sqrt(sum_squares(xr, H) / static_cast<float>(H) + e);
    for (int64_t i = 0; i < H; ++i) yr[i] = wp[i] * (xr[i] * r);
  }
  return y;
}

// x [heads, T, D] (last stride 1, any other strides), cos/sin [S, D] contiguous, positions [T]
// int64 -> a new contiguous [heads, T, D].
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& positions) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              "x must be a CPU float32 tensor [heads, T, D] with unit last stride");
  const int64_t Hn = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head dim must be even");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 tables [S, D]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 && positions.numel() == T,
              "positions must be an int64 tensor [T]");
  auto y = torch::empty({Hn, T, D}, x.options());
  const int64_t S = cos.size(0), half = D / 2;
  const auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < S, "position ", pp[t], " outside the rope table");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  for (int64_t h = 0; h < Hn; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = xp + h * s0 + t * s1;
      const float* c = cos.data_ptr<float>() + pp[t] * D;
      const float* s = sin.data_ptr<float>() + pp[t] * D;
      float* yr = yp + (h * T + t) * D;
      for (int64_t d = 0; d < half; ++d) yr[d] = xr[d] * c[d] + (-xr[d + half]) * s[d];
      for (int64_t d = half; d < D; ++d) yr[d] = xr[d] * c[d] + xr[d - half] * s[d];
    }
  }
  return y;
}

}  // namespace

void register_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row (fp32)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rope", &rope, "rotate-half RoPE of x [heads, T, D] at positions, from cos/sin tables [S, D]",
        pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"));
}
