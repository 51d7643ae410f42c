// The "q8 activations" path: input rows quantized to int8 per block, integer dot products with
// the weight blocks in their lane layout (AVX2 maddubs/madd, AVX-512 VNNI dpbusd), one float step
// per 256 weights. See ggml_cpu.cpp for the design; plain C++ without torch, like ggml_cpu.h.
#pragma once

#include "ggml_cpu.h"

#include <type_traits>

#ifndef QD_Q8_JOB
#define QD_Q8_JOB
namespace qd_abi {
// One weight matrix of a call: y[T, N] = x @ W.T (+ bias). Shared by the AVX2 and AVX-512 builds.
struct Job {
  int64_t qtype;
  const uint8_t* W;
  const float* bias;
  const float* residual;  // [T, N] added to y (y = residual + x W^T + b), or null
  float* y;
  int64_t N, K, row_bytes, pf_step, npanels;
  int mode;  // XMode of the activations it reads
  int xgroup;  // which of the call's input groups it reads (gemm_multi's rows gstart[g] .. gstart[g + 1] - 1)
};
// How a call moves its weights, never what it computes (every setting gives the same bits): chosen
// per machine by measurement (quickdraft/kernels/tuning.py), per class of row counts.
struct Tuning {
  int prefetch;  // the next panels: 0 not prefetched, 1 into L1, 2 into L2, 3 L1 for 1-2 rows of small panels, else L2
  int ahead;     // how many panels ahead (1..4)
  int runs;      // ranges of consecutive panels per thread (1..16), each taken from its front by its
                 // thread, then from its back by a thread that has finished its own
  int tile1;     // weight rows per register tile of one input row: 2, 4 or 8 (0: the build's default)
  int chain;     // one input row of a K-quant / IQ4_XS weight: a panel's chunks one after another with
                 // the partial sums in registers (1), or chunk by chunk through memory (0)
};
constexpr int TUNING_CLASSES = 3;  // 1 row (decode), 2-16 rows (verification), more (prefill)
inline int tuning_class(int64_t T) { return T == 1 ? 0 : T <= 16 ? 1 : 2; }
// The q8 GEMM of the AVX-512 VNNI build (ggml_q8_avx512.cpp).
void gemm_multi_avx512vnni(const float* x, const int64_t* gstart, int64_t ngroups, int64_t K, Job* jobs, int njobs,
                           int nthreads, const Tuning& tune);
double dot_rate_avx512vnni(int nthreads);  // q8::dot_rate of that build
}  // namespace qd_abi
#endif

// QD_VNNI (set by ggml_q8_avx512.cpp): AVX-512 VNNI dot products and 32 vector registers.
#ifdef QD_VNNI
#define QD_ACC_REG "+v"
#define QD_NREGS 32
#else
#define QD_ACC_REG "+x"
#define QD_NREGS 16
#endif

namespace QD_NS {
namespace q8 {

// ---------------------------------------------------------------------------------------------
// Activation quantization
//
// Two modes, picked by the weight format (like llama.cpp's vec_dot_type); both store q permuted
// like the lane layouts of the weights (see LANES below): byte 4j + r of vector v (q[32v + 4j + r])
// is value 32j + 4v + r, so lane j of every vector belongs to 32-group j of the 256.
//   KL (K-quants): one fp32 scale per 256 values and per-group sums of q (for the Q4_K min and
//       Q6_K offset terms);
//   B32 (32-blocks: Q4_0, Q4_1, Q5_0, Q8_0): one fp32 scale per 32 values (lane j: block j) and
//       the sum of q over each 32 (for the offsets of the unsigned weight bytes, Q4_1's min).
// Per block: amax = max |x|, d = amax / 127, id = d != 0 ? 1 / d : 0, q = round-half-even(x * id)
// (|q| <= 127: x * id is at most 127 times (1 + 2^-22)). quickdraft/quant/ggml.py has the same
// rule in torch, bit for bit. A row is quantized alone: the same bits whatever rows come with it.
// ---------------------------------------------------------------------------------------------

enum XMode : int { KL = 0, B32 = 1 };

alignas(32) inline constexpr float ZERO8[8] = {};  // the partial sums a panel starts from
constexpr int NMODES = 2;

// One input row's 256 values (one panel step), quantized. 384 bytes, 32-byte aligned. A partial
// last chunk (B32: K not a multiple of 256) has zeros in its missing blocks.
struct alignas(32) XChunk {
  int8_t q[256];   // permuted (above)
  float d[8];      // KL: d[0] is the scale of the 256; B32: d[j] is the scale of block j
  float bm[8];     // KL: d * (sum of q over 32-group j), Q4_K's min term; B32: d[j] * sum of block j's q
  int32_t b6[16];  // KL: 32 * (sum of q over 16-group 2j) at j, 16-group 2j + 1 at 8 + j (Q6_K's offset);
                   // B32: b6[j] = sum of block j's q
  uint8_t qa[256];  // |q|, permuted like q: formats whose weights are never -128 dot |x| . sign(w, x)
};
static_assert(sizeof(XChunk) == 640, "XChunk layout");

QD_INLINE void store_abs(XChunk& c) {
  for (int v = 0; v < 8; ++v)
    _mm256_store_si256(reinterpret_cast<__m256i*>(c.qa + 32 * v),
                       _mm256_abs_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(c.q + 32 * v))));
}

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

// n values (a multiple of 32, at most 256; KL: 256) of one row -> c.
template <int MODE>
void quantize_chunk(const float* x, int n, XChunk& c) {
  if (MODE == KL) {
    alignas(32) int8_t qn[256];  // in order
    const float d = absmax(x, 32) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    c.d[0] = d;
    int32_t s16[16];  // sums of q over each 16
    for (int v = 0; v < 8; ++v) {
      const __m256i sm = quant32(x + 32 * v, _mm256_set1_ps(id), qn + 32 * v);
      // lanes 0..3: values 0..15, lanes 4..7: values 16..31
      const __m128i h = _mm_hadd_epi32(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1));
      const __m128i h2 = _mm_hadd_epi32(h, h);  // [sum 0..15, sum 16..31, ...]
      s16[2 * v] = _mm_cvtsi128_si32(h2);
      s16[2 * v + 1] = _mm_extract_epi32(h2, 1);
    }
    int32_t* out = reinterpret_cast<int32_t*>(c.q);  // 4-byte groups: an 8 x 8 transpose
    const int32_t* in = reinterpret_cast<const int32_t*>(qn);
    for (int v = 0; v < 8; ++v)
      for (int j = 0; j < 8; ++j) out[8 * v + j] = in[8 * j + v];
    for (int j = 0; j < 8; ++j) {
      c.bm[j] = d * static_cast<float>(s16[2 * j] + s16[2 * j + 1]);
      c.b6[j] = 32 * s16[2 * j];
      c.b6[8 + j] = 32 * s16[2 * j + 1];
    }
    store_abs(c);
  } else {
    alignas(32) int8_t qn[256];  // in order; missing blocks of a partial chunk stay zero
    std::memset(qn, 0, sizeof(qn));
    for (int b = 0; b < 8; ++b) {
      c.d[b] = 0.0f;
      c.b6[b] = 0;
      c.bm[b] = 0.0f;
    }
    for (int b = 0; b < n / 32; ++b) {
      const float d = absmax(x + 32 * b, 4) / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      c.d[b] = d;
      const __m256i sm = quant32(x + 32 * b, _mm256_set1_ps(id), qn + 32 * b);
      __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1));
      h = _mm_hadd_epi32(h, h);
      h = _mm_hadd_epi32(h, h);
      c.b6[b] = _mm_cvtsi128_si32(h);
      c.bm[b] = d * static_cast<float>(c.b6[b]);
    }
    int32_t* out = reinterpret_cast<int32_t*>(c.q);
    const int32_t* in = reinterpret_cast<const int32_t*>(qn);
    for (int v = 0; v < 8; ++v)
      for (int j = 0; j < 8; ++j) out[8 * v + j] = in[8 * j + v];
    store_abs(c);
  }
}

// ---------------------------------------------------------------------------------------------
// Weight formats for the integer dot
//
// F::prepare(block, pre) decodes a block's scales; F::seg(s, block, pre, put) for s < NSEG calls
// put(v, w) with w the 32 weight bytes of vector v (at the positions of the activation bytes
// q[32v ..]: lane j of every vector is group j). Unsigned formats give w in 0..15, 0..31 or 0..63;
// SIGNED ones (Q8_0, IQ4) give int8 w and the dot uses |w| . sign(q, w), or, where w is never -128
// (ABS_X: IQ4's values), |q| . sign(w, q) with |q| computed once per call: one step less per vector. The dot is dpbusd (AVX2:
// maddubs + madd(1) + add) into accumulator F::acc_of(v), exact for any input: maddubs adds two
// products of |w| <= 128 and |q| <= 127, so |pair| <= 2 * 128 * 127 = 32512 < 32767 (no int16
// saturation; Q6_K: 2 * 63 * 127), and an int32 lane stays below 2^20. Lanes below 2^24 convert to
// float exactly. F::finish(isum, pre, xc, blk, in, acc) turns the block's exact int32 lanes into
// floats added to the 8 partial sums at in (ZERO8 for a panel's first block), stored at acc: the
// only float arithmetic of the path, one fixed sequence per (row, output, block).
// ---------------------------------------------------------------------------------------------

// 32-block formats in lanes: 8 consecutive blocks of a row (256 weights, a "super-block") with
// their scales first and the values regrouped so that lane j of every vector is block j (see
// LANES below). Q4_0 / Q5_0 keep their unsigned values, the offset goes through the activations'
// block sums: sum x w = dx_j * d_j * (sum q x - offset * sum x); Q8_0 keeps signed bytes.
// A row whose K is not a multiple of 256 ends in a super-block padded with zero blocks (d = 0).

// isum_j - off * s_j, then acc += (dw_j * dx_j) * that (one lane per block)
QD_INLINE void finish32(__m256i isum, __m256 dw, int off, const XChunk& xc, const float* in, float* acc) {
  const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6));
  const __m256i i = off ? _mm256_sub_epi32(isum, _mm256_mullo_epi32(s, _mm256_set1_epi32(off))) : isum;
  const __m256 scale = _mm256_mul_ps(dw, _mm256_load_ps(xc.d));
  _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), scale, _mm256_load_ps(in)));
}

QD_INLINE __m256 fp16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A bit plane (32 bytes: bit v of byte b belongs to vector v's byte b; the Q5 formats' fifth bits,
// Q3_K's third): vector v's bits moved to bit TO of every byte, the rest zero.
template <int TO>
QD_INLINE __m256i plane_bit(__m256i plane, int v) {
  const __m256i bit = _mm256_and_si256(plane, _mm256_set1_epi8(static_cast<char>(1 << v)));
  // 16-bit shifts (v is a constant once unrolled); the masked bit never crosses its byte
  return TO >= v ? _mm256_slli_epi16(bit, TO - v) : _mm256_srli_epi16(bit, v - TO);
}

// The 16 values of IQ4_NL / IQ4_XS (llama.cpp's kvalues_iq4nl), in both 128-bit halves for pshufb.
QD_INLINE __m256i iq4_table() {
  const __m128i t = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  return _mm256_set_m128i(t, t);
}

// 32 bytes at p holding two lane-layout vectors: the low nibbles (vector 2u) and the high ones (2u + 1).
QD_INLINE void nibble_pair(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i q = load_256(p);
  lo = _mm256_and_si256(q, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
}

// seg() of a format whose 4 x 32 value bytes start at byte OFF of the block (nibble pairs)
template <int64_t OFF, class P>
QD_INLINE void nibble_seg(int s, const uint8_t* b, P&& put) {
  __m256i lo, hi;
  nibble_pair(b + OFF + 32 * s, lo, hi);
  put(2 * s, lo);
  put(2 * s + 1, hi);
}

// Signed bytes as unsigned ones, w + 128 (w xor 0x80), where a format's OFF is 128 (the VNNI build's
// dpbusd takes them; the finish takes 128 x the activations' sums off): else unchanged.
template <int OFF>
QD_INLINE __m256i biased(__m256i w) {
  static_assert(OFF == 0 || OFF == 128, "a signed byte's offset is 0 or 128");
  return OFF ? _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))) : w;
}

// seg() of the table formats (values' nibbles at byte AT of the block): the nibbles index table t
// (IQ4's, MXFP4's; biased<OFF> where the format's values go in unsigned).
template <int64_t AT, class P>
QD_INLINE void table_seg(int s, const uint8_t* b, __m256i t, P&& put) {
  __m256i lo, hi;
  nibble_pair(b + AT + 32 * s, lo, hi);
  put(2 * s, _mm256_shuffle_epi8(t, lo));
  put(2 * s + 1, _mm256_shuffle_epi8(t, hi));
}

// Q8_0. AVX2: signed bytes, |w| . sign(q, w) (maddubs would saturate on w + 128). AVX-512 VNNI:
// dpbusd adds its u8 x s8 products straight into int32 lanes, so the weights go in as w + 128
// (w xor 0x80: 0..255) and finish takes 128 * (the activation block's sum of q) off, as for Q4_0's
// offset: the same exact int32 block sums (|lane| <= 255 * 127 * 32 < 2^24) with one step less
// per weight vector (xor, not abs and sign), so the results stay bitwise the AVX2 build's.
struct Q8_0L {  // [d x 8][256 bytes: q, int8]
  static constexpr int64_t BS = 256, TS = 8 * 34, GBS = 32, GTS = 34;
#ifdef QD_VNNI
  static constexpr int OFF = 128, NSEG = 4, MODE = B32, NACC = 2, PAIR_MAX = 2 * 255 * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = true, ABS_X = false;
#else
  static constexpr int OFF = 0, NSEG = 4, MODE = B32, NACC = 2, PAIR_MAX = 2 * 128 * 127;
  static constexpr bool SIGNED = true, LATENCY_SPLIT = true, ABS_X = false;  // (a file may hold -128)
#endif
  struct Pre {
    __m256 d;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { p.d = fp16x8(b); }
  static constexpr int acc_of(int v) { return v % 2; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    put(2 * s, biased<OFF>(load_256(b + 16 + 64 * s)));
    put(2 * s + 1, biased<OFF>(load_256(b + 16 + 64 * s + 32)));
  }
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    finish32(_mm256_add_epi32(isum[0], isum[1]), p.d, OFF, xc, in, acc);
  }
};

template <int OFF, int64_t QS>  // [d x 8][(Q5_0: qh' 32)][qs' 128: vector 2u low nibbles, 2u + 1 high]
struct Nibble32L {
  static constexpr int NSEG = 4, MODE = B32, NACC = 2, PAIR_MAX = 2 * (2 * OFF - 1) * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = true, ABS_X = false;
  struct Pre {
    __m256 d;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { p.d = fp16x8(b); }
  static constexpr int acc_of(int v) { return v % 2; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    __m256i lo, hi;
    nibble_pair(b + QS + 32 * s, lo, hi);
    if constexpr (QS == 48) {  // Q5_0: bit v of qh' byte b is vector v's 5th bit -> 16
      const __m256i qh = load_256(b + 16);
      lo = _mm256_or_si256(lo, plane_bit<4>(qh, 2 * s));
      hi = _mm256_or_si256(hi, plane_bit<4>(qh, 2 * s + 1));
    }
    put(2 * s, lo);
    put(2 * s + 1, hi);
  }
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    finish32(_mm256_add_epi32(isum[0], isum[1]), p.d, OFF, xc, in, acc);
  }
};
struct Q4_0L : Nibble32L<8, 16> {
  static constexpr int64_t BS = 256, TS = 8 * 18, GBS = 32, GTS = 18;
};
struct Q5_0L : Nibble32L<16, 48> {
  static constexpr int64_t BS = 256, TS = 8 * 22, GBS = 32, GTS = 22;
};

// Q4_1 / Q5_1: [d x 8][m x 8][(Q5_1: qh' 32)][qs' 128]: sum x w = dx_j * (d_j * sum q'x) + m_j * (dx_j * s_j)
template <int64_t QH>  // byte of the fifth-bit plane (Q5_1: 32), or 0 for none (Q4_1)
struct Min32L {
  static constexpr int64_t QS = QH ? 64 : 32;
  static constexpr int NSEG = 4, MODE = B32, NACC = 2, PAIR_MAX = 2 * (QH ? 31 : 15) * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = true, ABS_X = false;
  struct Pre {
    __m256 d, m;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    p.d = fp16x8(b);
    p.m = fp16x8(b + 16);
  }
  static constexpr int acc_of(int v) { return v % 2; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    __m256i lo, hi;
    nibble_pair(b + QS + 32 * s, lo, hi);
    if constexpr (QH != 0) {
      const __m256i qh = load_256(b + QH);
      lo = _mm256_or_si256(lo, plane_bit<4>(qh, 2 * s));
      hi = _mm256_or_si256(hi, plane_bit<4>(qh, 2 * s + 1));
    }
    put(2 * s, lo);
    put(2 * s + 1, hi);
  }
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    finish32(_mm256_add_epi32(isum[0], isum[1]), p.d, 0, xc, in, acc);
    _mm256_store_ps(acc, _mm256_fmadd_ps(p.m, _mm256_load_ps(xc.bm), _mm256_load_ps(acc)));
  }
};
struct Q4_1L : Min32L<0> {
  static constexpr int64_t BS = 256, TS = 8 * 20, GBS = 32, GTS = 20;
};
struct Q5_1L : Min32L<32> {
  static constexpr int64_t BS = 256, TS = 8 * 24, GBS = 32, GTS = 24;
};

// MXFP4 (OCP microscaling FP4, GPT-OSS's experts): per 32-block one E8M0 byte e and 32 FP4 (E2M1)
// nibbles in IQ4_NL's order. The nibbles index llama.cpp's kvalues_mxfp4 (twice the E2M1 values, so
// integers: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and the scale is 2^(e - 128) (half of
// 2^(e - 127), ggml_e8m0_to_fp32_half): exact in fp32 for every byte.
QD_INLINE __m256i mxfp4_table() {
  const __m128i t = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  return _mm256_set_m128i(t, t);
}
// 8 E8M0 bytes -> 2^(e - 128) as fp32: bits (e - 1) << 23, or for e < 2 the subnormals 0x200000 << e.
QD_INLINE __m256 e8m0_half8(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
  const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), _mm256_min_epi32(e, one));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, one)));
}

// The 32-block formats whose nibbles index a table of 16 signed values (|w| <= VMAX), looked up with
// pshufb: [scale x 8 (SCALE decodes them)][qs' 128 at byte QS] (Q4_0's lanes); sum x w = dx_j * d_j *
// sum q w. IQ4_NL: fp16 scales, llama.cpp's non-linear values; MXFP4: E8M0 scales, FP4 values.
// AVX-512 VNNI: the table holds w + 128 (unsigned, for dpbusd) and the finish takes 128 x the
// activation block's sum off, as Q8_0L does: the same exact int32 sums, one step less per dot.
template <int64_t QS, int VMAX, __m256 (*SCALE)(const uint8_t*), __m256i (*TABLE)()>
struct Table32L {
#ifdef QD_VNNI
  static constexpr int OFF = 128, NSEG = 4, MODE = B32, NACC = 2, PAIR_MAX = 2 * (128 + VMAX) * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = true, ABS_X = false;
#else
  static constexpr int OFF = 0, NSEG = 4, MODE = B32, NACC = 2, PAIR_MAX = 2 * 128 * VMAX;
  static constexpr bool SIGNED = true, LATENCY_SPLIT = true, ABS_X = true;
#endif
  struct Pre {
    __m256 d;
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { p.d = SCALE(b); }
  static constexpr int acc_of(int v) { return v % 2; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    table_seg<QS>(s, b, biased<OFF>(TABLE()), put);
  }
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    finish32(_mm256_add_epi32(isum[0], isum[1]), p.d, OFF, xc, in, acc);
  }
};
struct IQ4_NLL : Table32L<16, 127, fp16x8, iq4_table> {  // values -127 .. 113
  static constexpr int64_t BS = 256, TS = 8 * 18, GBS = 32, GTS = 18;
};
struct MXFP4L : Table32L<8, 12, e8m0_half8, mxfp4_table> {  // values -12 .. 12
  static constexpr int64_t BS = 256, TS = 8 * 17, GBS = 32, GTS = 17;
};

// ---------------------------------------------------------------------------------------------
// LANES: Q4_K and Q6_K repacked (losslessly, at load: repack_lanes below) so that lane j of every
// 32-byte weight vector holds 4 values of 32-group j (the activations in KL mode are permuted the
// same way). A block's 8 vectors then accumulate with dpbusd (AVX2: maddubs + madd(1)) into one
// int32 register whose lane j is group j's exact sum, and the per-group scales are applied once
// per block in float (8 lanes at a time) instead of once per vector in int16: half the integer
// multiplies per input row, and no scale broadcasts.
//
// Q4_K lanes, 144 bytes: d, dmin, scales[12] as in Q4_K; then 4 x 32 bytes: group u's byte b holds
// vector 2u's byte b in its low nibble and vector 2u + 1's in its high nibble.
// Q6_K lanes, 210 bytes: ql[128] (the low 4 bits, vectors paired as Q4_K lanes' nibbles), qh[64]
// (32 bytes per 4 vectors: vector 4h + k's 2 high bits at bits 2k, 2k + 1 of qh[32h + b]),
// scales[16], d as in Q6_K. Vector v, lane j covers values 32j + 4v .. +3: 16-group 2j for v < 4,
// 2j + 1 for v >= 4; so vectors 0-3 and 4-7 go to two accumulators.
// ---------------------------------------------------------------------------------------------

// Q4_K / Q5_K lanes: [d, dmin, scales 12][(Q5_K: qh' 32)][qs' 128]
template <int64_t QH>  // byte of the fifth-bit plane (Q5_K: 16), or 0 for none (Q4_K)
struct KMinL {
  static constexpr int64_t QS = QH ? 48 : 16;
  // even / odd vectors: two short chains
  static constexpr int NSEG = 4, MODE = KL, NACC = 2, PAIR_MAX = 2 * (QH ? 31 : 15) * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = true, ABS_X = false;
  struct Pre {
    __m256 dsc, dmm;  // d * sc_j, dmin * m_j (lane j: 32-group j)
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    const __m128i v = kscales_mins(b);  // sc_0..7 | m_0..7
    const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    p.dsc = _mm256_mul_ps(_mm256_set1_ps(fp16(b)), s);
    p.dmm = _mm256_mul_ps(_mm256_set1_ps(fp16(b + 2)), m);
  }
  static constexpr int acc_of(int v) { return v % 2; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    __m256i lo, hi;
    nibble_pair(b + QS + 32 * s, lo, hi);
    if constexpr (QH != 0) {
      const __m256i qh = load_256(b + QH);
      lo = _mm256_or_si256(lo, plane_bit<4>(qh, 2 * s));
      hi = _mm256_or_si256(hi, plane_bit<4>(qh, 2 * s + 1));
    }
    put(2 * s, lo);
    put(2 * s + 1, hi);
  }
  // sum x w = sum_j dx * d * sc_j * isum_j - dmin * m_j * (dx * bsum_j)
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    const __m256i is = _mm256_add_epi32(isum[0], isum[1]);
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(p.dsc, _mm256_broadcast_ss(xc.d)),
                               _mm256_load_ps(in));
    a = _mm256_fnmadd_ps(p.dmm, _mm256_load_ps(xc.bm), a);
    _mm256_store_ps(acc, a);
  }
};
struct Q4_KL : KMinL<0> {
  static constexpr int64_t BS = 256, TS = 144, GBS = 256, GTS = 144;  // (GGML block = lanes block)
};
struct Q5_KL : KMinL<16> {
  static constexpr int64_t BS = 256, TS = 176, GBS = 256, GTS = 176;
};

// IQ4_XS lanes, 136 bytes: d, scales_h, scales_l[4] as in IQ4_XS; qs' 128 (Q4_K lanes' nibbles)
// indexing the IQ4_NL values. Scale of 32-group j: ((scales_l >> 4j) & 15 | ((scales_h >> 2j) & 3) << 4) - 32.
struct IQ4_XSL {
  static constexpr int64_t BS = 256, TS = 136, GBS = 256, GTS = 136;
#ifdef QD_VNNI  // the values as w + 128 for dpbusd, 128 x each 32-group's activation sum taken off (as Table32L)
  static constexpr int OFF = 128, NSEG = 4, MODE = KL, NACC = 2, PAIR_MAX = 2 * 255 * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = true, ABS_X = false;
#else
  static constexpr int OFF = 0, NSEG = 4, MODE = KL, NACC = 2, PAIR_MAX = 2 * 128 * 127;
  static constexpr bool SIGNED = true, LATENCY_SPLIT = true, ABS_X = true;  // values -127 .. 113
#endif
  struct Pre {
    __m256 ds;  // d * (scale_j - 32)
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    uint16_t sh;
    uint32_t sl;
    std::memcpy(&sh, b + 2, 2);
    std::memcpy(&sl, b + 4, 4);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(sl)),
                                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    p.ds = _mm256_mul_ps(_mm256_set1_ps(fp16(b)), _mm256_cvtepi32_ps(sc));
  }
  static constexpr int acc_of(int v) { return v % 2; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    table_seg<8>(s, b, biased<OFF>(iq4_table()), put);
  }
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    __m256i is = _mm256_add_epi32(isum[0], isum[1]);
    if constexpr (OFF) {  // b6[j] + b6[8 + j] = 32 x (32-group j's sum of q): 128 x that sum is 4 x it
      const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6));
      const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6 + 8));
      is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_add_epi32(b0, b1), 2));
    }
    _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(p.ds, _mm256_broadcast_ss(xc.d)),
                                         _mm256_load_ps(in)));
  }
};

struct Q6_KL {
  static constexpr int64_t BS = 256, TS = 210, GBS = 256, GTS = 210;
  static constexpr int NSEG = 4, MODE = KL, NACC = 2, PAIR_MAX = 2 * 63 * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = false, ABS_X = false;  // vectors 0-3 / 4-7: 16-groups 2j / 2j + 1
  struct Pre {
    __m256 dsc[2];  // d * scale of 16-group 2j (dsc[0]) and 2j + 1 (dsc[1]) in lane j
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    // scales s0 .. s15 -> even ones, odd ones
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m128i eo = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256 d = _mm256_set1_ps(fp16(b + 208));
    p.dsc[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eo)));
    p.dsc[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(eo, 8))));
  }
  static constexpr int acc_of(int v) { return v / 4; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i l = load_256(b + 32 * s), hh = load_256(b + 128 + 32 * (s / 2));
    const int k = 2 * (s % 2);  // vectors 2s = 4(s/2) + k and 2s + 1
    const __m256i h0 = k == 0 ? _mm256_slli_epi16(hh, 4) : hh;
    const __m256i h1 = k == 0 ? _mm256_slli_epi16(hh, 2) : _mm256_srli_epi16(hh, 2);
    put(2 * s, _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(h0, m2)));
    put(2 * s + 1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4), _mm256_and_si256(h1, m2)));
  }
  // sum x w = sum_g dx * d * scale_g * (isum_g - 32 * bsum_g)
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    const __m256 dx = _mm256_broadcast_ss(xc.d);
    const __m256i i0 = _mm256_sub_epi32(isum[0], _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6)));
    const __m256i i1 = _mm256_sub_epi32(isum[1], _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6 + 8)));
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(p.dsc[0], dx), _mm256_load_ps(in));
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(p.dsc[1], dx), a);
    _mm256_store_ps(acc, a);
  }
};

// Vector 4w + k's 2-bit fields of a 2-bit plane (32 bytes holding vectors 4w .. 4w + 3, vector
// 4w + k at bits 2k, 2k + 1 of every byte; Q3_K's and Q2_K's low bits).
QD_INLINE __m256i field2(__m256i plane, int k) {
  return _mm256_and_si256(_mm256_srli_epi16(plane, 2 * k), _mm256_set1_epi8(3));  // 16-bit shift: masked
}

// 16 int8 scales (of 16-groups 0..15) -> even ones (groups 2j) and odd ones (2j + 1) as floats times d.
QD_INLINE void even_odd_scales(__m128i sc, __m256 d, __m256* out) {
  const __m128i eo = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  out[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eo)));
  out[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(eo, 8))));
}

// Q3_K lanes, 110 bytes: scales[12], d as in Q3_K (moved first); hm' 32 at 14 (bit v of byte b:
// vector v's third bit, hmask); ql' 64 at 46 (2-bit planes). q = low2 + 4 * hbit in 0..7 and
// w = d * (scale_g - 32) * (q - 4) over 16-groups g (vectors 0-3: 2j, 4-7: 2j + 1, as Q6_K lanes).
struct Q3_KL {
  static constexpr int64_t BS = 256, TS = 110, GBS = 256, GTS = 110;
  static constexpr int NSEG = 4, MODE = KL, NACC = 2, PAIR_MAX = 2 * 7 * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = false, ABS_X = false;
  struct Pre {
    __m256 dsc[2];  // d * (scale - 32) of 16-group 2j (dsc[0]) and 2j + 1 (dsc[1]) in lane j
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    // scale i: low 4 bits = byte i % 8 >> 4 (i / 8); high 2 bits = byte 8 + i % 4 >> 2 (i / 4)
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(a, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4));
    uint32_t h;
    std::memcpy(&h, b + 8, 4);
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(h)), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    const __m128i sc = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
    even_odd_scales(sc, _mm256_set1_ps(fp16(b + 12)), p.dsc);
  }
  static constexpr int acc_of(int v) { return v / 4; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    const __m256i ql = load_256(b + 46 + 32 * (s / 2)), hm = load_256(b + 14);
    const int k = 2 * (s % 2);  // vectors 2s = 4(s/2) + k and 2s + 1
    put(2 * s, _mm256_or_si256(field2(ql, k), plane_bit<2>(hm, 2 * s)));
    put(2 * s + 1, _mm256_or_si256(field2(ql, k + 1), plane_bit<2>(hm, 2 * s + 1)));
  }
  // sum x w = sum_g dx * d * scale_g * (isum_g - 4 * bsum_g)   (b6 = 32 * bsum: >> 3 is 4 * bsum)
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    const __m256 dx = _mm256_broadcast_ss(xc.d);
    const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6));
    const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6 + 8));
    const __m256i i0 = _mm256_sub_epi32(isum[0], _mm256_srai_epi32(b0, 3));
    const __m256i i1 = _mm256_sub_epi32(isum[1], _mm256_srai_epi32(b1, 3));
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(p.dsc[0], dx), _mm256_load_ps(in));
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(p.dsc[1], dx), a);
    _mm256_store_ps(acc, a);
  }
};

// Q2_K lanes, 84 bytes: scales[16], d, dmin as in Q2_K; ql' 64 at 20 (2-bit planes). Over 16-groups
// g: w = d * (scale_g & 15) * q - dmin * (scale_g >> 4).
struct Q2_KL {
  static constexpr int64_t BS = 256, TS = 84, GBS = 256, GTS = 84;
  static constexpr int NSEG = 4, MODE = KL, NACC = 2, PAIR_MAX = 2 * 3 * 127;
  static constexpr bool SIGNED = false, LATENCY_SPLIT = false, ABS_X = false;
  struct Pre {
    __m256 dsc[2], dmm[2];  // d * scale, dmin * min of 16-groups 2j ([0]) and 2j + 1 ([1]) in lane j
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    even_odd_scales(_mm_and_si128(s, m4), _mm256_set1_ps(fp16(b + 16)), p.dsc);
    even_odd_scales(_mm_and_si128(_mm_srli_epi16(s, 4), m4), _mm256_set1_ps(fp16(b + 18)), p.dmm);
  }
  static constexpr int acc_of(int v) { return v / 4; }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre&, P&& put) {
    const __m256i ql = load_256(b + 20 + 32 * (s / 2));
    const int k = 2 * (s % 2);
    put(2 * s, field2(ql, k));
    put(2 * s + 1, field2(ql, k + 1));
  }
  // sum x w = sum_g dx * (d * sc_g * isum_g - dmin * m_g * bsum_g)   (bsum_g = b6 >> 5, exact)
  static QD_INLINE void finish(const __m256i* isum, const Pre& p, const XChunk& xc, int64_t, const float* in, float* acc) {
    const __m256 dx = _mm256_broadcast_ss(xc.d);
    const __m256 s0 = _mm256_cvtepi32_ps(
        _mm256_srai_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6)), 5));
    const __m256 s1 = _mm256_cvtepi32_ps(
        _mm256_srai_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(xc.b6 + 8)), 5));
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]), _mm256_mul_ps(p.dsc[0], dx), _mm256_load_ps(in));
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[1]), _mm256_mul_ps(p.dsc[1], dx), a);
    a = _mm256_fnmadd_ps(_mm256_mul_ps(p.dmm[0], dx), s0, a);
    a = _mm256_fnmadd_ps(_mm256_mul_ps(p.dmm[1], dx), s1, a);
    _mm256_store_ps(acc, a);
  }
};

// Byte / shift of value e (0..255) of a block, in the GGML layout and in the lane layout.
struct QPos {
  int byte, shift;
};
QD_INLINE QPos lanes_pos(int e) {  // vector v, byte b of the vector
  const int j = e / 32, t = e % 32, v = t / 4, b = 4 * j + t % 4;
  return {32 * (v / 2) + b, 4 * (v % 2)};
}
QD_INLINE QPos lanes_hpos(int e) {  // Q6_K lanes' 2 high bits
  const int j = e / 32, t = e % 32, v = t / 4, b = 4 * j + t % 4;
  return {128 + 32 * (v / 4) + b, 2 * (v % 4)};
}

// Repacks n blocks of Q4_K (qtype 12) or Q6_K (14) in place between the GGML layout and the lane
// layout (to_lanes: GGML -> lanes; else back). Lossless: the same values, moved. Each output byte
// is gathered straight from the bytes it takes its fields from (the maps below are lanes_pos /
// lanes_hpos solved for the output byte): ~20x faster than moving value by value, which made
// loading a 1.5B model spend ~6 s here.
//   Q4_K (qs at 16): lanes byte 32u + 4j + r, nibble s = value 32j + 8u + 4s + r
//     = GGML byte 32(j >> 1) + 8u + 4s + r, nibble j & 1.
//   Q6_K low 4 bits (ql at 0): lanes byte 32u + 4j + r, nibble s = GGML ql byte
//     64(j >> 2) + 32(j & 1) + 8u + 4s + r, nibble (j >> 1) & 1.
//   Q6_K high 2 bits (qh at 128): lanes byte 128 + 32w + 4j + r, field q (bits 2q) = GGML qh byte
//     128 + 32(j >> 2) + 16w + 4q + r, field j & 3.
inline void repack_lanes(int64_t qtype, uint8_t* blocks, int64_t n, bool to_lanes, int nthreads) {
  const int64_t ts = qtype == 12 ? 144 : 210;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* b = blocks + i * ts;
    uint8_t in[192];
    if (qtype == 12) {
      uint8_t* qs = b + 16;
      std::memcpy(in, qs, 128);
      for (int u = 0; u < 4; ++u)
        for (int j = 0; j < 8; ++j)
          for (int r = 0; r < 4; ++r) {
            const int lane = 32 * u + 4 * j + r, nat = 32 * (j >> 1) + 8 * u + r, sh = 4 * (j & 1);
            if (to_lanes) {
              qs[lane] = static_cast<uint8_t>(((in[nat] >> sh) & 15) | (((in[nat + 4] >> sh) & 15) << 4));
            } else {  // the lanes byte's two nibbles go back to nibble sh of two GGML bytes
              const uint8_t keep = static_cast<uint8_t>(sh ? 0x0f : 0xf0);
              qs[nat] = static_cast<uint8_t>((qs[nat] & keep) | ((in[lane] & 15) << sh));
              qs[nat + 4] = static_cast<uint8_t>((qs[nat + 4] & keep) | ((in[lane] >> 4) << sh));
            }
          }
    } else {
      std::memcpy(in, b, 192);
      for (int u = 0; u < 4; ++u)
        for (int j = 0; j < 8; ++j)
          for (int r = 0; r < 4; ++r) {
            const int lane = 32 * u + 4 * j + r, nat = 64 * (j >> 2) + 32 * (j & 1) + 8 * u + r;
            const int sh = 4 * ((j >> 1) & 1);
            if (to_lanes) {
              b[lane] = static_cast<uint8_t>(((in[nat] >> sh) & 15) | (((in[nat + 4] >> sh) & 15) << 4));
            } else {
              const uint8_t keep = static_cast<uint8_t>(sh ? 0x0f : 0xf0);
              b[nat] = static_cast<uint8_t>((b[nat] & keep) | ((in[lane] & 15) << sh));
              b[nat + 4] = static_cast<uint8_t>((b[nat + 4] & keep) | ((in[lane] >> 4) << sh));
            }
          }
      for (int w = 0; w < 2; ++w)
        for (int j = 0; j < 8; ++j)
          for (int r = 0; r < 4; ++r) {
            const int lane = 128 + 32 * w + 4 * j + r, nat = 128 + 32 * (j >> 2) + 16 * w + r, sh = 2 * (j & 3);
            if (to_lanes) {
              b[lane] = static_cast<uint8_t>(((in[nat] >> sh) & 3) | (((in[nat + 4] >> sh) & 3) << 2) |
                                             (((in[nat + 8] >> sh) & 3) << 4) | (((in[nat + 12] >> sh) & 3) << 6));
            } else {
              const uint8_t keep = static_cast<uint8_t>(~(3 << sh));
              for (int q = 0; q < 4; ++q)
                b[nat + 4 * q] = static_cast<uint8_t>((b[nat + 4 * q] & keep) | (((in[lane] >> (2 * q)) & 3) << sh));
            }
          }
    }
  }
}

// The byte layout of a 32-block format in GGML and in lanes (8 blocks per super-block of 256).
struct Layout32 {
  int64_t gts;  // GGML block bytes
  int nsc;      // scale fields per block (d; Q4_1 / Q5_1: d, m), of scb bytes each: GGML bytes scb k,
                // lanes 8 scb k + scb j (block j)
  int64_t gqh, lqh;  // the 32 fifth bits: GGML u32 at gqh (bit e: element e), lanes plane at lqh; 0: none
  int64_t gqs, lqs;  // the values: GGML nibbles at gqs (element e < 16 low, else high) or int8 (Q8_0);
                     // lanes at lqs: vector 2u's byte b in the low nibble of byte 32u + b, 2u + 1's high
  int scb = 2;       // bytes per scale field: 2 (fp16), MXFP4's E8M0: 1
};
constexpr Layout32 layout32(int64_t qtype) {
  switch (qtype) {
    case 2: case 20: return {18, 1, 0, 0, 2, 16};  // Q4_0, IQ4_NL
    case 39: return {17, 1, 0, 0, 1, 8, 1};        // MXFP4
    case 3: return {20, 2, 0, 0, 4, 32};           // Q4_1
    case 6: return {22, 1, 2, 16, 6, 48};          // Q5_0
    case 7: return {24, 2, 4, 32, 8, 64};          // Q5_1
    default: return {34, 1, 0, 0, 2, 16};          // Q8_0 (int8 values: vector v at lqs + 32 v)
  }
}

// Repacks N rows of K values of a 32-block format (GGML ids 2, 3, 6, 7, 8, 20) from src (GGML: K/32
// blocks per row) to dst (lanes: ceil(K/256) super-blocks per row, a partial last one padded with
// zero blocks), or back (to_lanes false). Lossless.
template <int64_t qtype>  // a constant in the loops below: the per-element branches fold away
void repack_lanes32_t(const uint8_t* src, uint8_t* dst, int64_t N, int64_t K, bool to_lanes, int nthreads) {
  constexpr Layout32 L = layout32(qtype);
  const int64_t nb = K / 32, nsb = (K + 255) / 256, grow = nb * L.gts, lrow = nsb * 8 * L.gts;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* in = src + n * (to_lanes ? grow : lrow);
    uint8_t* out = dst + n * (to_lanes ? lrow : grow);
    std::memset(out, 0, to_lanes ? lrow : grow);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t sb = b / 8, j = b % 8;
      const uint8_t* g = to_lanes ? in + b * L.gts : nullptr;  // the GGML block
      uint8_t* go = to_lanes ? nullptr : out + b * L.gts;
      uint8_t* l = to_lanes ? out + sb * 8 * L.gts : const_cast<uint8_t*>(in + sb * 8 * L.gts);  // its super-block
      for (int k = 0; k < L.nsc; ++k) {
        if (to_lanes)
          std::memcpy(l + 8 * L.scb * k + L.scb * j, g + L.scb * k, L.scb);
        else
          std::memcpy(go + L.scb * k, l + 8 * L.scb * k + L.scb * j, L.scb);
      }
      uint32_t qh = 0;  // the fifth bits: read once per block (to lanes) or gathered, then stored
      if (L.gqh && to_lanes) std::memcpy(&qh, g + L.gqh, 4);
      for (int e = 0; e < 32; ++e) {
        const int v = e / 4, r = e % 4;
        const int64_t lb = 4 * j + r;  // byte of vector v holding element e of block j
        if (qtype == 8) {  // int8 as is
          if (to_lanes)
            l[L.lqs + 32 * v + lb] = g[L.gqs + e];
          else
            go[L.gqs + e] = l[L.lqs + 32 * v + lb];
          continue;
        }
        const int64_t lq = L.lqs + 32 * (v / 2) + lb;
        const int lsh = 4 * (v % 2), gsh = e < 16 ? 0 : 4;
        if (to_lanes) {
          l[lq] |= ((g[L.gqs + e % 16] >> gsh) & 15) << lsh;
          if (L.gqh) l[L.lqh + lb] |= ((qh >> e) & 1) << v;
        } else {
          go[L.gqs + e % 16] |= ((l[lq] >> lsh) & 15) << gsh;
          if (L.gqh) qh |= static_cast<uint32_t>((l[L.lqh + lb] >> v) & 1) << e;
        }
      }
      if (L.gqh && !to_lanes) std::memcpy(go + L.gqh, &qh, 4);
    }
  }
}

inline void repack_lanes32(int64_t qtype, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K, bool to_lanes,
                           int nthreads) {
  switch (qtype) {
    case 2: return repack_lanes32_t<2>(src, dst, N, K, to_lanes, nthreads);
    case 3: return repack_lanes32_t<3>(src, dst, N, K, to_lanes, nthreads);
    case 6: return repack_lanes32_t<6>(src, dst, N, K, to_lanes, nthreads);
    case 7: return repack_lanes32_t<7>(src, dst, N, K, to_lanes, nthreads);
    case 20: return repack_lanes32_t<20>(src, dst, N, K, to_lanes, nthreads);
    case 39: return repack_lanes32_t<39>(src, dst, N, K, to_lanes, nthreads);
    default: return repack_lanes32_t<8>(src, dst, N, K, to_lanes, nthreads);
  }
}

// Q5_K, Q3_K, Q2_K, IQ4_XS: each value's bit fields moved between the GGML block and the lanes block
// (same block size). A field is (byte, shift) in each layout and a mask; header bytes are copied.
// Lanes positions of value e (vector v = e % 32 / 4, byte b = 4 (e / 32) + e % 4 of the vector):
//   nibble at QS + 32 (v / 2) + b, shift 4 (v % 2); plane bit at QH + b, shift v;
//   2-bit field at QL + 32 (v / 4) + b, shift 2 (v % 4).
struct KField {
  QPos ggml, lanes;
  uint8_t mask;
};
struct KLayout {
  int64_t ts;
  int ncopy;
  int64_t copy[3][3];  // (GGML byte, lanes byte, length) of the header fields
  int nfields;         // bit fields per value (1 or 2)
  KField field[2][256];
};

inline KLayout make_klayout(int64_t qtype) {
  KLayout L{};
  for (int e = 0; e < 256; ++e) {
    const int v = e % 32 / 4, b = 4 * (e / 32) + e % 4, g = e / 32, l = e % 32;
    const QPos nib_l{0, 4 * (v % 2)}, two_l{0, 2 * (v % 4)};
    auto nib = [&](int qs) { return QPos{qs + 32 * (v / 2) + b, nib_l.shift}; };
    auto two = [&](int ql) { return QPos{ql + 32 * (v / 4) + b, two_l.shift}; };
    auto bit = [&](int qh) { return QPos{qh + b, v}; };
    const QPos low2{32 * (e / 128) + e % 32, 2 * (e % 128 / 32)};  // Q3_K / Q2_K low bits (add qs)
    switch (qtype) {
      case 13:  // Q5_K: d, dmin, scales | qh 32 | qs 128 (as Q4_K); lanes qh' at 16, qs' at 48
        L.ts = 176, L.ncopy = 1, L.nfields = 2;
        L.copy[0][0] = 0, L.copy[0][1] = 0, L.copy[0][2] = 16;
        L.field[0][e] = {{48 + 32 * (g / 2) + l, 4 * (g % 2)}, nib(48), 15};
        L.field[1][e] = {{16 + l, g}, bit(16), 1};
        break;
      case 11:  // Q3_K: hmask 32 | qs 64 | scales 12 | d; lanes: scales, d, hm' at 14, ql' at 46
        L.ts = 110, L.ncopy = 1, L.nfields = 2;
        L.copy[0][0] = 96, L.copy[0][1] = 0, L.copy[0][2] = 14;
        L.field[0][e] = {{32 + low2.byte, low2.shift}, two(46), 3};
        L.field[1][e] = {{e % 32, e / 32}, bit(14), 1};
        break;
      case 10:  // Q2_K: scales 16 | qs 64 | d, dmin; lanes: scales, d, dmin, ql' at 20
        L.ts = 84, L.ncopy = 2, L.nfields = 1;
        L.copy[0][0] = 0, L.copy[0][1] = 0, L.copy[0][2] = 16;
        L.copy[1][0] = 80, L.copy[1][1] = 16, L.copy[1][2] = 4;
        L.field[0][e] = {{16 + low2.byte, low2.shift}, two(20), 3};
        break;
      default:  // IQ4_XS (23): d, scales_h, scales_l | qs 128 (16 per 32-group: element l < 16 low)
        L.ts = 136, L.ncopy = 1, L.nfields = 1;
        L.copy[0][0] = 0, L.copy[0][1] = 0, L.copy[0][2] = 8;
        L.field[0][e] = {{8 + 16 * g + l % 16, 4 * (l / 16)}, nib(8), 15};
        break;
    }
  }
  return L;
}

inline bool is_klayout_type(int64_t qtype) { return qtype == 10 || qtype == 11 || qtype == 13 || qtype == 23; }
inline int64_t klayout_bytes(int64_t qtype) { return qtype == 10 ? 84 : qtype == 11 ? 110 : qtype == 13 ? 176 : 136; }

// n blocks from src to dst (to_lanes: GGML -> lanes; else back). Lossless.
inline void repack_klayout(int64_t qtype, const uint8_t* src, uint8_t* dst, int64_t n, bool to_lanes, int nthreads) {
  static const KLayout layouts[4] = {make_klayout(10), make_klayout(11), make_klayout(13), make_klayout(23)};
  const KLayout& L = layouts[qtype == 10 ? 0 : qtype == 11 ? 1 : qtype == 13 ? 2 : 3];
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* in = src + i * L.ts;
    uint8_t* out = dst + i * L.ts;
    std::memset(out, 0, L.ts);
    for (int c = 0; c < L.ncopy; ++c)
      std::memcpy(out + L.copy[c][to_lanes], in + L.copy[c][!to_lanes], L.copy[c][2]);
    for (int f = 0; f < L.nfields; ++f)
      for (int e = 0; e < 256; ++e) {
        const KField& k = L.field[f][e];
        const QPos from = to_lanes ? k.ggml : k.lanes, to = to_lanes ? k.lanes : k.ggml;
        out[to.byte] |= static_cast<uint8_t>(((in[from.byte] >> from.shift) & k.mask) << to.shift);
      }
  }
}

// PANELS: the q8 GEMM reads a weight in panels of NP rows, chunk (256 values) by chunk. The lane
// layout stores each panel that way round: panel p (rows NP p .. NP p + nn - 1, nn = min(NP, N - NP p))
// keeps the rows' lanes blocks of chunk c next to each other, so a panel is one sequential stream
// for the hardware prefetchers (measured: Q8_0 and Q6_K 1-row passes 15-20% faster than 8 row
// streams on AMD Zen). Block c of row NP p + j sits at byte NP p * row_bytes + (c nn + j) * TS; a
// panel still spans the bytes its rows would, so the tensor keeps its [N, row_bytes] shape.
inline void interleave_panels(const uint8_t* src, uint8_t* dst, int64_t N, int64_t row_bytes, int64_t ts,
                              bool to_panels, int nthreads) {
  const int64_t nb = row_bytes / ts, npanels = (N + NP - 1) / NP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < npanels; ++p) {
    const int64_t nn = std::min<int64_t>(NP, N - NP * p), base = NP * p * row_bytes;
    for (int64_t j = 0; j < nn; ++j)
      for (int64_t c = 0; c < nb; ++c) {
        const int64_t by_row = base + j * row_bytes + c * ts, by_panel = base + (c * nn + j) * ts;
        std::memcpy(dst + (to_panels ? by_panel : by_row), src + (to_panels ? by_row : by_panel), ts);
      }
  }
}

// Rows `ids` of a weight in the lane layout (panels interleaved), each row's blocks in order.
inline void panel_rows(const uint8_t* src, int64_t N, int64_t row_bytes, int64_t ts, const int64_t* ids, int64_t n,
                       uint8_t* dst) {
  const int64_t nb = row_bytes / ts;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = ids[i], p = r / NP, j = r % NP, nn = std::min<int64_t>(NP, N - NP * p);
    for (int64_t c = 0; c < nb; ++c) std::memcpy(dst + i * row_bytes + c * ts, src + NP * p * row_bytes + (c * nn + j) * ts, ts);
  }
}

// ---------------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------------

constexpr int TT_MAX = 8;  // input rows per register tile
constexpr int TB = 64;     // input rows per accumulator block
constexpr int64_t PF_L1_MAX = 1152;  // bytes per panel step up to which decode prefetches into L1
constexpr int64_t PF_L1_PANEL = 16384;  // ... and bytes per panel (a longer one is evicted before use)
using Tuning = qd_abi::Tuning;

// Weight rows per tile of TT input rows: TT * NN int32 accumulators stay in registers.
// AVX2 (16 vector registers): measured best. AVX-512 VNNI (32 registers): 8 rows x 2 weight rows
// with one accumulator chain each (ONE_CHAIN below), so every activation vector loaded serves two
// weight rows.
template <class F>
constexpr int nn_for(int tt) {
#ifdef QD_VNNI
  return tt == 1 ? 4 : (tt <= 4 || F::LATENCY_SPLIT) ? 2 : 1;
#else
  return tt == 1 ? 4 : tt <= 4 ? 2 : 1;
#endif
}

// acc[i][j] (8 floats at acc + i*ldacc + j*8) += rows i of x (chunks x[i]) . weight rows j (blocks
// at b[j]), over nblk blocks of the current chunk.
template <class F, int TT, int NN>
QD_INLINE void tile(const XChunk* x, const uint8_t* const* b, int64_t nblk, float* acc, bool first, int ldacc = NP * 8) {
  // A format whose two accumulators only shorten the dependency chains (LATENCY_SPLIT: the finish
  // adds them first) uses one where the tile has enough independent chains anyway.
  constexpr bool ONE_CHAIN = F::LATENCY_SPLIT && TT * NN >= 8;
  constexpr int NA = ONE_CHAIN ? 1 : F::NACC;
  // AVX2: where the sums of maddubs pairs over all the vectors an accumulator takes in a block fit
  // int16 (PAIR_MAX bounds one pair: Q4_K / Q4_0 / Q4_1 weights <= 15 give 8 x 3810 = 30480), they
  // are added as int16 and widened once per block (madd(1)): one multiply-port step per vector
  // instead of two. Integer sums are exact, so the int32 lanes (and everything after) are the same.
#ifdef QD_VNNI
  constexpr bool I16 = false;
#else
  constexpr bool I16 = F::PAIR_MAX * (8 / NA) <= 32767;
#endif
  // AVX2, where the sums of a whole block's vectors do not fit int16 but those of two do (Q6_K:
  // 2 x 16002 = 32004; the Q5 formats where one chain takes all 8 vectors): a segment's two
  // vectors' maddubs are added as int16 and widened once (maddubs, maddubs, add, madd, add: 2.5
  // steps per vector, not 3). Measured on Zen 4's AVX2 build, the 1.5B's linears in process,
  // alternating: Q6_K 1.05x at 4 rows, 1.09-1.14x at 8, 1.10-1.13x at 16; Q5_K 1.08-1.18x at 4-16
  // rows; 2 rows the same. One row keeps the plain step (its register tile would spill).
#ifdef QD_VNNI
  constexpr bool I16_PAIR = false;
#else
  constexpr bool I16_PAIR = TT >= 2 && !I16 && !F::SIGNED && !F::ABS_X && 2 * F::PAIR_MAX <= 32767;
#endif
  // Several weight rows against several input rows: each activation vector is loaded once for
  // all NN weight rows, where the accumulators, weight vectors and x fit the vector registers
  // (measured: AVX2 Q6_K at 4 rows 17% slower when they do not).
  constexpr bool XREUSE = TT >= 4 && NN > 1 && TT * NN * NA + 2 * NN + 2 <= QD_NREGS;
  const uint8_t* p[NN];
  QD_UNROLL
  for (int j = 0; j < NN; ++j) p[j] = b[j];
  for (int64_t blk = 0; blk < nblk; ++blk) {
    typename F::Pre pre[NN];
    QD_UNROLL
    for (int j = 0; j < NN; ++j) F::prepare(p[j], pre[j]);
    __m256i ia[TT][NN][NA];
    QD_UNROLL
    for (int i = 0; i < TT; ++i)
      QD_UNROLL
      for (int j = 0; j < NN; ++j)
        QD_UNROLL
        for (int a = 0; a < NA; ++a) ia[i][j][a] = _mm256_setzero_si256();
    // ia[i][j][.] += |w| . (x row i, signed like w), for vector v of weight row j
    auto dot = [&](int i, int j, int v, __m256i wu, __m256i xs) __attribute__((always_inline)) {
      __m256i& acc_r = ia[i][j][ONE_CHAIN ? 0 : F::acc_of(v)];
#ifdef QD_VNNI
      acc_r = _mm256_dpbusd_epi32(acc_r, wu, xs);  // = maddubs + madd(1) + add, in one step
#else
      if constexpr (I16)
        acc_r = _mm256_add_epi16(acc_r, _mm256_maddubs_epi16(wu, xs));
      else
        acc_r = _mm256_add_epi32(acc_r, _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), _mm256_set1_epi16(1)));
#endif
      // keeps GCC from reassociating the (exact, so reorderable) integer sums into trees of
      // products computed far ahead and spilled to the stack
      __asm__("" : QD_ACC_REG(acc_r));
    };
    auto load_x = [&](int i, int v) __attribute__((always_inline)) {
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(x[i].q + 32 * v));
    };
    auto load_xa = [&](int i, int v) __attribute__((always_inline)) {  // |x| (ABS_X formats)
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(x[i].qa + 32 * v));
    };
    // w[j][h]: vector 2s + h of weight row j (the segment's weight vectors of all NN rows)
    auto seg_vectors = [&](int s, __m256i (&w)[NN][2]) __attribute__((always_inline)) {
      QD_UNROLL
      for (int j = 0; j < NN; ++j)
        F::seg(s, p[j], pre[j], [&](int v, __m256i wv) __attribute__((always_inline)) { w[j][v - 2 * s] = wv; });
    };
    QD_UNROLL
    for (int s = 0; s < F::NSEG; ++s) {
      if constexpr (I16_PAIR) {  // a segment's two vectors: one int16 add, one widening
        // (a LATENCY_SPLIT format's finish adds its two accumulators first: either may take both)
        static_assert(ONE_CHAIN || F::LATENCY_SPLIT ||
                          (F::acc_of(0) == F::acc_of(1) && F::acc_of(2) == F::acc_of(3) && F::acc_of(4) == F::acc_of(5) &&
                           F::acc_of(6) == F::acc_of(7)),
                      "a segment's two vectors go to one accumulator");
        __m256i w[NN][2];
        seg_vectors(s, w);
        QD_UNROLL
        for (int i = 0; i < TT; ++i) {
          const __m256i x0 = load_x(i, 2 * s), x1 = load_x(i, 2 * s + 1);
          QD_UNROLL
          for (int j = 0; j < NN; ++j) {
            __m256i& acc_r = ia[i][j][ONE_CHAIN ? 0 : F::acc_of(2 * s)];
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(w[j][0], x0), _mm256_maddubs_epi16(w[j][1], x1));
            acc_r = _mm256_add_epi32(acc_r, _mm256_madd_epi16(pair, _mm256_set1_epi16(1)));
            __asm__("" : QD_ACC_REG(acc_r));
          }
        }
      } else if constexpr (XREUSE) {  // the segment's weight vectors of all NN rows, then each x vector once
        __m256i w[NN][2];
        seg_vectors(s, w);
        QD_UNROLL
        for (int h = 0; h < 2; ++h) {
          __m256i wu[NN];
          QD_UNROLL
          for (int j = 0; j < NN; ++j) wu[j] = F::SIGNED && !F::ABS_X ? _mm256_sign_epi8(w[j][h], w[j][h]) : w[j][h];  // |w|
          QD_UNROLL
          for (int i = 0; i < TT; ++i) {
            __m256i xv = load_x(i, 2 * s + h);
            __asm__("" : QD_ACC_REG(xv));  // in a register: GCC would fold the load into each dot again
            if constexpr (F::ABS_X) {
              __m256i xa = load_xa(i, 2 * s + h);
              __asm__("" : QD_ACC_REG(xa));
              QD_UNROLL
              for (int j = 0; j < NN; ++j) dot(i, j, 2 * s + h, xa, _mm256_sign_epi8(wu[j], xv));
            } else {
              QD_UNROLL
              for (int j = 0; j < NN; ++j) dot(i, j, 2 * s + h, wu[j], F::SIGNED ? _mm256_sign_epi8(xv, w[j][h]) : xv);
            }
          }
        }
      } else {  // weight row by weight row (fewer live registers)
        QD_UNROLL
        for (int j = 0; j < NN; ++j) {
          F::seg(s, p[j], pre[j], [&](int v, __m256i w) __attribute__((always_inline)) {
            if constexpr (F::ABS_X) {  // |x| . sign(w, x): w is never -128
              QD_UNROLL
              for (int i = 0; i < TT; ++i) dot(i, j, v, load_xa(i, v), _mm256_sign_epi8(w, load_x(i, v)));
            } else {
              const __m256i wu = F::SIGNED ? _mm256_sign_epi8(w, w) : w;  // |w| (|-128| = 128 unsigned)
              QD_UNROLL
              for (int i = 0; i < TT; ++i) {
                const __m256i xv = load_x(i, v);
                dot(i, j, v, wu, F::SIGNED ? _mm256_sign_epi8(xv, w) : xv);
              }
            }
          });
        }
      }
    }
    if constexpr (I16) {  // int16 pair sums -> the int32 lanes
      QD_UNROLL
      for (int i = 0; i < TT; ++i)
        QD_UNROLL
        for (int j = 0; j < NN; ++j)
          QD_UNROLL
          for (int a = 0; a < NA; ++a) ia[i][j][a] = _mm256_madd_epi16(ia[i][j][a], _mm256_set1_epi16(1));
    }
    QD_UNROLL
    for (int i = 0; i < TT; ++i)
      QD_UNROLL
      for (int j = 0; j < NN; ++j) {
        float* out = acc + i * ldacc + j * 8;
        const float* in = first && blk == 0 ? ZERO8 : out;  // a panel's first chunk starts from 0
        if constexpr (ONE_CHAIN) {
          const __m256i two[2] = {ia[i][j][0], _mm256_setzero_si256()};
          F::finish(two, pre[j], x[i], blk, in, out);
        } else {
          F::finish(ia[i][j], pre[j], x[i], blk, in, out);
        }
      }
    QD_UNROLL
    for (int j = 0; j < NN; ++j) p[j] += F::TS;
  }
}

template <class F, int TT, int NN = nn_for<F>(TT)>
__attribute__((noinline)) void tile_panel(const XChunk* x, const uint8_t* const* b, int64_t nblk, float* acc,
                                          bool first) {
  static_assert(NP % NN == 0, "NN must divide NP");
  for (int j = 0; j < NP; j += NN) tile<F, TT, NN>(x, b + j, nblk, acc + j * 8, first);
  // GCC 12 (-O1 and up) wrongly summarizes some instances (32-blocks, TT <= 2) as writing no
  // memory and drops their calls; a memory clobber keeps its interprocedural analysis honest.
  __asm__ volatile("" ::: "memory");
}

// One input row against a whole panel, chunk after chunk (Tuning::chain): the NP rows' partial
// sums stay in a local array (registers, where they fit) from the first chunk to the last instead
// of going through acc at every chunk, and the loop runs once per panel instead of once per
// chunk. Per chunk the same tiles in the same order as the chunk-by-chunk path (rows_panel), each
// (row, output) summing its blocks in order from zero: the same bits. Block k of weight row j is at
// b[j] + k * bstride, the row's chunk k at x[k]; pf .. pf_end: the bytes to prefetch (l1: into L1,
// else L2), spread evenly over the chunks as the chunk-by-chunk path spreads them.
template <class F, int NN>
__attribute__((noinline)) void row_panel_chain(const XChunk* x, const uint8_t* const* b, int64_t nchunks,
                                               int64_t bstride, float* acc, const uint8_t* pf,
                                               const uint8_t* pf_end, bool l1) {
  static_assert(NP % NN == 0 && F::BS == CHUNK, "NN must divide NP; a chunk is one block per row");
  const int64_t slice = ((pf_end - pf + nchunks - 1) / nchunks + 63) / 64 * 64;
  alignas(32) float sums[NP][8] = {};
  const uint8_t* q[NP];
  for (int j = 0; j < NP; ++j) q[j] = b[j];
  for (int64_t k = 0; k < nchunks; ++k) {
    if (pf < pf_end) {
      prefetch_lines(pf, std::min(pf + slice, pf_end), l1);
      pf += slice;
    }
    QD_UNROLL
    for (int j = 0; j < NP; j += NN) tile<F, 1, NN>(x + k, q + j, 1, &sums[j][0], false, 8);
    QD_UNROLL
    for (int j = 0; j < NP; ++j) q[j] += bstride;
  }
  for (int j = 0; j < NP; ++j) _mm256_store_ps(acc + j * 8, _mm256_load_ps(sums[j]));
  __asm__ volatile("" ::: "memory");  // (see tile_panel)
}

// Calls fn(std::integral_constant<int, NN>) for tile1 (Tuning::tile1: 2, 4 or 8 weight rows per
// one-row register tile; 0: the build's default). The tile shape changes which registers hold which
// sums, never a sum: the integer dot products are exact and each (row, output) keeps its one float
// sequence.
template <class F, class Fn>
QD_INLINE void with_tile1(int tile1, Fn&& fn) {
  switch (tile1) {
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    default: fn(std::integral_constant<int, nn_for<F>(1)>{}); break;  // (4 on both builds)
  }
}

// tb input rows (consecutive chunks from x) against the panel; first: acc is not yet written
// (the panel's first chunk: the tiles start from zero instead of reading acc).
template <class F>
void rows_panel(const XChunk* x, const uint8_t* const* b, int64_t nblk, float* acc, int tb, bool first, int tile1) {
  int t = 0;
  for (; t + TT_MAX <= tb; t += TT_MAX) tile_panel<F, TT_MAX>(x + t, b, nblk, acc + t * NP * 8, first);
  switch (tb - t) {
    case 0: break;
    case 1:
      with_tile1<F>(tile1, [&](auto nn) { tile_panel<F, 1, decltype(nn)::value>(x + t, b, nblk, acc + t * NP * 8, first); });
      break;
    case 2: tile_panel<F, 2>(x + t, b, nblk, acc + t * NP * 8, first); break;
    case 3: tile_panel<F, 3>(x + t, b, nblk, acc + t * NP * 8, first); break;
    case 4: tile_panel<F, 4>(x + t, b, nblk, acc + t * NP * 8, first); break;
    case 5: tile_panel<F, 5>(x + t, b, nblk, acc + t * NP * 8, first); break;
    case 6: tile_panel<F, 6>(x + t, b, nblk, acc + t * NP * 8, first); break;
    case 7: tile_panel<F, 7>(x + t, b, nblk, acc + t * NP * 8, first); break;
    default: break;
  }
}

using Job = qd_abi::Job;

// Stores input row t's 8 panel outputs (acc ar) of job g's panel starting at output n0 (nn of them),
// with the job's bias and residual where it has them.
QD_INLINE void store_job_row(const Job& g, const float* ar, int64_t t, int64_t n0, int nn) {
  store_panel_row(ar, g.y + t * g.N + n0, nn, g.bias ? g.bias + n0 : nullptr,
                  g.residual ? g.residual + t * g.N + n0 : nullptr);
}

// Panel p (output rows 8p .. 8p+7) of job g for all T rows; xq: the activations quantized for the
// job's mode, chunk-major ([K/256][T] chunks). Prefetches the job's panel pf_p (none if < 0) as it
// goes. The panel's blocks are interleaved (PANELS above): one sequential stream of weight bytes.
template <class F>
void panel(const Job& g, const XChunk* xq, int64_t T, int64_t p, int64_t pf_p, const Tuning& tune, float* acc) {
  const int64_t n0 = p * NP;
  const int nn = static_cast<int>(std::min<int64_t>(NP, g.N - n0));
  const uint8_t* base = g.W + n0 * g.row_bytes;
  // prefetch 3 (the default): into L1 for 1-2 rows of a format with small steps (Q4_K, Q4_0: 1152
  // bytes), else into L2 (measured on Zen 4: Q4_K 4 rows 15% faster, 1 row 8% slower with L2; Q8_0 /
  // Q6_K 1 row ~2x / 10% slower with L1: their larger steps evict the panel being read). A panel
  // longer than PF_L1_PANEL (the 1.5B's Q4_K ffn_down, K = 8960: 40 KB) goes to L2 too: prefetched a
  // whole panel ahead it would leave L1 before use (21-26% faster there).
  const bool pf = pf_p >= 0 && tune.prefetch != 0;
  const bool l1 = tune.prefetch == 1 ||
                  (tune.prefetch == 3 && T <= 2 && g.pf_step <= PF_L1_MAX && NP * g.row_bytes <= PF_L1_PANEL);
  const uint8_t* pf_panel = g.W + pf_p * NP * g.row_bytes;  // (read only where pf)
  const uint8_t* pf_end = g.W + std::min<int64_t>(g.N, (pf_p + 1) * NP) * g.row_bytes;
  if (T == 1 && tune.chain && F::MODE == KL) {  // (the 32-block formats ran slower chained: Q8_0 0.76x)
    const uint8_t* b[NP];  // rows past N repeat the last one; their results are dropped
    for (int j = 0; j < NP; ++j) b[j] = base + std::min(j, nn - 1) * F::TS;
    with_tile1<F>(tune.tile1, [&](auto nt) {
      row_panel_chain<F, decltype(nt)::value>(xq, b, (g.K + CHUNK - 1) / CHUNK, nn * F::TS, acc,
                                              pf ? pf_panel : nullptr, pf ? pf_end : nullptr, l1);
    });
    store_job_row(g, acc, 0, n0, nn);
    return;
  }
  for (int64_t t0 = 0; t0 < T; t0 += TB) {
    const int tb = static_cast<int>(std::min<int64_t>(TB, T - t0));
    for (int64_t c0 = 0; c0 < g.K; c0 += CHUNK) {
      if (t0 == 0 && pf) {
        const uint8_t* q = pf_panel + c0 / CHUNK * g.pf_step;
        prefetch_lines(q, std::min(q + g.pf_step, pf_end), l1);
      }
      const int64_t nblk = 1;  // one (super-)block of 256 per row and step (a partial last one padded)
      const uint8_t* b[NP];  // rows past N repeat the last one; their results are dropped
      for (int j = 0; j < NP; ++j) b[j] = base + (c0 / F::BS * nn + std::min(j, nn - 1)) * F::TS;
      rows_panel<F>(xq + c0 / CHUNK * T + t0, b, nblk, acc, tb, c0 == 0, tune.tile1);
    }
    for (int t = 0; t < tb; ++t) store_job_row(g, acc + t * NP * 8, t0 + t, n0, nn);
  }
}

// GGML type ids (gguf.GGMLQuantizationType)
enum : int64_t {
  T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
  T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_MXFP4 = 39
};
// The lane layouts' ids (not GGML types): the GGML id + LANES_ID.
constexpr int64_t LANES_ID = 1000;

// Calls fn(F{}) for the q8 format struct of a GGML type id; false if unsupported.
template <class Fn>
bool dispatch(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case T_Q4_0 + LANES_ID: fn(Q4_0L{}); return true;
    case T_Q4_1 + LANES_ID: fn(Q4_1L{}); return true;
    case T_Q5_0 + LANES_ID: fn(Q5_0L{}); return true;
    case T_Q5_1 + LANES_ID: fn(Q5_1L{}); return true;
    case T_Q8_0 + LANES_ID: fn(Q8_0L{}); return true;
    case T_IQ4_NL + LANES_ID: fn(IQ4_NLL{}); return true;
    case T_MXFP4 + LANES_ID: fn(MXFP4L{}); return true;
    case T_Q2_K + LANES_ID: fn(Q2_KL{}); return true;
    case T_Q3_K + LANES_ID: fn(Q3_KL{}); return true;
    case T_Q4_K + LANES_ID: fn(Q4_KL{}); return true;
    case T_Q5_K + LANES_ID: fn(Q5_KL{}); return true;
    case T_Q6_K + LANES_ID: fn(Q6_KL{}); return true;
    case T_IQ4_XS + LANES_ID: fn(IQ4_XSL{}); return true;
    default: return false;
  }
}

// Fills the job's derived fields; false if the type is unsupported.
inline bool init_job(Job& g) {
  return dispatch(g.qtype, [&](auto f) {
    using F = decltype(f);
    g.row_bytes = (g.K + F::BS - 1) / F::BS * F::TS;  // lanes: a partial last super-block padded
    g.npanels = (g.N + NP - 1) / NP;
    const int64_t nchunks = (g.K + CHUNK - 1) / CHUNK;
    g.pf_step = (NP * g.row_bytes / nchunks + 63) / 64 * 64;
    g.mode = F::MODE;
  });
}

// Thread-kept buffer for the quantized activations of short calls (long prefills: per call).
constexpr int64_t XQ_KEEP = int64_t{8} << 20;  // bytes

// x: [R, K] fp32 rows in ngroups groups, group g the rows gstart[g] .. gstart[g + 1] - 1, read by the
// jobs whose xgroup is g (each with in_features K; one group: every job shares x; groups may differ
// in size, e.g. the rows each routed expert takes). Quantizes each row once per mode the jobs need
// (a row is quantized alone: the same bits as a call of its own), then computes every job's panels
// over its group's rows (as a call of its own would), all in one parallel region.
inline void gemm_multi(const float* x, const int64_t* gstart, int64_t ngroups, int64_t K, Job* jobs, int njobs,
                       int nthreads, const Tuning& tune) {
  const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
  const int64_t R = gstart[ngroups];
  std::vector<int64_t> group_of;  // each row's group, where there are several (one: every row's is 0)
  if (ngroups > 1) {
    group_of.resize(R);
    for (int64_t g = 0; g < ngroups; ++g)
      for (int64_t r = gstart[g]; r < gstart[g + 1]; ++r) group_of[r] = g;
  }
  bool need[NMODES] = {};
  int64_t panels = 0;
  for (int i = 0; i < njobs; ++i) {
    need[jobs[i].mode] = true;
    panels += jobs[i].npanels;
  }
  // xq[m]: mode m's chunks, group by group, each group chunk-major (chunk c of its row t at c * T_g + t)
  const int64_t per_mode = nchunks * R;
  int modes[NMODES], nmodes = 0;  // the modes needed, in order
  for (int m = 0; m < NMODES; ++m)
    if (need[m]) modes[nmodes++] = m;
  const int64_t bytes = nmodes * per_mode * static_cast<int64_t>(sizeof(XChunk)) + 64;
  static thread_local std::vector<uint8_t> keep;
  std::vector<uint8_t> once;
  std::vector<uint8_t>& buf = bytes <= XQ_KEEP ? keep : once;
  if (static_cast<int64_t>(buf.size()) < bytes) buf.resize(bytes);
  XChunk* base = reinterpret_cast<XChunk*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) / 64 * 64);
  XChunk* xq[NMODES] = {};
  for (int k = 0; k < nmodes; ++k) xq[modes[k]] = base + k * per_mode;
  // Work: the panels of all jobs in order (job i's panel p is number first[i] + p), cut into
  // tune.runs contiguous ranges per thread. A thread takes its own ranges' panels from the front,
  // a few at a time (one sequential stream of weights; each panel prefetches the one tune.ahead
  // further on), then helps where the most is left, taking that range's panels from its back
  // (prefetching backwards): the threads finish within a panel of each other, however unevenly
  // the machine runs them. (Items of whole runs handed out dynamically left a thread waiting for up
  // to a run at every call: on Zen 4 the main thread spent 12% of a decode step at the barrier, 1.5%
  // now; the 1.5B Q4_K_M's decode step 1.06-1.12x faster, 8 and 64 rows and Q8_0 the same.)
  // A range's first panel starts cold (its prefetch chain begins there): on Zen 4, with 8 runs per
  // thread the 1.5B's linears took 13% longer at 1 row. Which thread computes a panel never
  // changes its arithmetic.
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, panels)));
  const int64_t nranges = std::min<int64_t>(panels, int64_t{nt} * std::max(1, tune.runs));
  std::vector<int64_t> first(njobs + 1, 0);
  for (int i = 0; i < njobs; ++i) first[i + 1] = first[i] + jobs[i].npanels;
  struct alignas(64) Left {  // a range's next panel from the front << 32 | the end of what is left (own line)
    std::atomic<uint64_t> w;
  };
  std::vector<Left> left(nranges);
  for (int64_t r = 0; r < nranges; ++r) {
    const uint64_t lo = panels * r / nranges, hi = panels * (r + 1) / nranges;
    left[r].w.store(lo << 32 | hi, std::memory_order_relaxed);
  }
  // takes range r's next GRAB panels from the front (fewer where fewer are left) or its last one
  // (!front) into q .. q + n - 1; false if none is left
  constexpr uint64_t GRAB = 4;  // per atomic step (a panel alone is ~0.2 us of a decode step's work)
  auto take = [&](int64_t r, bool front, int64_t& q, int64_t& n) {
    uint64_t w = left[r].w.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t fr = w >> 32, bk = w & 0xffffffffu;
      if (fr >= bk) return false;
      const uint64_t k = front ? std::min(GRAB, bk - fr) : 1;
      if (left[r].w.compare_exchange_weak(w, front ? (fr + k) << 32 | bk : fr << 32 | (bk - 1),
                                          std::memory_order_relaxed)) {
        q = static_cast<int64_t>(front ? fr : bk - 1);
        n = static_cast<int64_t>(k);
        return true;
      }
    }
  };
  const int64_t nq = nmodes * per_mode;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nq; ++it) {
      const int mode = modes[it / per_mode];
      const int64_t rc = it % per_mode, r = rc / nchunks, c = rc % nchunks;  // row r's chunk c
      const int64_t grp = ngroups > 1 ? group_of[r] : 0, tg = gstart[grp + 1] - gstart[grp], t = r - gstart[grp];
      const int64_t at = nchunks * gstart[grp] + c * tg + t;
      const int n = static_cast<int>(std::min<int64_t>(CHUNK, K - c * CHUNK));
      const float* xr = x + r * K + c * CHUNK;
      if (mode == KL)
        quantize_chunk<KL>(xr, n, xq[KL][at]);
      else
        quantize_chunk<B32>(xr, n, xq[B32][at]);
    }
    alignas(64) float acc[TB * NP * 8];
    // panels q .. q + n - 1 in order (forwards) or panel q (backwards), each prefetching the panel
    // tune.ahead further on in its job where that is before hi (forwards) or the one as far back
    auto compute = [&](int64_t q, int64_t n, bool forwards, int64_t hi) {
      int i = static_cast<int>(std::upper_bound(first.begin(), first.end(), q) - first.begin()) - 1;
      for (const int64_t e = q + n; q < e; ++q) {
        while (q >= first[i + 1]) ++i;
        const Job& g = jobs[i];
        const int64_t qf = forwards ? q + tune.ahead : q - tune.ahead;
        const int64_t pf = qf >= first[i] && qf < std::min(hi, first[i + 1]) ? qf - first[i] : -1;
        const int64_t g0 = gstart[g.xgroup], tg = gstart[g.xgroup + 1] - g0;
        dispatch(g.qtype, [&](auto f) {
          panel<decltype(f)>(g, xq[g.mode] + nchunks * g0, tg, q - first[i], pf, tune, acc);
        });
      }
    };
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    int64_t q = 0, n = 0;
    for (int64_t r = nranges * me / team; r < nranges * (me + 1) / team; ++r)
      while (take(r, true, q, n)) compute(q, n, true, panels * (r + 1) / nranges);  // (the range's end)
    for (;;) {  // then the back of the range with the most left
      int64_t most = 0, r = -1;
      for (int64_t k = 0; k < nranges; ++k) {
        const uint64_t w = left[k].w.load(std::memory_order_relaxed);
        const int64_t m = static_cast<int64_t>(w & 0xffffffffu) - static_cast<int64_t>(w >> 32);
        if (m > most) most = m, r = k;
      }
      if (r < 0) break;
      while (take(r, false, q, n)) compute(q, n, false, panels);
    }
  }
}

// The tiles' integer dot step alone, as fast as this build runs it: int8 products per second of
// nthreads threads (independent accumulators, no loads: the instruction's throughput). Enough
// chains to hide the latency: measured on Zen 4, one core, dpbusd 99 G/s with 12 chains and 116
// with 16 to 28; the AVX2 step 112-116 with 12 (16 registers: more would spill).
// VNNI: dpbusd; AVX2: maddubs + an int16 add (the cheapest step of the AVX2 tiles, where int16
// pair sums fit). No GEMM can multiply its weights by its rows faster than this: a pass of T rows
// takes at least T x (weights) / rate (the compute roofline beside the memory one).
inline double dot_rate(int nthreads) {
  constexpr int NACC = QD_NREGS == 32 ? 16 : 12;
  constexpr int64_t ITERS = int64_t{1} << 21;  // x NACC steps x 32 products per thread: ~8-10 ms at 3 GHz
  double best = 0.0;
  int64_t keep = 0;
  for (int rep = 0; rep < 3; ++rep) {
    int64_t sink = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nthreads) reduction(+ : sink)
    {
      __m256i acc[NACC];
      for (int a = 0; a < NACC; ++a) acc[a] = _mm256_set1_epi32(a);
      __m256i w = _mm256_set1_epi8(static_cast<char>(3 + omp_get_thread_num())), xv = _mm256_set1_epi8(5);
      __asm__("" : QD_ACC_REG(w), QD_ACC_REG(xv));  // unknown values: nothing folds
      for (int64_t it = 0; it < ITERS; ++it) {
        QD_UNROLL
        for (int a = 0; a < NACC; ++a) {
#ifdef QD_VNNI
          acc[a] = _mm256_dpbusd_epi32(acc[a], w, xv);
#else
          acc[a] = _mm256_add_epi16(acc[a], _mm256_maddubs_epi16(w, xv));
#endif
          __asm__("" : QD_ACC_REG(acc[a]));
        }
      }
      for (int a = 0; a < NACC; ++a) sink += _mm256_extract_epi32(acc[a], 0);
    }
    const double dt = omp_get_wtime() - t0;
    best = std::max(best, static_cast<double>(nthreads) * ITERS * NACC * 32 / dt);
    keep += sink;
  }
  return keep == -1 ? 0.0 : best;  // (keep: the sums are used)
}

// Quantizes x [T, K] in the given mode into chunks ([K/256][T], chunk-major); for tests.
inline void quantize_rows(const float* x, int64_t T, int64_t K, int mode, XChunk* out) {
  const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
  for (int64_t ct = 0; ct < nchunks * T; ++ct) {
    const int64_t c0 = ct / T * CHUNK, t = ct % T;
    const int n = static_cast<int>(std::min<int64_t>(CHUNK, K - c0));
    if (mode == KL)
      quantize_chunk<KL>(x + t * K + c0, n, out[ct]);
    else
      quantize_chunk<B32>(x + t * K + c0, n, out[ct]);
  }
}

}  // namespace q8
}  // namespace QD_NS
