// The Gated DeltaNet delta rule of one value head (delta_cpu.cpp's phase 2), compiled twice: with the command
// line's AVX2 flags (delta_cpu.cpp) and for AVX-512 (delta_avx512.cpp, 16 floats a vector). The operations are
// elementwise along a state row, in one fixed order per element, with no fused multiply-adds
// (-ffp-contract=off), so the two builds give the same bits (tests/test_qwen3_5.py checks it); the includer
// names the namespace (QD_DELTA_NS).

#include <cstdint>

namespace qd_abi {
// delta_avx512.cpp: the AVX-512 build of the functions below (call only where the CPU runs AVX-512)
void delta_head_read_avx512(const float* sp, const float* k, float decay, int64_t dk, int64_t dv, float* r);
void delta_head_write_avx512(const float* sp, float* sn, const float* k, const float* q, const float* v, float beta,
                             float decay, int64_t dk, int64_t dv, float* r, float* o, const float* next_k,
                             float next_decay, float* next_r);
}  // namespace qd_abi

#ifdef QD_DELTA_NS
namespace QD_DELTA_NS {

// One value head's delta rule over its state, in two halves: s_new = s_prev * decay + k (beta (v - r))^T with
// r = (s_prev*decay)^T k, and o = s_new^T q; s_prev and s_new [dk, dv] (may be the same memory: each element is
// read before it is written, so in place gives the same bits). The decayed state is computed where it is used
// (the same product, the same bits), not stored and read back.
//
// head_read: r = (s_prev*decay)^T k, one pass over s_prev.
inline void head_read(const float* sp, const float* k, float decay, int64_t dk, int64_t dv, float* r) {
  for (int64_t j = 0; j < dv; ++j) r[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* a = sp + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) r[j] += (a[j] * decay) * ki;
  }
}

// write_rows: the new state and o from the scaled delta r; with kFused, also the next row's head_read
// (next_r) from each new element as it is stored, in head_read's order and with its operations.
template <bool kFused>
inline void write_rows(const float* sp, float* sn, const float* k, const float* q, float decay, int64_t dk,
                       int64_t dv, const float* r, float* o, const float* next_k, float next_decay, float* next_r) {
  for (int64_t i = 0; i < dk; ++i) {
    const float* a = sp + i * dv;
    float* s = sn + i * dv;
    const float ki = k[i], qi = q[i], nki = kFused ? next_k[i] : 0.0f;
    for (int64_t j = 0; j < dv; ++j) {
      const float x = a[j] * decay + ki * r[j];
      s[j] = x;
      o[j] += x * qi;
      if constexpr (kFused) next_r[j] += (x * next_decay) * nki;
    }
  }
}

// head_write: from r (head_read's), the new state and o, in one pass. Where the next row continues this one
// (next_k given), that row's head_read runs in the same pass, so the next row reads its state once, not twice
// (bitwise what head_read over s_new gives).
inline void head_write(const float* sp, float* sn, const float* k, const float* q, const float* v, float beta,
                       float decay, int64_t dk, int64_t dv, float* r, float* o, const float* next_k, float next_decay,
                       float* next_r) {
  for (int64_t j = 0; j < dv; ++j) r[j] = (v[j] - r[j]) * beta;  // the delta, scaled by beta
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
  if (next_k == nullptr) {
    write_rows<false>(sp, sn, k, q, decay, dk, dv, r, o, nullptr, 0.0f, nullptr);
    return;
  }
  for (int64_t j = 0; j < dv; ++j) next_r[j] = 0.0f;
  write_rows<true>(sp, sn, k, q, decay, dk, dv, r, o, next_k, next_decay, next_r);
}

}  // namespace QD_DELTA_NS
#endif
