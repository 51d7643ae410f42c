// Quantized linear kernels for GGML block formats (AVX2 + FMA + F16C, OpenMP).
//
//   y[t, n] = sum_k x[t, k] * W[n, k]  (+ bias[n])      x: fp32 [T, K], W: GGML blocks [N, row_bytes]
//
// Two activation modes (see quickdraft/quant/ggml.py for the Python side and the pure-PyTorch
// reference of both):
//
// q8 (linear_q8, linear_multi; ggml_q8.h; the default): each input row is quantized to int8 per
//   block, once per call, like llama.cpp's activations: per 256 values for K-quant weights (one
//   fp32 scale d = amax/127, plus sums of q per group) and per 32 values for Q4_0, Q4_1, Q5_0,
//   Q8_0 (fp32 scale, sum of q per 32). The kernel then works in integers: the weight bytes of a
//   block are unpacked once in registers (nibbles, 6-bit values, or signed bytes) and reused for
//   every input row of the register tile (TT input rows x NN weight rows: 1x4, 2..4 x 2, 5..8 x 1;
//   5..8 x 2 in the AVX-512 build, whose 32 registers also let each activation vector be loaded
//   once for both weight rows), multiplied with dpbusd (AVX2: maddubs + madd; u8 x i8, no
//   saturation for any input). Every format runs in its
//   "lane layout" (repack_lanes, done once per weight: the same values moved within each Q4_K /
//   Q6_K block, or 8 blocks of a 32-block format regrouped per 256 values): lane j of every
//   register holds group j, so the integer sums come out per group and the group scales are
//   applied once per 256 weights in float.
//   Within a block every sum is exact; then one short float sequence per (row, output, block)
//   adds dx * dw * isum (and the min / offset terms) into an 8-lane fp32 accumulator. What this
//   changes numerically: x is rounded to int8 per block (relative error ~1/254 of the block's
//   largest |x|), exactly as llama.cpp does; the weights are used exactly. linear_multi computes
//   several weights of the same x (q/k/v, gate/up) in one parallel region, quantizing x once.
// f32 (linear; this file's gemm in ggml_cpu.h): exact fp32 activations. Output rows are grouped
//   in panels of NP = 8; a panel is walked along K in chunks of 256 (one K-quant super-block, eight
//   32-blocks). Up to 8 input rows: a register tile of TT input rows x NN weight rows (1x4, 2x2 or
//   2x4, 3x2, 4x2, 5..8x1) dequantizes each block in registers, 8 weights at a time, bit-exact to
//   gguf.quants.dequantize, and FMAs them into all TT rows at once. More rows: each chunk of the
//   panel is dequantized once into an 8 KiB L1 scratch, then 4x2 register tiles multiply it with
//   the rows (x repacked once per call, chunk-major, padded rows: no L1 conflicts).
//
// Both modes share the panel scheme: OpenMP threads take runs of panels dynamically (the machine
// may be shared), every weight block is read from memory once per call whatever T is, and the next
// panel is software-prefetched (the 8-row interleave defeats the hardware prefetchers).
//
// Batch invariance (both modes): the float operations that produce output (t, n) are one fixed
// sequence whatever T, the tile shape, the panel, the thread or the thread count is: in f32 mode
// fma(x[t, 8v:8v+8], w[n, 8v:8v+8], acc) for the vectors v of each block in the format's fixed
// ORDER; in q8 mode the per-block float step above (integer sums are exact, so their order is
// free); then one fixed horizontal sum and the bias. A row's quantization depends on that row
// only. So a row's result is bitwise the same for any T, and speculative verification reproduces
// plain decoding exactly, in either mode (as long as both run in the same mode).
//
// Measured on 2 Zen 4 cores (Qwen2.5-Coder-1.5B Q4_K_M, benchmarks/kernels.py, results in
// benchmarks/results/kernels.json): f32: 1 row is compute-bound (~2.2 cycles per 8 Q4_K weights);
// q8: about 2x the f32 throughput per core at 1..8 rows.

#include <torch/extension.h>

#include <array>
#include <atomic>
#include <string>

#include "ggml_cpu.h"
#include "ggml_q8.h"
#include "ops_api.h"

namespace {

using namespace qd;

// GGML type ids (gguf.GGMLQuantizationType): the block formats of ggml_q8.h, and the float ones.
using q8::T_IQ4_NL, q8::T_IQ4_XS, q8::T_MXFP4, q8::T_Q2_K, q8::T_Q3_K, q8::T_Q4_0, q8::T_Q4_1, q8::T_Q4_K, q8::T_Q5_0, q8::T_Q5_1,
    q8::T_Q5_K, q8::T_Q6_K, q8::T_Q8_0;
enum : int64_t { T_F16 = 1, T_BF16 = 30 };

template <class Fn>
void dispatch(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case T_F16: fn(F16{}); break;
    case T_BF16: fn(BF16{}); break;
    case T_Q4_0: fn(Q4_0{}); break;
    case T_Q4_1: fn(Q4_1{}); break;
    case T_Q5_0: fn(Q5_0{}); break;
    case T_Q5_1: fn(Q5_1{}); break;
    case T_Q8_0: fn(Q8_0{}); break;
    case T_Q2_K: fn(Q2_K{}); break;
    case T_Q3_K: fn(Q3_K{}); break;
    case T_Q4_K: fn(Q4_K{}); break;
    case T_Q5_K: fn(Q5_K{}); break;
    case T_Q6_K: fn(Q6_K{}); break;
    case T_IQ4_NL: fn(IQ4_NL{}); break;
    case T_MXFP4: fn(MXFP4{}); break;
    case T_IQ4_XS: fn(IQ4_XS{}); break;
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


// ---- q8 activations -----------------------------------------------------------------------------

// Which build of the q8 GEMM runs: the AVX2 one (ggml_q8.h here) or the AVX-512 VNNI one
// (ggml_q8_avx512.cpp), chosen once from the CPU; set_isa() switches (tests, QUICKDRAFT_ISA).
// Both give bitwise-equal results.
enum Isa : int { ISA_AVX2 = 0, ISA_AVX512VNNI = 1 };
const char* const ISA_NAMES[] = {"avx2", "avx512vnni"};

bool cpu_has_avx512vnni() {
  __builtin_cpu_init();  // the checks below include the OS's saving of the AVX-512 state
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

std::atomic<int> g_isa{cpu_has_avx512vnni() ? ISA_AVX512VNNI : ISA_AVX2};

std::string isa() { return ISA_NAMES[g_isa.load()]; }

// Selects the build ("avx2", "avx512vnni" or "auto" = the best this CPU runs); returns the previous.
std::string set_isa(const std::string& name) {
  const std::string prev = isa();
  if (name == "auto") {
    g_isa = cpu_has_avx512vnni() ? ISA_AVX512VNNI : ISA_AVX2;
  } else if (name == "avx2") {
    g_isa = ISA_AVX2;
  } else if (name == "avx512vnni") {
    TORCH_CHECK(cpu_has_avx512vnni(), "this CPU does not run AVX-512 VNNI; use 'avx2' or 'auto'");
    g_isa = ISA_AVX512VNNI;
  } else {
    TORCH_CHECK(false, "unknown instruction set '", name, "': use 'auto', 'avx2' or 'avx512vnni'");
  }
  return prev;
}

// The q8 GEMM's tuning per class of row counts (qd_abi::Tuning): the measured defaults until
// set_tuning (quickdraft/kernels/tuning.py) installs this machine's choice. Every setting computes the
// same bits, so a call that reads a half-updated one is still exact.
std::array<std::array<std::atomic<int>, 5>, qd_abi::TUNING_CLASSES> g_tuning{
    {{{3, 1, 2, 0, 1}}, {{3, 1, 4, 0, 0}}, {{3, 1, 4, 0, 0}}}};

qd_abi::Tuning tuning_of(int cls) {
  const auto& t = g_tuning[cls];
  return {t[0].load(std::memory_order_relaxed), t[1].load(std::memory_order_relaxed), t[2].load(std::memory_order_relaxed),
          t[3].load(std::memory_order_relaxed), t[4].load(std::memory_order_relaxed)};
}

// What is wrong with a (prefetch, ahead, runs, tile1, chain) setting; "" where the kernels take it.
// The one definition of the ranges: set_tuning refuses what it names, and the tuner drops kept
// choices it names (quickdraft/kernels/tuning.py).
std::string tuning_problem(int64_t prefetch, int64_t ahead, int64_t runs, int64_t tile1, int64_t chain) {
  if (prefetch < 0 || prefetch > 3) return "prefetch must be 0 (none), 1 (L1), 2 (L2) or 3 (L1 for small decode panels)";
  if (ahead < 1 || ahead > 4) return "ahead must be 1 .. 4 panels";
  if (runs < 1 || runs > 16) return "runs must be 1 .. 16 per thread";
  if (tile1 != 0 && tile1 != 2 && tile1 != 4 && tile1 != 8)
    return "tile1 must be 0 (the build's default), 2, 4 or 8 weight rows per one-row tile";
  if (chain != 0 && chain != 1) return "chain must be 0 (one row chunk by chunk) or 1 (a panel's chunks chained)";
  return "";
}

// Sets class cls's (0: 1 row, 1: 2-16 rows, 2: more) prefetch, ahead, runs, one-row tile width and
// one-row chaining; returns the previous.
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> set_tuning(int64_t cls, int64_t prefetch, int64_t ahead,
                                                                   int64_t runs, int64_t tile1, int64_t chain) {
  TORCH_CHECK(cls >= 0 && cls < qd_abi::TUNING_CLASSES, "tuning class must be 0 (1 row), 1 (2-16 rows) or 2 (more)");
  const std::string problem = tuning_problem(prefetch, ahead, runs, tile1, chain);
  TORCH_CHECK(problem.empty(), problem);
  const qd_abi::Tuning prev = tuning_of(static_cast<int>(cls));
  g_tuning[cls][0] = static_cast<int>(prefetch);
  g_tuning[cls][1] = static_cast<int>(ahead);
  g_tuning[cls][2] = static_cast<int>(runs);
  g_tuning[cls][3] = static_cast<int>(tile1);
  g_tuning[cls][4] = static_cast<int>(chain);
  return {prev.prefetch, prev.ahead, prev.runs, prev.tile1, prev.chain};
}

using WeightSpec = qd_api::WeightSpec;

// y_i = x[rows of group job_groups[i]] @ dequant(W_i).T (+ b_i) for several weights; x [R, K] holds the
// groups' rows one group after another (group g: rows gstart[g] .. gstart[g + 1] - 1). Each row is
// quantized to int8 once per mode and all panels of all weights computed in one parallel region, each
// weight over its group's rows as a call of its own would. residual (one weight only): y = residual +
// (x @ W.T + b), added as each output is stored (the bits of torch's residual + y).
std::vector<torch::Tensor> linear_jobs(const torch::Tensor& x, const std::vector<int64_t>& gstart,
                                       const std::vector<int64_t>& job_groups, const std::vector<WeightSpec>& weights,
                                       int64_t nthreads, const c10::optional<torch::Tensor>& residual) {
  const int64_t K = x.size(-1), ngroups = static_cast<int64_t>(gstart.size()) - 1;
  TORCH_CHECK(job_groups.size() == weights.size(), "one group per weight");
  std::vector<torch::Tensor> ys;
  std::vector<q8::Job> jobs;
  for (size_t w = 0; w < weights.size(); ++w) {
    const auto& [qtype, raw, in_features, bias] = weights[w];
    TORCH_CHECK(in_features == K, "in_features ", in_features, " does not match x's ", K, " columns");
    TORCH_CHECK(job_groups[w] >= 0 && job_groups[w] < ngroups, "a weight's group must be one of the ", ngroups, " groups");
    const int64_t T = gstart[job_groups[w] + 1] - gstart[job_groups[w]];
    q8::Job g{};
    g.qtype = qtype;
    g.K = K;
    g.N = raw.size(0);
    g.xgroup = static_cast<int>(job_groups[w]);
    TORCH_CHECK(qtype >= q8::LANES_ID, "the q8 kernels take weights in the lane layout: repack_lanes(raw) and ",
                "type id ", qtype + q8::LANES_ID);
    TORCH_CHECK(q8::init_job(g), "quickdraft kernels: unsupported type id ", qtype);
    TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous() &&
                    raw.size(1) == g.row_bytes,
                "raw must be a contiguous CPU uint8 tensor [N, ", g.row_bytes, "] (lanes), got ", raw.sizes());
    q8::dispatch(qtype, [&](auto f) {
      TORCH_CHECK(K % (decltype(f)::MODE == q8::KL ? 256 : 32) == 0, "in_features ", K, " does not fit the blocks");
    });
    g.W = raw.data_ptr<uint8_t>();
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == g.N,
                  "bias must be a contiguous float32 tensor [out_features]");
      g.bias = bias->data_ptr<float>();
    }
    ys.push_back(torch::empty({T, g.N}, x.options()));
    g.y = ys.back().data_ptr<float>();
    if (residual.has_value() && residual->defined()) {
      TORCH_CHECK(weights.size() == 1, "a residual goes with one weight");
      TORCH_CHECK(residual->device().is_cpu() && residual->scalar_type() == torch::kFloat32 &&
                      residual->is_contiguous() && residual->dim() == 2 && residual->size(0) == T &&
                      residual->size(1) == g.N,
                  "residual must be a contiguous CPU float32 tensor [T, out_features]");
      g.residual = residual->data_ptr<float>();
    }
    if (g.N > 0 && T > 0) jobs.push_back(g);
  }
  if (jobs.empty()) return ys;
  const int nt = static_cast<int>(nthreads > 0 ? nthreads : at::get_num_threads());
  const float* xp = x.data_ptr<float>();
  const int64_t rows_per_group = gstart[ngroups] / std::max<int64_t>(ngroups, 1);  // (the tuning's class only)
  const qd_abi::Tuning tune = tuning_of(qd_abi::tuning_class(std::max<int64_t>(rows_per_group, 1)));
  qd_api::ReleaseGil nogil;
  const int nj = static_cast<int>(jobs.size());
  if (g_isa.load(std::memory_order_relaxed) == ISA_AVX512VNNI)
    qd_abi::gemm_multi_avx512vnni(xp, gstart.data(), ngroups, K, jobs.data(), nj, nt, tune);
  else
    q8::gemm_multi(xp, gstart.data(), ngroups, K, jobs.data(), nj, nt, tune);
  return ys;
}

// Several weights sharing x [T, K] (q/k/v, gate/up), in one call.
std::vector<torch::Tensor> linear_multi(const torch::Tensor& x, const std::vector<WeightSpec>& weights,
                                        int64_t nthreads, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU float32 tensor [T, in_features]");
  return linear_jobs(x, {0, x.size(0)}, std::vector<int64_t>(weights.size(), 0), weights, nthreads, residual);
}

// Groups of rows of x [R, K] (counts[g] rows each, one group after another), weight i on the rows of
// group groups[i] (a pass's rows grouped by routed expert: every chosen expert's projections in one
// call), each weight's result what a call of its own on those rows gives.
std::vector<torch::Tensor> linear_grouped(const torch::Tensor& x, const std::vector<int64_t>& counts,
                                          const std::vector<WeightSpec>& weights, const std::vector<int64_t>& groups) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU float32 tensor [rows, in_features]");
  std::vector<int64_t> gstart(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) {
    TORCH_CHECK(counts[g] >= 0, "row counts must not be negative");
    gstart[g + 1] = gstart[g] + counts[g];
  }
  TORCH_CHECK(gstart.back() == x.size(0), "the groups' row counts must add up to x's ", x.size(0), " rows");
  return linear_jobs(x, gstart, groups, weights, 0, c10::nullopt);
}

// int8 products per second of the q8 GEMM's dot step in the build in use (q8::dot_rate)
double int8_dot_rate(int64_t nthreads) {
  TORCH_CHECK(nthreads >= 1, "int8_dot_rate: threads must be at least 1");
  const int nt = static_cast<int>(nthreads);
  pybind11::gil_scoped_release nogil;
  if (g_isa.load(std::memory_order_relaxed) == ISA_AVX512VNNI) return qd_abi::dot_rate_avx512vnni(nt);
  return q8::dot_rate(nt);
}

torch::Tensor linear_q8(int64_t qtype, const torch::Tensor& raw, const torch::Tensor& x, int64_t K,
                        const c10::optional<torch::Tensor>& bias, int64_t nthreads) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [T, in_features]");
  return linear_multi(x, {WeightSpec{qtype, raw, K, bias}}, nthreads, c10::nullopt)[0];
}

// The lane layout's row and block sizes of GGML type qtype for rows of K values (checked).
struct LaneSizes {
  int64_t ggml_row, lanes_row, block;  // bytes: a GGML row, a lanes row, a lanes block (one chunk of a row)
};
LaneSizes lane_sizes(int64_t qtype, int64_t K) {
  LaneSizes z{};
  const bool known = q8::dispatch(qtype + q8::LANES_ID, [&](auto f) {
    using F = decltype(f);
    TORCH_CHECK(K > 0 && K % F::GBS == 0, "in_features ", K, " is not a multiple of the block size ", F::GBS);
    z = {K / F::GBS * F::GTS, (K + F::BS - 1) / F::BS * F::TS, F::TS};
  });
  TORCH_CHECK(known, "GGML type ", qtype, " has no lane layout");
  return z;
}

// rows [N, *] (row by row, each row's blocks in order) from GGML blocks to lanes blocks, or back.
void convert_rows(int64_t qtype, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K, const LaneSizes& z,
                  bool to_lanes, int nt) {
  if (qtype == T_Q4_K || qtype == T_Q6_K) {  // in place, block by block
    std::memcpy(dst, src, N * z.ggml_row);
    q8::repack_lanes(qtype, dst, N * z.ggml_row / z.block, to_lanes, nt);
  } else if (q8::is_klayout_type(qtype)) {  // 256-value blocks of the same size
    q8::repack_klayout(qtype, src, dst, N * z.ggml_row / z.block, to_lanes, nt);
  } else {  // 32-value blocks, 8 to a lanes block
    q8::repack_lanes32(qtype, src, dst, N, K, to_lanes, nt);
  }
}

// A copy of raw [N, row_bytes] in the lane layout of the q8 GEMM (to_lanes; from GGML blocks) or
// back in the GGML layout (from lanes); lossless (the same values, moved). 256-value formats keep
// their block size; the 32-block formats group 8 blocks per super-block, a partial last one padded.
// Lanes rows are stored in panels (q8::interleave_panels).
torch::Tensor repack_lanes(int64_t qtype, const torch::Tensor& raw, int64_t K, bool to_lanes, int64_t nthreads) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "raw must be a contiguous CPU uint8 tensor [N, row_bytes]");
  const int nt = static_cast<int>(nthreads > 0 ? nthreads : at::get_num_threads());
  const int64_t N = raw.size(0);
  const LaneSizes z = lane_sizes(qtype, K);
  TORCH_CHECK(raw.size(1) == (to_lanes ? z.ggml_row : z.lanes_row), "raw has ", raw.size(1),
              " bytes per row, expected ", to_lanes ? z.ggml_row : z.lanes_row);
  // Slabs of SLAB rows (whole panels: a slab's panels sit where the whole tensor's do) through one
  // row-by-row lanes buffer, so a large matrix (a 150k-row output head) is never held three times.
  constexpr int64_t SLAB = 4096;
  static_assert(SLAB % NP == 0, "a slab is whole panels");
  auto rows = torch::empty({std::min(N, SLAB), z.lanes_row}, raw.options());  // lanes, row by row
  auto out = torch::empty({N, to_lanes ? z.lanes_row : z.ggml_row}, raw.options());
  pybind11::gil_scoped_release nogil;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t *buf = rows.data_ptr<uint8_t>(), *dst = out.data_ptr<uint8_t>();
  for (int64_t r0 = 0; r0 < N; r0 += SLAB) {
    const int64_t n = std::min(SLAB, N - r0);
    if (to_lanes) {
      convert_rows(qtype, src + r0 * z.ggml_row, buf, n, K, z, true, nt);
      q8::interleave_panels(buf, dst + r0 * z.lanes_row, n, z.lanes_row, z.block, true, nt);
    } else {
      q8::interleave_panels(src + r0 * z.lanes_row, buf, n, z.lanes_row, z.block, false, nt);
      convert_rows(qtype, buf, dst + r0 * z.ggml_row, n, K, z, false, nt);
    }
  }
  return out;
}

// Rows ids of a weight in the lane layout, as GGML blocks [len(ids), GGML row bytes] (embedding lookups).
torch::Tensor lanes_rows(int64_t qtype, const torch::Tensor& raw, int64_t K, const torch::Tensor& ids) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "raw must be a contiguous CPU uint8 tensor [N, row_bytes]");
  const LaneSizes z = lane_sizes(qtype, K);
  TORCH_CHECK(raw.size(1) == z.lanes_row, "raw has ", raw.size(1), " bytes per row, expected ", z.lanes_row);
  const auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel(), N = raw.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row ", ip[i], " is out of range for ", N, " rows");
  auto rows = torch::empty({n, z.lanes_row}, raw.options());
  auto out = torch::empty({n, z.ggml_row}, raw.options());
  q8::panel_rows(raw.data_ptr<uint8_t>(), N, z.lanes_row, z.block, ip, n, rows.data_ptr<uint8_t>());
  convert_rows(qtype, rows.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), n, K, z, false, 1);
  return out;
}

// (q int8 [T, K], d float32 [T, K/bs], sums [T, K/16] int16 (bs 256) or [T, K/32] int32 (bs 32)):
// the kernels' quantization of x, for tests (q put back in order).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t bs) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU float32 tensor [T, K]");
  TORCH_CHECK(bs == 256 || bs == 32, "block size must be 256 (K-quant weights) or 32");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % bs == 0, "K ", K, " is not a multiple of ", bs);
  const int mode = bs == 256 ? q8::KL : q8::B32;
  const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
  std::vector<q8::XChunk> buf(nchunks * T);
  q8::quantize_rows(x.data_ptr<float>(), T, K, mode, buf.data());
  auto q = torch::empty({T, K}, torch::kInt8);
  auto d = torch::empty({T, K / bs}, torch::kFloat32);
  auto sums = mode == q8::KL ? torch::empty({T, K / 16}, torch::kInt16) : torch::empty({T, K / 32}, torch::kInt32);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < nchunks; ++c) {
      const q8::XChunk& xc = buf[c * T + t];
      const int64_t n = std::min<int64_t>(CHUNK, K - c * CHUNK);
      int8_t* qr = q.data_ptr<int8_t>() + t * K + c * CHUNK;
      for (int64_t e = 0; e < n; ++e) qr[e] = xc.q[32 * (e % 32 / 4) + 4 * (e / 32) + e % 4];  // back in order
      if (mode == q8::KL) {
        d.data_ptr<float>()[t * (K / 256) + c] = xc.d[0];
        int16_t* sr = sums.data_ptr<int16_t>() + t * (K / 16) + c * 16;
        for (int j = 0; j < 8; ++j) {
          sr[2 * j] = static_cast<int16_t>(xc.b6[j] / 32);
          sr[2 * j + 1] = static_cast<int16_t>(xc.b6[8 + j] / 32);
        }
      } else {
        for (int64_t b = 0; b < n / 32; ++b) {
          d.data_ptr<float>()[t * (K / 32) + c * 8 + b] = xc.d[b];
          sums.data_ptr<int32_t>()[t * (K / 32) + c * 8 + b] = xc.b6[b];
        }
      }
    }
  }
  return {q, d, sums};
}

}  // namespace

bool qd_api::wide_vectors() { return g_isa.load(std::memory_order_relaxed) == ISA_AVX512VNNI; }

std::vector<torch::Tensor> qd_api::linear_multi(const torch::Tensor& x, const std::vector<WeightSpec>& weights,
                                                const c10::optional<torch::Tensor>& residual) {
  return ::linear_multi(x, weights, 0, residual);
}
std::vector<torch::Tensor> qd_api::linear_grouped(const torch::Tensor& x, const std::vector<int64_t>& counts,
                                                  const std::vector<WeightSpec>& weights,
                                                  const std::vector<int64_t>& groups) {
  return ::linear_grouped(x, counts, weights, groups);
}

void register_delta(pybind11::module& m);  // delta_cpu.cpp: the Gated DeltaNet token step
void register_ops(pybind11::module& m);     // ops_cpu.cpp: fused RMSNorm, RoPE, attention
void register_decode(pybind11::module& m);  // decode_cpu.cpp: a whole decoder stack per call

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The fused and scratch paths must feed each accumulator in the same order (batch invariance).
  TORCH_CHECK(order_matches<Q4_0>() && order_matches<Q4_1>() && order_matches<Q5_0>() && order_matches<Q8_0>() &&
                  order_matches<Q4_K>() && order_matches<Q6_K>() && order_matches<F16>() && order_matches<BF16>() &&
                  order_matches<Q5_1>() && order_matches<Q2_K>() && order_matches<Q3_K>() && order_matches<Q5_K>() &&
                  order_matches<IQ4_NL>() && order_matches<IQ4_XS>() &&
                  order_matches<MXFP4>(),
              "quickdraft kernels: a format's ORDER table does not match its seg() order");
  m.doc() = "quickdraft: GGML quantized linear kernels (AVX2/FMA/F16C, OpenMP)";
  m.def("linear", &linear, "y = x @ dequant(raw).T (+ bias); x fp32 [T, K] -> y fp32 [T, N]", pybind11::arg("qtype"),
        pybind11::arg("raw"), pybind11::arg("x"), pybind11::arg("in_features"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("num_threads") = 0);
  m.def("dequantize", &dequantize, "fp32 [N, K] weights, bit-exact to gguf.quants.dequantize", pybind11::arg("qtype"),
        pybind11::arg("raw"), pybind11::arg("in_features"), pybind11::arg("num_threads") = 0);
  m.def("linear_q8", &linear_q8,
        "y = x @ dequant(raw).T (+ bias) with x quantized to int8 per block (q8 activations)",
        pybind11::arg("qtype"), pybind11::arg("raw"), pybind11::arg("x"), pybind11::arg("in_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("num_threads") = 0);
  m.def("linear_multi", &linear_multi,
        "[x @ dequant(W_i).T (+ b_i)] for weights [(qtype, raw, in_features, bias)], q8 activations, one call; "
        "residual [T, out_features] (one weight): residual + x @ W.T (+ b)",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("num_threads") = 0,
        pybind11::arg("residual") = pybind11::none());
  m.def("linear_grouped", &linear_grouped,
        "[x[rows of group groups[i]] @ dequant(W_i).T (+ b_i)] for weights [(qtype, raw, in_features, bias)], x [rows, "
        "in_features] holding groups of counts[g] rows one after another; q8 activations, one call (each weight "
        "bitwise its own call on its group's rows)",
        pybind11::arg("x"), pybind11::arg("counts"), pybind11::arg("weights"), pybind11::arg("groups"));
  m.def("repack_lanes", &repack_lanes,
        "a copy of GGML blocks in the q8 GEMM's lane layout (to_lanes) or back in the GGML layout",
        pybind11::arg("qtype"), pybind11::arg("raw"), pybind11::arg("in_features"), pybind11::arg("to_lanes"),
        pybind11::arg("num_threads") = 0);
  m.def("lanes_rows", &lanes_rows, "rows ids of a weight in the lane layout, as GGML blocks", pybind11::arg("qtype"),
        pybind11::arg("raw"), pybind11::arg("in_features"), pybind11::arg("ids"));
  m.def("lanes_id", []() { return q8::LANES_ID; }, "kernel type id of a lane layout = GGML type id + this");
  m.def("quantize_activations", &quantize_activations,
        "(q int8 [T, K], d float32 [T, K/bs], sums): x quantized per block of bs = 256 or 32",
        pybind11::arg("x"), pybind11::arg("block_size"));
  register_ops(m);
  register_delta(m);
  register_decode(m);
  m.def("isa", &isa, "the instruction set of the q8 GEMM in use: 'avx2' or 'avx512vnni'");
  m.def("set_tuning", &set_tuning,
        "set the q8 GEMM's (prefetch, ahead, runs, tile1, chain) for a class of row counts (0: 1 row, 1: 2-16, "
        "2: more); returns the previous", pybind11::arg("rows_class"), pybind11::arg("prefetch"), pybind11::arg("ahead"),
        pybind11::arg("runs"), pybind11::arg("tile1") = 0, pybind11::arg("chain") = 0);
  m.def("tuning_problem", &tuning_problem,
        "what is wrong with a (prefetch, ahead, runs, tile1, chain) setting; '' where set_tuning takes it",
        pybind11::arg("prefetch"), pybind11::arg("ahead"), pybind11::arg("runs"), pybind11::arg("tile1"),
        pybind11::arg("chain"));
  m.def("tuning", [](int64_t cls) {
    TORCH_CHECK(cls >= 0 && cls < qd_abi::TUNING_CLASSES, "tuning class must be 0, 1 or 2");
    const auto t = tuning_of(static_cast<int>(cls));
    return std::make_tuple(t.prefetch, t.ahead, t.runs, t.tile1, t.chain);
  }, "the q8 GEMM's (prefetch, ahead, runs, tile1, chain) for a class of row counts", pybind11::arg("rows_class"));
  m.def("int8_dot_rate", &int8_dot_rate,
        "int8 products per second of the q8 GEMM's integer dot step (the build in use), num_threads threads",
        pybind11::arg("num_threads"));
  m.def("set_isa", &set_isa, "select the q8 GEMM build ('auto', 'avx2', 'avx512vnni'); returns the previous",
        pybind11::arg("name"));
}
