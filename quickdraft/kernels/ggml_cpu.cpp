// Quantized linear kernels for GGML block formats (AVX2 + FMA + F16C, OpenMP).
//
//   y[t, n] = sum_k x[t, k] * W[n, k]  (+ bias[n])      x: fp32 [T, K], W: GGML blocks [N, row_bytes]
//
// Design (see quickdraft/quant/ggml.py for the Python side and the pure-PyTorch reference):
//   * Output rows are grouped in panels of NP = 8; OpenMP threads take runs of panels
//     (dynamically: the machine may be shared), so every weight block is read from memory once
//     per call, whatever T is. The next panel is software-prefetched while the current one is
//     computed (the 8-row interleave defeats the hardware prefetchers).
//   * A panel is walked along K in chunks of 256 (one K-quant super-block, eight 32-blocks).
//     Up to 8 input rows (decode, verification): fused path. A register tile of TT input rows x
//     NN weight rows (1x4, 2x2 or 2x4, 3x2, 4x2, 5..8x1) dequantizes each block in registers,
//     8 weights at a time, bit-exact to gguf.quants.dequantize, and multiplies them into all TT
//     rows at once. More rows (long verification, prefill): scratch path. Each chunk of the panel
//     is dequantized once into an 8 KiB L1 scratch, then 4x2 register tiles multiply it with the
//     rows. x is repacked once per call (chunk-major, padded rows: no L1 conflicts).
//   * Batch invariance: the accumulator of output (t, n) is one 8-lane fp32 vector that receives
//     fma(x[t, 8v:8v+8], w[n, 8v:8v+8], acc) for the vectors v of each block in one fixed order
//     (the format's ORDER), block after block, and is reduced by one fixed horizontal sum. Paths,
//     tile shapes, tails, panels and threads only decide where that sequence runs, never its
//     arithmetic, so a row's result is bitwise the same for any T.
//   * Measured on 2 Zen 4 cores (Qwen2.5-Coder-1.5B Q4_K_M, benchmarks/kernels.py): 1 row is
//     compute-bound (~2.2 cycles per 8 Q4_K weights: load+widen, mask, convert, fmsub, fma);
//     8 rows are bound by FMA throughput and loads.

#include <torch/extension.h>

#include "ggml_cpu.h"

namespace {

using namespace qd;

// GGML type ids (gguf.GGMLQuantizationType)
enum : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

template <class Fn>
void dispatch(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case T_Q4_0: fn(Q4_0{}); break;
    case T_Q4_1: fn(Q4_1{}); break;
    case T_Q5_0: fn(Q5_0{}); break;
    case T_Q8_0: fn(Q8_0{}); break;
    case T_Q4_K: fn(Q4_K{}); break;
    case T_Q6_K: fn(Q6_K{}); break;
    default: TORCH_CHECK(false, "quickdraft kernels: unsupported GGML type ", qtype);
  }
}

template <class F>
void check_raw(const torch::Tensor& raw, int64_t K) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "raw must be a contiguous CPU uint8 tensor [N, row_bytes]");
  TORCH_CHECK(K > 0 && K % F::BS == 0, "in_features ", K, " is not a multiple of the block size ", F::BS);
  TORCH_CHECK(raw.size(1) == K / F::BS * F::TS, "raw has ", raw.size(1), " bytes per row, expected ",
              K / F::BS * F::TS);
}

torch::Tensor linear(int64_t qtype, const torch::Tensor& raw, const torch::Tensor& x, int64_t K,
                     const c10::optional<torch::Tensor>& bias, int64_t nthreads) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == K,
              "x must be a contiguous CPU float32 tensor [T, in_features]");
  const int64_t N = raw.size(0), T = x.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 tensor [out_features]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const int nt = static_cast<int>(nthreads > 0 ? nthreads : at::get_num_threads());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    check_raw<F>(raw, K);
    pybind11::gil_scoped_release nogil;
    gemm<F>(xp, T, K, raw.data_ptr<uint8_t>(), N, bp, yp, nt);
  });
  return y;
}

torch::Tensor dequantize(int64_t qtype, const torch::Tensor& raw, int64_t K, int64_t nthreads) {
  const int64_t N = raw.size(0);
  auto y = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const int nt = static_cast<int>(nthreads > 0 ? nthreads : at::get_num_threads());
  dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    check_raw<F>(raw, K);
    if (N == 0) return;
    pybind11::gil_scoped_release nogil;
    dequant_rows<F>(raw.data_ptr<uint8_t>(), N, K, y.data_ptr<float>(), nt);
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The fused and scratch paths must feed each accumulator in the same order (batch invariance).
  TORCH_CHECK(order_matches<Q4_0>() && order_matches<Q4_1>() && order_matches<Q5_0>() && order_matches<Q8_0>() &&
                  order_matches<Q4_K>() && order_matches<Q6_K>(),
              "quickdraft kernels: a format's ORDER table does not match its seg() order");
  m.doc() = "quickdraft: GGML quantized linear kernels (AVX2/FMA/F16C, OpenMP)";
  m.def("linear", &linear, "y = x @ dequant(raw).T (+ bias); x fp32 [T, K] -> y fp32 [T, N]", pybind11::arg("qtype"),
        pybind11::arg("raw"), pybind11::arg("x"), pybind11::arg("in_features"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("num_threads") = 0);
  m.def("dequantize", &dequantize, "fp32 [N, K] weights, bit-exact to gguf.quants.dequantize", pybind11::arg("qtype"),
        pybind11::arg("raw"), pybind11::arg("in_features"), pybind11::arg("num_threads") = 0);
}
