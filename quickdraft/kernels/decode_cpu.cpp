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
#include <tuple>
#include <vector>

#include "ops_api.h"

namespace {

using qd_api::WeightSpec;
using OptTensor = c10::optional<torch::Tensor>;

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
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
                "x must be a CPU float32 tensor [T, H]");
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == num_layers() &&
                    v_cache.size(0) == num_layers(),
                "the caches must be [layers, kv heads, S, D] for ", num_layers(), " layers");
    const int64_t T = x.size(0);
    std::vector<torch::Tensor> captured;
    const auto wants = [&](int64_t i) { return std::find(capture.begin(), capture.end(), i) != capture.end(); };
    x = x.contiguous();
    for (int64_t i = 0; i < num_layers(); ++i) {
      if (wants(i)) captured.push_back(x);
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
      x = qd_api::linear_multi(h, {down}, x)[0];
    }
    if (wants(num_layers())) captured.push_back(x);
    return {x, captured};
  }

 private:
  std::vector<LayerSpec> layers_;
  torch::Tensor cos_, sin_;
  double eps_;
  int64_t nh_, nkv_, hd_;
  double scale_;
  int64_t window_;
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
}
