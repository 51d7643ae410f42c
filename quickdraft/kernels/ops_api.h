// The native functions one translation unit of the extension calls in another (decode_cpu.cpp runs
// a whole decoder stack with the GEMMs of ggml_cpu.cpp and the ops of ops_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace qd_api {

// Releases the GIL for its scope where the calling thread holds it (a kernel called from Python)
// and does nothing where it does not (a kernel called by DecoderStack::run, which runs the whole
// pass without the GIL, so the event loop's thread never makes a pass wait for it).
class ReleaseGil {
 public:
  ReleaseGil() : saved_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~ReleaseGil() {
    if (saved_ != nullptr) PyEval_RestoreThread(saved_);
  }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* saved_;
};

// (kernel type id, raw blocks [N, row_bytes], in_features, bias [N] or None)
using WeightSpec = std::tuple<int64_t, torch::Tensor, int64_t, c10::optional<torch::Tensor>>;

// ggml_cpu.cpp: [x @ W_i.T (+ b_i)], q8 activations, one parallel region; with a residual (one
// weight): residual + x @ W.T (+ b), the same bits as adding it after
std::vector<torch::Tensor> linear_multi(const torch::Tensor& x, const std::vector<WeightSpec>& weights,
                                        const c10::optional<torch::Tensor>& residual = c10::nullopt);

// ggml_cpu.cpp: weight i on the rows of group groups[i] of x (counts[g] rows each, in order), each
// result what a call of its own on those rows gives
std::vector<torch::Tensor> linear_grouped(const torch::Tensor& x, const std::vector<int64_t>& counts,
                                          const std::vector<WeightSpec>& weights, const std::vector<int64_t>& groups);

// ops_cpu.cpp
// offset: 0 (w * normed x) or 1 ((1 + w) * normed x: Gemma's and Qwen3.5's norms)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, double offset = 0.0);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& positions);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                     int64_t window, double scale, const c10::optional<torch::Tensor>& slots,
                     const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& k_new,
                     const c10::optional<torch::Tensor>& v_new,
                     const c10::optional<torch::Tensor>& sinks = c10::nullopt);  // [Hq]: GPT-OSS's sink logits

// ggml_cpu.cpp: whether the q8 GEMM runs its AVX-512 VNNI build (the CPU's best, unless QUICKDRAFT_ISA=avx2):
// the other kernels with an AVX-512 build (delta_avx512.cpp) follow it
bool wide_vectors();

// delta_cpu.cpp: Gated DeltaNet rows -> [out [T, Hv*Dv], T windows, T states] (undefined where keep is false)
std::vector<torch::Tensor> gated_delta_rows(const torch::Tensor& mixed, const torch::Tensor& z, const torch::Tensor& b,
                                            const torch::Tensor& a, const torch::Tensor& conv_w,
                                            const torch::Tensor& a_scale, const torch::Tensor& dt_bias,
                                            const torch::Tensor& norm_w, double eps, int64_t nk, int64_t dk,
                                            int64_t nv, int64_t dv, bool tiled, const std::vector<int64_t>& parents,
                                            const std::vector<torch::Tensor>& start_convs,
                                            const std::vector<torch::Tensor>& start_states,
                                            const std::vector<bool>& keep);

}  // namespace qd_api
