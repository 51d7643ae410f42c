// The "q8 activations" path: input rows quantized to int8 per block, integer dot products with
// the GGML weight blocks (AVX2 maddubs/madd), one float step per weight block. See ggml_cpu.cpp
// for the design; plain C++ without torch, like ggml_cpu.h.
#pragma once

#include "ggml_cpu.h"

#ifndef QD_Q8_JOB
#define QD_Q8_JOB
namespace qd_abi {
// One weight matrix of a call: y[T, N] = x @ W.T (+ bias). Shared by the AVX2 and AVX-512 builds.
struct Job {
  int64_t qtype;
  const uint8_t* W;
  const float* bias;
  float* y;
  int64_t N, K, row_bytes, pf_step, npanels;
  int mode;  // XMode of the activations it reads
};
// The q8 GEMM of the AVX-512 VNNI build (ggml_q8_avx512.cpp).
void gemm_multi_avx512vnni(const float* x, int64_t T, int64_t K, Job* jobs, int njobs, int nthreads);
}  // namespace qd_abi
#endif

// QD_VNNI (set by ggml_q8_avx512.cpp): AVX-512 VNNI dot products and 32 vector registers.
#ifdef QD_VNNI
#define QD_ACC_REG "+v"
#else
#define QD_ACC_REG "+x"
#endif

namespace QD_NS {
namespace q8 {

// ---------------------------------------------------------------------------------------------
// Activation quantization
//
// Two modes, picked by the weight format (like llama.cpp's vec_dot_type):
//   KQ (K-quant weights, block 256, "Q8_K"): one fp32 scale per 256 values and the int16 sum of
//       q over each 16 values (for the Q4_K min and Q6_K offset terms);
//   B32 (32-blocks: Q4_0, Q4_1, Q5_0, Q8_0): one fp32 scale per 32 values and the sum of q over
//       the 32 (for the Q4_1 min term).
// Per block: amax = max |x|, d = amax / 127, id = d != 0 ? 1 / d : 0, q = round-half-even(x * id)
// (|q| <= 127: x * id is at most 127 times (1 + 2^-22)). quickdraft/quant/ggml.py has the same
// rule in torch, bit for bit. A row is quantized alone: the same bits whatever rows come with it.
// ---------------------------------------------------------------------------------------------

enum XMode : int { KQ = 0, B32 = 1 };

// One input row's 256 values (one panel step), quantized. 352 bytes, 32-byte aligned.
struct alignas(32) XChunk {
  int8_t q[256];
  int16_t bsum[16];  // KQ: sum of q[16i .. 16i+15]
  float d[8];        // KQ: d[0] is the scale of the 256; B32: d[b] is the scale of q[32b .. 32b+31]
  float s[8];        // B32: sum of q[32b .. 32b+31] as a float (exact: |s| <= 4064)
};
static_assert(sizeof(XChunk) == 352, "XChunk layout");

QD_INLINE float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// max |x[0 .. 8n)|; NaN if any x is NaN (so a NaN input gives a NaN output, as on the f32 path).
QD_INLINE float absmax(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int v = 0; v < n; ++v) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * v));
    m = _mm256_max_ps(m, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  const float r = hmax8(m);
  return _mm256_movemask_ps(nan) ? __builtin_nanf("") : r;
}

// 32 values x * id -> 32 int8 at q (cvtps2dq rounds half to even, MXCSR's default mode); returns
// 8 int32 lanes of partial sums of q (lane l: q[4l] + .. + q[4l+3]).
QD_INLINE __m256i quant32(const float* x, __m256 id, int8_t* q) {
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
  // packs work per 128-bit lane: dwords come out as i0lo i1lo i2lo i3lo | i0hi i1hi i2hi i3hi
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  const __m256i v = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_store_si256(reinterpret_cast<__m256i*>(q), v);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
}

// n values (a multiple of 32, at most 256) of one row -> c.
template <int MODE>
void quantize_chunk(const float* x, int n, XChunk& c) {
  if (MODE == KQ) {
    const float d = absmax(x, n / 8) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    c.d[0] = d;
    for (int v = 0; v < n / 32; ++v) {
      const __m256i s = quant32(x + 32 * v, _mm256_set1_ps(id), c.q + 32 * v);
      // lanes 0..3: values 0..15, lanes 4..7: values 16..31
      const __m128i h = _mm_hadd_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      const __m128i h2 = _mm_hadd_epi32(h, h);  // [sum 0..15, sum 16..31, ...]
      c.bsum[2 * v] = static_cast<int16_t>(_mm_cvtsi128_si32(h2));
      c.bsum[2 * v + 1] = static_cast<int16_t>(_mm_extract_epi32(h2, 1));
    }
  } else {
    for (int b = 0; b < n / 32; ++b) {
      const float d = absmax(x + 32 * b, 4) / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      c.d[b] = d;
      const __m256i s = quant32(x + 32 * b, _mm256_set1_ps(id), c.q + 32 * b);
      __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      h = _mm_hadd_epi32(h, h);
      h = _mm_hadd_epi32(h, h);
      c.s[b] = static_cast<float>(_mm_cvtsi128_si32(h));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weight formats for the integer dot
//
// F::prepare(block, pre) decodes a block's scales; F::seg(s, block, pre, put) for s < NSEG calls
// put(v, w, sc) with w the 32 weight bytes of vector v (elements 32v .. 32v+31 of the block: the
// same positions as the activation bytes q[32v ..]) and sc the int16 multipliers of the 16 pair
// sums maddubs makes of them. Unsigned formats give w in 0..15 or 0..63 (maddubs(w, q)); SIGNED
// ones give w as int8 and the dot uses maddubs(|w|, sign(q, w)).
// No int16 saturation can occur, for any input: maddubs adds two products of |w| <= 128 (Q8_0's
// |-128|) and |q| <= 127, so |pair| <= 2 * 128 * 127 = 32512 < 32767 (Q6_K: 2 * 63 * 127 = 16002,
// Q4_K: 2 * 15 * 127 = 3810); madd then widens to int32. No int32 overflow either: a block's lane
// is at most 8 vectors * 2 pairs * 128 (|Q6_K scale|) * 16002 < 2^25 (Q6_K's 32*offset term:
// 32 * 2 * 128 * 2032 < 2^24). Lanes below 2^24 convert to float exactly (every format but an
// extreme Q6_K block; there the conversion rounds, deterministically, by at most 2^-24 relative).
// F::finish(isum, pre, xc, blk, acc) turns the block's exact int32 lanes into floats: the only
// float arithmetic of the path, one fixed sequence per (row, output, block).
// ---------------------------------------------------------------------------------------------

QD_INLINE __m256 dxb(const XChunk& xc, int64_t blk) { return _mm256_broadcast_ss(xc.d + blk); }

struct Q4_0 {  // w = d*(q-8): signed bytes q-8
  static constexpr int64_t BS = 32, TS = 18;
  static constexpr int NSEG = 1, MODE = B32;
  static constexpr bool SIGNED = true;
  static constexpr bool UNIT = true;  // sc is always 1
  struct Pre {
    float d;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { p.d = fp16(b); }
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    put(0, _mm256_sub_epi8(w, _mm256_set1_epi8(8)), _mm256_set1_epi16(1));
  }
  static QD_INLINE void finish(__m256i isum, const Pre& p, const XChunk& xc, int64_t blk, float* acc) {
    const __m256 s = _mm256_mul_ps(_mm256_set1_ps(p.d), dxb(xc, blk));
    _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, _mm256_load_ps(acc)));
  }
};

struct Q4_1 {  // w = d*q + m, q 0..15: sum x w = dx*(d*sum(q*qx) + m*sum(qx))
  static constexpr int64_t BS = 32, TS = 20;
  static constexpr int NSEG = 1, MODE = B32;
  static constexpr bool SIGNED = false;
  static constexpr bool UNIT = true;  // sc is always 1
  struct Pre {
    float d, m;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    p.d = fp16(b);
    p.m = fp16(b + 2);
  }
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    put(0, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4)),
        _mm256_set1_epi16(1));
  }
  static QD_INLINE void finish(__m256i isum, const Pre& p, const XChunk& xc, int64_t blk, float* acc) {
    const __m256 dx = dxb(xc, blk);
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(p.d), dx), _mm256_load_ps(acc));
    // the min term goes to lane 0: [sum(qx), 0, ..., 0] * (m * dx)
    const __m256 sx = _mm256_zextps128_ps256(_mm_load_ss(xc.s + blk));
    a = _mm256_fmadd_ps(sx, _mm256_mul_ps(_mm256_set1_ps(p.m), dx), a);
    _mm256_store_ps(acc, a);
  }
};

struct Q5_0 {  // w = d*(q-16), q 5 bits: signed bytes q-16
  static constexpr int64_t BS = 32, TS = 22;
  static constexpr int NSEG = 1, MODE = B32;
  static constexpr bool SIGNED = true;
  static constexpr bool UNIT = true;  // sc is always 1
  using Pre = Q4_0::Pre;
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { p.d = fp16(b); }
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i b4 = _mm256_set1_epi8(0x10);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);  // byte j: qh byte j/8
    hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit), b4);      // 16 where bit j is set
    put(0, _mm256_sub_epi8(_mm256_or_si256(nib, hb), b4), _mm256_set1_epi16(1));
  }
  static QD_INLINE void finish(__m256i isum, const Pre& p, const XChunk& xc, int64_t blk, float* acc) {
    Q4_0::finish(isum, p, xc, blk, acc);
  }
};

struct Q8_0 {  // w = d*q, q int8
  static constexpr int64_t BS = 32, TS = 34;
  static constexpr int NSEG = 1, MODE = B32;
  static constexpr bool SIGNED = true;
  static constexpr bool UNIT = true;  // sc is always 1
  using Pre = Q4_0::Pre;
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { p.d = fp16(b); }
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    put(0, load_256(b + 2), _mm256_set1_epi16(1));
  }
  static QD_INLINE void finish(__m256i isum, const Pre& p, const XChunk& xc, int64_t blk, float* acc) {
    Q4_0::finish(isum, p, xc, blk, acc);
  }
};

// Q4_K (layout in ggml_cpu.h): w = (d*sc_g)*q - dmin*m_g for group g (32 values), q 0..15.
// sum x w = dx * (d * sum_g sc_g * sum(q*qx) - dmin * sum_g m_g * (bsum_2g + bsum_2g+1)).
struct Q4_K {
  static constexpr int64_t BS = 256, TS = 144;
  static constexpr int NSEG = 4, MODE = KQ;
  static constexpr bool SIGNED = false;
  static constexpr bool UNIT = false;  // per-group scales sc
  struct Pre {
    alignas(32) int16_t mins[16];  // m0 m0 m1 m1 ... m7 m7 (pairs with the 16 bsums)
    alignas(16) int16_t sc[8];
    float d, dmin;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    uint32_t u[3];
    std::memcpy(u, b + 4, 12);
    const uint64_t sc = (uint64_t{(u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)} << 32) |
                        (u[0] & 0x3f3f3f3fu);
    const uint64_t mn = (uint64_t{((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)} << 32) |
                        (u[1] & 0x3f3f3f3fu);
    const __m128i s8 = _mm_cvtsi64_si128(static_cast<int64_t>(sc));
    const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mn));
    _mm_store_si128(reinterpret_cast<__m128i*>(p.sc), _mm_cvtepu8_epi16(s8));
    _mm256_store_si256(reinterpret_cast<__m256i*>(p.mins), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)));
    p.d = fp16(b);
    p.dmin = fp16(b + 2);
  }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre& p, P&& put) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i q = load_256(b + 16 + 32 * s);
    put(2 * s, _mm256_and_si256(q, m4), _mm256_set1_epi16(p.sc[2 * s]));
    put(2 * s + 1, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), _mm256_set1_epi16(p.sc[2 * s + 1]));
  }
  static QD_INLINE void finish(__m256i isum, const Pre& p, const XChunk& xc, int64_t, float* acc) {
    const __m256 dx = dxb(xc, 0);
    const __m256i ms = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(p.mins)),
                                         _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.bsum)));
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(p.d), dx), _mm256_load_ps(acc));
    a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(_mm256_set1_ps(p.dmin), dx), a);
    _mm256_store_ps(acc, a);
  }
};

// Q6_K (layout in ggml_cpu.h): w = (d*scale_g)*(q-32) for group g (16 values), q 0..63, scale int8.
// sum x w = dx * d * (sum_g scale_g * sum(q*qx) - 32 * sum_g scale_g * bsum_g).
struct Q6_K {
  static constexpr int64_t BS = 256, TS = 210;
  static constexpr int NSEG = 4, MODE = KQ;
  static constexpr bool SIGNED = false;
  static constexpr bool UNIT = false;  // per-group scales sc
  struct Pre {
    alignas(32) int16_t sc[16];      // scale_0 .. scale_15
    alignas(32) int16_t scv[8][16];  // vector v: scale_2v x 8 | scale_2v+1 x 8 (the 16 pair sums)
    float d;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(p.sc), s);
    const __m256i lo = _mm256_permute2x128_si256(s, s, 0x00), hi = _mm256_permute2x128_si256(s, s, 0x11);
    QD_UNROLL
    for (int k = 0; k < 4; ++k) {
      // low 128-bit lane: word 2k, high lane: word 2k+1
      const __m256i ctl = _mm256_setr_epi8(4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,  //
                                           4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,  //
                                           4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2,
                                           4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3,
                                           4 * k + 2, 4 * k + 3);
      _mm256_store_si256(reinterpret_cast<__m256i*>(p.scv[k]), _mm256_shuffle_epi8(lo, ctl));
      _mm256_store_si256(reinterpret_cast<__m256i*>(p.scv[k + 4]), _mm256_shuffle_epi8(hi, ctl));
    }
    p.d = fp16(b + 208);
  }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre& p, P&& put) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const int h = s / 2;
    const __m256i l0 = load_256(b + 64 * h), l1 = load_256(b + 64 * h + 32), hh = load_256(b + 128 + 32 * h);
    QD_UNROLL
    for (int cc = 0; cc < 2; ++cc) {
      const int c = 2 * (s % 2) + cc;  // elements 128h + 32c .. +31: vector 4h + c
      const __m256i l = c % 2 ? l1 : l0;
      const __m256i lo = c < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
      const __m256i hi = c == 0   ? _mm256_slli_epi16(hh, 4)
                         : c == 1 ? _mm256_slli_epi16(hh, 2)
                         : c == 2 ? hh
                                  : _mm256_srli_epi16(hh, 2);
      const int v = 4 * h + c;
      put(v, _mm256_or_si256(lo, _mm256_and_si256(hi, m2)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(p.scv[v])));
    }
  }
  static QD_INLINE void finish(__m256i isum, const Pre& p, const XChunk& xc, int64_t, float* acc) {
    const __m256i off = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(p.sc)),
                                          _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.bsum)));
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));
    const __m256 s = _mm256_mul_ps(_mm256_set1_ps(p.d), dxb(xc, 0));
    _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, _mm256_load_ps(acc)));
  }
};

// ---------------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------------

constexpr int TT_MAX = 8;  // input rows per register tile
constexpr int TB = 64;     // input rows per accumulator block
constexpr int64_t PF_AHEAD = 1;  // a panel prefetches the panel this many ahead (same work item)

// Weight rows per tile of TT input rows: TT * NN int32 accumulators stay in registers.
// (Measured on Zen 4: the same shapes are best for the AVX-512 VNNI build; wider tiles there were
// 2-10% slower at 1, 4 and 8 rows.)
template <class F>
constexpr int nn_for(int tt) {
  return tt == 1 ? 4 : tt <= 4 ? 2 : 1;
}

// acc[i][j] (8 floats at acc + (i*NP + j)*8) += rows i of x (chunks x[i]) . weight rows j (blocks
// at b[j]), over nblk blocks of the current chunk.
template <class F, int TT, int NN>
QD_INLINE void tile(const XChunk* x, const uint8_t* const* b, int64_t nblk, float* acc) {
  const uint8_t* p[NN];
  QD_UNROLL
  for (int j = 0; j < NN; ++j) p[j] = b[j];
  for (int64_t blk = 0; blk < nblk; ++blk) {
    typename F::Pre pre[NN];
    QD_UNROLL
    for (int j = 0; j < NN; ++j) F::prepare(p[j], pre[j]);
    __m256i ia[TT][NN];
    QD_UNROLL
    for (int i = 0; i < TT; ++i)
      QD_UNROLL
      for (int j = 0; j < NN; ++j) ia[i][j] = _mm256_setzero_si256();
    const int64_t xo = F::BS == 32 ? 32 * blk : 0;
    QD_UNROLL
    for (int s = 0; s < F::NSEG; ++s) {
      QD_UNROLL
      for (int j = 0; j < NN; ++j) {
        F::seg(s, p[j], pre[j], [&](int v, __m256i w, __m256i sc) __attribute__((always_inline)) {
          const __m256i wu = F::SIGNED ? _mm256_sign_epi8(w, w) : w;  // |w| (|-128| = 128 unsigned)
          QD_UNROLL
          for (int i = 0; i < TT; ++i) {
            __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(x[i].q + xo + 32 * v));
            if (F::SIGNED) xv = _mm256_sign_epi8(xv, w);
#ifdef QD_VNNI
            // the same exact integer sums in fewer instructions: dpbusd = maddubs + madd(1) + add
            // (no int16 step at all), dpwssd = madd + add
            if constexpr (F::UNIT)
              ia[i][j] = _mm256_dpbusd_epi32(ia[i][j], wu, xv);
            else
              ia[i][j] = _mm256_dpwssd_epi32(ia[i][j], _mm256_maddubs_epi16(wu, xv), sc);
#else
            ia[i][j] = _mm256_add_epi32(ia[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), sc));
#endif
            // keeps GCC from reassociating the (exact, so reorderable) integer sums into trees
            // of products computed far ahead and spilled to the stack
            __asm__("" : QD_ACC_REG(ia[i][j]));
          }
        });
      }
    }
    QD_UNROLL
    for (int i = 0; i < TT; ++i)
      QD_UNROLL
      for (int j = 0; j < NN; ++j) F::finish(ia[i][j], pre[j], x[i], blk, acc + (i * NP + j) * 8);
    QD_UNROLL
    for (int j = 0; j < NN; ++j) p[j] += F::TS;
  }
}

template <class F, int TT>
__attribute__((noinline)) void tile_panel(const XChunk* x, const uint8_t* const* b, int64_t nblk, float* acc) {
  constexpr int NN = nn_for<F>(TT);
  static_assert(NP % NN == 0, "NN must divide NP");
  for (int j = 0; j < NP; j += NN) tile<F, TT, NN>(x, b + j, nblk, acc + j * 8);
  // GCC 12 (-O1 and up) wrongly summarizes some instances (32-blocks, TT <= 2) as writing no
  // memory and drops their calls; a memory clobber keeps its interprocedural analysis honest.
  __asm__ volatile("" ::: "memory");
}

// tb input rows (consecutive chunks from x) against the panel.
template <class F>
void rows_panel(const XChunk* x, const uint8_t* const* b, int64_t nblk, float* acc, int tb) {
  int t = 0;
  for (; t + TT_MAX <= tb; t += TT_MAX) tile_panel<F, TT_MAX>(x + t, b, nblk, acc + t * NP * 8);
  switch (tb - t) {
    case 0: break;
    case 1: tile_panel<F, 1>(x + t, b, nblk, acc + t * NP * 8); break;
    case 2: tile_panel<F, 2>(x + t, b, nblk, acc + t * NP * 8); break;
    case 3: tile_panel<F, 3>(x + t, b, nblk, acc + t * NP * 8); break;
    case 4: tile_panel<F, 4>(x + t, b, nblk, acc + t * NP * 8); break;
    case 5: tile_panel<F, 5>(x + t, b, nblk, acc + t * NP * 8); break;
    case 6: tile_panel<F, 6>(x + t, b, nblk, acc + t * NP * 8); break;
    case 7: tile_panel<F, 7>(x + t, b, nblk, acc + t * NP * 8); break;
    default: break;
  }
}

using Job = qd_abi::Job;

// Panel p (output rows 8p .. 8p+7) of job g for all T rows; xq: the activations quantized for the
// job's mode, chunk-major ([K/256][T] chunks). Prefetches panel p + 1 if pf.
template <class F>
void panel(const Job& g, const XChunk* xq, int64_t T, int64_t p, bool pf, float* acc) {
  const int64_t n0 = p * NP;
  const int nn = static_cast<int>(std::min<int64_t>(NP, g.N - n0));
  const uint8_t* rows[NP];  // rows past N repeat the last one; their results are dropped
  for (int j = 0; j < NP; ++j) rows[j] = g.W + std::min<int64_t>(n0 + j, g.N - 1) * g.row_bytes;
  for (int64_t t0 = 0; t0 < T; t0 += TB) {
    const int tb = static_cast<int>(std::min<int64_t>(TB, T - t0));
    std::memset(acc, 0, sizeof(float) * tb * NP * 8);
    for (int64_t c0 = 0; c0 < g.K; c0 += CHUNK) {
      if (t0 == 0 && pf) {
        const uint8_t* q = g.W + (n0 + PF_AHEAD * NP) * g.row_bytes + c0 / CHUNK * g.pf_step;
        const uint8_t* qe =
            std::min(q + g.pf_step, g.W + std::min<int64_t>(g.N, n0 + (PF_AHEAD + 1) * NP) * g.row_bytes);
        // into L1 for 1-2 rows (decode), into L2 for more (measured: 4 rows 15% faster, 1 row 8% slower with L2)
        if (T <= 2)
          for (; q < qe; q += 64) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
        else
          for (; q < qe; q += 64) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T1);
      }
      const int64_t nblk = std::min<int64_t>(CHUNK, g.K - c0) / F::BS;
      const uint8_t* b[NP];
      for (int j = 0; j < NP; ++j) b[j] = rows[j] + c0 / F::BS * F::TS;
      rows_panel<F>(xq + c0 / CHUNK * T + t0, b, nblk, acc, tb);
    }
    for (int t = 0; t < tb; ++t) {
      float* yr = g.y + (t0 + t) * g.N + n0;
      const float* ar = acc + t * NP * 8;
      for (int j = 0; j < nn; ++j) {
        const float s = hsum(_mm256_load_ps(ar + j * 8));
        yr[j] = g.bias ? s + g.bias[n0 + j] : s;
      }
    }
  }
}

// GGML type ids (gguf.GGMLQuantizationType)
enum : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

// Calls fn(F{}) for the q8 format struct of a GGML type id; false if unsupported.
template <class Fn>
bool dispatch(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case T_Q4_0: fn(Q4_0{}); return true;
    case T_Q4_1: fn(Q4_1{}); return true;
    case T_Q5_0: fn(Q5_0{}); return true;
    case T_Q8_0: fn(Q8_0{}); return true;
    case T_Q4_K: fn(Q4_K{}); return true;
    case T_Q6_K: fn(Q6_K{}); return true;
    default: return false;
  }
}

// Fills the job's derived fields; false if the type is unsupported.
inline bool init_job(Job& g) {
  return dispatch(g.qtype, [&](auto f) {
    using F = decltype(f);
    g.row_bytes = g.K / F::BS * F::TS;
    g.npanels = (g.N + NP - 1) / NP;
    const int64_t nchunks = (g.K + CHUNK - 1) / CHUNK;
    g.pf_step = (NP * g.row_bytes / nchunks + 63) / 64 * 64;
    g.mode = F::MODE;
  });
}

// Thread-kept buffer for the quantized activations of short calls (long prefills: per call).
constexpr int64_t XQ_KEEP = int64_t{8} << 20;  // bytes

// x: [T, K] fp32 shared by all jobs (each with in_features K). Quantizes x once per mode the jobs
// need, then computes every job's panels, all in one parallel region.
inline void gemm_multi(const float* x, int64_t T, int64_t K, Job* jobs, int njobs, int nthreads) {
  const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
  bool need[2] = {false, false};
  int64_t panels = 0;
  for (int i = 0; i < njobs; ++i) {
    need[jobs[i].mode] = true;
    panels += jobs[i].npanels;
  }
  const int64_t per_mode = nchunks * T;  // chunks
  const int64_t bytes = (need[0] + need[1]) * per_mode * static_cast<int64_t>(sizeof(XChunk)) + 64;
  static thread_local std::vector<uint8_t> keep;
  std::vector<uint8_t> once;
  std::vector<uint8_t>& buf = bytes <= XQ_KEEP ? keep : once;
  if (static_cast<int64_t>(buf.size()) < bytes) buf.resize(bytes);
  XChunk* base = reinterpret_cast<XChunk*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) / 64 * 64);
  XChunk* xq[2] = {base, base + (need[0] ? per_mode : 0)};
  // Work items: runs of consecutive panels of one job (~8 runs per thread over the whole call).
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, panels)));
  const int64_t run = std::max<int64_t>(1, panels / (8 * nt));
  struct Item {
    int job;
    int64_t p0, p1;
  };
  std::vector<Item> items;
  for (int i = 0; i < njobs; ++i)
    for (int64_t p0 = 0; p0 < jobs[i].npanels; p0 += run)
      items.push_back({i, p0, std::min(jobs[i].npanels, p0 + run)});
  const int64_t nitems = static_cast<int64_t>(items.size());
  const int64_t nq = (need[0] + need[1]) * per_mode;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nq; ++it) {
      const int mode = need[0] && it < per_mode ? KQ : B32;
      const int64_t ct = need[0] && it >= per_mode ? it - per_mode : it;  // chunk-major: c * T + t
      const int64_t c0 = ct / T * CHUNK, t = ct % T;
      const int n = static_cast<int>(std::min<int64_t>(CHUNK, K - c0));
      if (mode == KQ)
        quantize_chunk<KQ>(x + t * K + c0, n, xq[KQ][ct]);
      else
        quantize_chunk<B32>(x + t * K + c0, n, xq[B32][ct]);
    }
    alignas(64) float acc[TB * NP * 8];
    // Handed out dynamically (the machine may be shared); which thread computes a panel never
    // changes its arithmetic.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t it = 0; it < nitems; ++it) {
      const Item& w = items[it];
      const Job& g = jobs[w.job];
      dispatch(g.qtype, [&](auto f) {
        using F = decltype(f);
        for (int64_t p = w.p0; p < w.p1; ++p) panel<F>(g, xq[g.mode], T, p, p + PF_AHEAD < w.p1, acc);
      });
    }
  }
}

// Quantizes x [T, K] in the given mode into chunks ([K/256][T], chunk-major); for tests.
inline void quantize_rows(const float* x, int64_t T, int64_t K, int mode, XChunk* out) {
  const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
  for (int64_t ct = 0; ct < nchunks * T; ++ct) {
    const int64_t c0 = ct / T * CHUNK, t = ct % T;
    const int n = static_cast<int>(std::min<int64_t>(CHUNK, K - c0));
    if (mode == KQ)
      quantize_chunk<KQ>(x + t * K + c0, n, out[ct]);
    else
      quantize_chunk<B32>(x + t * K + c0, n, out[ct]);
  }
}

}  // namespace q8
}  // namespace QD_NS
