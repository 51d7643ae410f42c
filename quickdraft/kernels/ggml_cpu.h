// GGML block formats and the batch-invariant quantized GEMM (AVX2 + FMA + F16C, OpenMP).
//
// Plain C++ without torch: ggml_cpu.cpp binds it to Python. The design is described there.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#define QD_INLINE inline __attribute__((always_inline))
#define QD_UNROLL _Pragma("GCC unroll 16")

// The namespace of everything below. ggml_q8_avx512.cpp compiles the q8 GEMM a second time for
// AVX-512 VNNI under another name, so no inline function of one build can stand in for the other's.
#ifndef QD_NS
#define QD_NS qd
#endif

namespace QD_NS {

constexpr int64_t CHUNK = 256;  // K elements per panel step (one K-quant super-block, eight 32-blocks)
constexpr int NP = 8;           // output rows per panel (a thread computes whole panels)
constexpr int TB = 64;          // input rows per accumulator block (longer inputs: several blocks)
constexpr int TT_MAX = 8;       // input rows per register tile of the fused path
constexpr int SCRATCH_MIN_T = 9;  // from this many input rows on, dequantize each chunk once to L1
constexpr int64_t XBUF_KEEP = int64_t{4} << 20;  // floats of packed x kept between calls (16 MiB)

QD_INLINE float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 bytes at p -> 8 int32 lanes (zero / sign extended).
QD_INLINE __m256i load_u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
QD_INLINE __m256i load_i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
QD_INLINE __m256i load_256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Broadcast *p. The asm keeps the compiler from hoisting broadcasts out of unrolled loops into
// registers it then spills (spilling accumulators on the way): reloading from L1 is cheaper.
QD_INLINE __m256 bcast(const float* p) {
  __m256 r;
  __asm__ volatile("vbroadcastss %1, %0" : "=x"(r) : "m"(*p));
  return r;
}

// Signed bytes 8p..8p+7 of q (p = 0..3) -> 8 floats.
template <int P>
QD_INLINE __m256 i8_piece(__m256i q) {
  __m128i h = P < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
  if (P % 2) h = _mm_srli_si128(h, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
}

// ---------------------------------------------------------------------------------------------
// Block formats
//
// A block is dequantized to fp32 in NSEG segments: F::prepare(block, pre) decodes the block's
// scales once, then F::seg(s, block, pre, put) for s = 0 .. NSEG-1 calls put(v, w) with w the
// elements 8v .. 8v+7, for the segment's vectors v in a fixed order (e.g. lo then hi nibbles of
// the same bytes); F::ORDER lists that order for the whole block (checked when the module loads).
// Kernels interleave the segments of several rows, so each row's chain of dependent FMAs is
// short and the scales of a segment stay in registers.
// Values are bit-exact to gguf.quants.dequantize: same formula and rounding (each fused
// multiply-add used has an exactly representable product, so it rounds like the reference's
// multiply then add).
// ---------------------------------------------------------------------------------------------

struct Q4_0 {  // d: f16, qs[16]: element j = lo nibble of qs[j], element 16+j = hi nibble; w = d*(q-8)
  static constexpr int64_t BS = 32, TS = 18;
  static constexpr int NSEG = 1;
  static constexpr int8_t ORDER[4] = {0, 2, 1, 3};
  struct Pre {};
  static QD_INLINE void prepare(const uint8_t*, Pre&) {}
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m256i mask = _mm256_set1_epi32(0x0F), off = _mm256_set1_epi32(8);
    const __m256 d = _mm256_set1_ps(fp16(b));
    QD_UNROLL
    for (int j = 0; j < 2; ++j) {
      const __m256i q = load_u8x8(b + 2 + 8 * j);
      put(j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, mask), off))));
      put(j + 2, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), off))));
    }
  }
};

struct Q4_1 {  // d, m: f16, qs[16] as Q4_0; w = d*q + m  (d*q is exact, so one fma rounds the same)
  static constexpr int64_t BS = 32, TS = 20;
  static constexpr int NSEG = 1;
  static constexpr int8_t ORDER[4] = {0, 2, 1, 3};
  struct Pre {};
  static QD_INLINE void prepare(const uint8_t*, Pre&) {}
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256 d = _mm256_set1_ps(fp16(b)), m = _mm256_set1_ps(fp16(b + 2));
    QD_UNROLL
    for (int j = 0; j < 2; ++j) {
      const __m256i q = load_u8x8(b + 4 + 8 * j);
      put(j, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), m));
      put(j + 2, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m));
    }
  }
};

struct Q5_0 {  // d: f16, qh: u32 (bit j = 5th bit of element j), qs[16] as Q4_0; w = d*(q-16)
  static constexpr int64_t BS = 32, TS = 22;
  static constexpr int NSEG = 1;
  static constexpr int8_t ORDER[4] = {0, 1, 2, 3};
  struct Pre {};
  static QD_INLINE void prepare(const uint8_t*, Pre&) {}
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i b4 = _mm256_set1_epi8(0x10);
    const __m256 d = _mm256_set1_ps(fp16(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);  // byte j: qh byte j/8
    hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit), b4);      // 16 where bit j is set
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, hb), b4);  // q - 16, signed bytes, element order
    put(0, _mm256_mul_ps(d, i8_piece<0>(q)));
    put(1, _mm256_mul_ps(d, i8_piece<1>(q)));
    put(2, _mm256_mul_ps(d, i8_piece<2>(q)));
    put(3, _mm256_mul_ps(d, i8_piece<3>(q)));
  }
};

struct Q8_0 {  // d: f16, qs[32]: int8; w = q*d
  static constexpr int64_t BS = 32, TS = 34;
  static constexpr int NSEG = 1;
  static constexpr int8_t ORDER[4] = {0, 1, 2, 3};
  struct Pre {};
  static QD_INLINE void prepare(const uint8_t*, Pre&) {}
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    const __m256 d = _mm256_set1_ps(fp16(b));
    QD_UNROLL
    for (int v = 0; v < 4; ++v) put(v, _mm256_mul_ps(_mm256_cvtepi32_ps(load_i8x8(b + 2 + 8 * v)), d));
  }
};

// Q4_K / Q5_K's 8 6-bit scales and 8 mins (block bytes 4..15: u0, u1, u2 = scales, mins, both's
// j >= 4 low bits) as bytes sc_0..7 | m_0..7, with two byte shuffles: sc_j = u0_j & 63 (j < 4),
// u2_j & 15 | (u0_j >> 6) << 4 (j >= 4); m_j likewise from u1 and u2's high nibbles. (The 16-byte
// load ends inside the block.) kscale_min below is the same rule for one group.
QD_INLINE __m128i kscales_mins(const uint8_t* b) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  const __m128i a = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_and_si128(_mm_blend_epi32(a, _mm_srli_epi16(a, 4), 0b1000),  // m_4..7: u2's high nibbles
                                    _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  return _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
}

// Q4_K: super-block of 256 = 8 groups of 32. d, dmin: f16; scales[12]: 8 6-bit scales and mins;
// qs[128]: bytes 32s..32s+31 hold group 2s (lo nibbles) and group 2s+1 (hi nibbles).
// w = (d*sc)*q - dmin*m. d*sc (<= 17 significant bits) and (d*sc)*q (<= 21) are exact in fp32,
// so fmsub gives the reference's round(round(d*sc*q) - dmin*m). Segment s: groups 2s, 2s+1.
struct Q4_K {
  static constexpr int64_t BS = 256, TS = 144;
  static constexpr int NSEG = 4;
  static constexpr int8_t ORDER[32] = {0,  4,  1,  5,  2,  6,  3,  7,  8,  12, 9,  13, 10, 14, 11, 15,  //
                                       16, 20, 17, 21, 18, 22, 19, 23, 24, 28, 25, 29, 26, 30, 27, 31};
  struct Pre {
    alignas(32) float dm[16];  // d*sc[0..7], dmin*m[0..7]
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    const __m128i v = kscales_mins(b);
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    _mm256_store_ps(p.dm, _mm256_mul_ps(_mm256_set1_ps(fp16(b)), scf));
    _mm256_store_ps(p.dm + 8, _mm256_mul_ps(_mm256_set1_ps(fp16(b + 2)), mnf));
  }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre& p, P&& put) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const int g = 2 * s;
    const __m256 d1 = bcast(p.dm + g), m1 = bcast(p.dm + 8 + g), d2 = bcast(p.dm + g + 1), m2 = bcast(p.dm + 9 + g);
    QD_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load_u8x8(b + 16 + 32 * s + 8 * j);
      put(4 * g + j, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), d1, m1));
      put(4 * g + 4 + j, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d2, m2));
    }
  }
};

// Q6_K: super-block of 256 = 16 groups of 16. ql[128], qh[64], scales[16]: int8, d: f16.
// For half h (128 elements), l in 0..31, with L = ql + 64h, H = qh + 32h:
//   e[l]      = (L[l] & 15)      | ((H[l] >> 0) & 3) << 4
//   e[32 + l] = (L[32 + l] & 15) | ((H[l] >> 2) & 3) << 4
//   e[64 + l] = (L[l] >> 4)      | ((H[l] >> 4) & 3) << 4
//   e[96 + l] = (L[32 + l] >> 4) | ((H[l] >> 6) & 3) << 4
// w = (d*scale[e/16]) * (q - 32). The 6-bit values are assembled 32 at a time as bytes.
// Segment s: elements 64s .. 64s+63 (half h = s/2, quarters c = 2(s%2), 2(s%2)+1).
struct Q6_K {
  static constexpr int64_t BS = 256, TS = 210;
  static constexpr int NSEG = 4;
  static constexpr int8_t ORDER[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,  //
                                       16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
  struct Pre {
    alignas(32) float s[16];  // d*scale[0..15]
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) {
    const __m256 d = _mm256_set1_ps(fp16(b + 208));
    _mm256_store_ps(p.s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(load_i8x8(b + 192))));
    _mm256_store_ps(p.s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(load_i8x8(b + 200))));
  }
  template <class P>
  static QD_INLINE void seg(int s, const uint8_t* b, const Pre& p, P&& put) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    const int h = s / 2;
    const __m256i l0 = load_256(b + 64 * h), l1 = load_256(b + 64 * h + 32), hh = load_256(b + 128 + 32 * h);
    QD_UNROLL
    for (int cc = 0; cc < 2; ++cc) {
      const int c = 2 * (s % 2) + cc;  // elements 128h + 32c .. +31: groups 8h + 2c, 8h + 2c + 1
      // 16-bit shifts leak bits across the byte boundary only into bits the masks clear
      const __m256i l = c % 2 ? l1 : l0;
      const __m256i lo = c < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
      const __m256i hi = c == 0   ? _mm256_slli_epi16(hh, 4)
                         : c == 1 ? _mm256_slli_epi16(hh, 2)
                         : c == 2 ? hh
                                  : _mm256_srli_epi16(hh, 2);
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(hi, m2)), off);
      const int g = 8 * h + 2 * c, v = 16 * h + 4 * c;
      const __m256 s1 = bcast(p.s + g), s2 = bcast(p.s + g + 1);
      put(v, _mm256_mul_ps(s1, i8_piece<0>(q)));
      put(v + 1, _mm256_mul_ps(s1, i8_piece<1>(q)));
      put(v + 2, _mm256_mul_ps(s2, i8_piece<2>(q)));
      put(v + 3, _mm256_mul_ps(s2, i8_piece<3>(q)));
    }
  }
};

// F16 / BF16 matrices, read 32 values (one "block") at a time: w = the value, widened exactly.
struct F16 {
  static constexpr int64_t BS = 32, TS = 64;
  static constexpr int NSEG = 1;
  static constexpr int8_t ORDER[4] = {0, 1, 2, 3};
  struct Pre {};
  static QD_INLINE void prepare(const uint8_t*, Pre&) {}
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    QD_UNROLL
    for (int v = 0; v < 4; ++v)
      put(v, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * v))));
  }
};
struct BF16 {
  static constexpr int64_t BS = 32, TS = 64;
  static constexpr int NSEG = 1;
  static constexpr int8_t ORDER[4] = {0, 1, 2, 3};
  struct Pre {};
  static QD_INLINE void prepare(const uint8_t*, Pre&) {}
  template <class P>
  static QD_INLINE void seg(int, const uint8_t* b, const Pre&, P&& put) {
    QD_UNROLL
    for (int v = 0; v < 4; ++v) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * v)));
      put(v, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
  }
};

// Formats whose f32 path dequantizes a whole block with scalar code first (Q5_1, Q2_K, Q3_K, Q5_K,
// IQ4_NL, IQ4_XS: the q8 GEMM is their fast path; this one serves dequantize(), embeddings and the
// exact f32-activation mode). D::decode(block, w) is bit-exact to gguf.quants.dequantize: the same
// float32 operations in the same order (-ffp-contract=off keeps a*b-c two roundings).
template <class D>
struct Whole {
  static constexpr int64_t BS = D::BS, TS = D::TS;
  static constexpr int NSEG = 1;
  static constexpr std::array<int8_t, BS / 8> ORDER = [] {
    std::array<int8_t, BS / 8> o{};
    for (int i = 0; i < static_cast<int>(BS / 8); ++i) o[i] = static_cast<int8_t>(i);
    return o;
  }();
  struct Pre {
    alignas(32) float w[BS];
  };
  static QD_INLINE void prepare(const uint8_t* b, Pre& p) { D::decode(b, p.w); }
  template <class P>
  static QD_INLINE void seg(int, const uint8_t*, const Pre& p, P&& put) {
    QD_UNROLL
    for (int v = 0; v < BS / 8; ++v) put(v, _mm256_load_ps(p.w + 8 * v));
  }
};

constexpr int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K's 6-bit scale and min of 32-group j.
QD_INLINE void kscale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct Q5_1D {  // d, m: f16, qh: u32, qs[16]; w = d*q + m
  static constexpr int64_t BS = 32, TS = 24;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    const float d = fp16(b), m = fp16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int e = 0; e < 32; ++e) {
      const int q = ((b[8 + e % 16] >> (4 * (e / 16))) & 15) | (((qh >> e) & 1) << 4);
      w[e] = d * static_cast<float>(q) + m;
    }
  }
};
struct IQ4_NLD {  // d: f16, qs[16] (nibble indices); w = d * value
  static constexpr int64_t BS = 32, TS = 18;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    const float d = fp16(b);
    for (int e = 0; e < 32; ++e) w[e] = d * static_cast<float>(IQ4NL_VALUES[(b[2 + e % 16] >> (4 * (e / 16))) & 15]);
  }
};
struct MXFP4D {  // e: E8M0, qs[16] (nibble indices, IQ4_NL's order); w = 2^(e - 128) * kvalues_mxfp4
  static constexpr int64_t BS = 32, TS = 17;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    static constexpr int8_t VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : static_cast<uint32_t>(b[0] - 1) << 23;
    float d;
    std::memcpy(&d, &bits, 4);
    for (int e = 0; e < 32; ++e) w[e] = d * static_cast<float>(VALUES[(b[1 + e % 16] >> (4 * (e / 16))) & 15]);
  }
};
struct Q2_KD {  // scales[16] (low 4: scale, high 4: min), qs[64], d, dmin: w = d*sc*q - dmin*m per 16
  static constexpr int64_t BS = 256, TS = 84;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    const float d = fp16(b + 80), dmin = fp16(b + 82);
    for (int e = 0; e < 256; ++e) {
      const int sc = b[e / 16];
      const int q = (b[16 + 32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3;
      const float dl = d * static_cast<float>(sc & 15), ml = dmin * static_cast<float>(sc >> 4);
      w[e] = dl * static_cast<float>(q) - ml;
    }
  }
};
struct Q3_KD {  // hmask[32], qs[64], scales[12], d: w = d*(scale-32) * (low2 - 4 * !hbit) per 16
  static constexpr int64_t BS = 256, TS = 110;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    const float d = fp16(b + 108);
    const uint8_t* s = b + 96;
    for (int e = 0; e < 256; ++e) {
      const int i = e / 16;
      const int sc = (((s[i % 8] >> (4 * (i / 8))) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
      const int q = ((b[32 + 32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3) - 4 * (((b[e % 32] >> (e / 32)) & 1) ^ 1);
      w[e] = (d * static_cast<float>(sc)) * static_cast<float>(q);
    }
  }
};
struct Q5_KD {  // d, dmin, scales[12] (as Q4_K), qh[32], qs[128]: w = d*sc*q - dmin*m per 32
  static constexpr int64_t BS = 256, TS = 176;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      kscale_min(b + 4, g, sc, m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        const int q = ((b[48 + 32 * (g / 2) + l] >> (4 * (g % 2))) & 15) | (((b[16 + l] >> g) & 1) << 4);
        w[32 * g + l] = dl * static_cast<float>(q) - ml;
      }
    }
  }
};
struct IQ4_XSD {  // d, scales_h: u16, scales_l[4], qs[128]: w = d*(scale-32) * value per 32
  static constexpr int64_t BS = 256, TS = 136;
  static QD_INLINE void decode(const uint8_t* b, float* w) {
    const float d = fp16(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    for (int g = 0; g < 8; ++g) {
      const int sc = (((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((sh >> (2 * g)) & 3) << 4)) - 32;
      const float dl = d * static_cast<float>(sc);
      for (int l = 0; l < 32; ++l)
        w[32 * g + l] = dl * static_cast<float>(IQ4NL_VALUES[(b[8 + 16 * g + l % 16] >> (4 * (l / 16))) & 15]);
    }
  }
};
using Q5_1 = Whole<Q5_1D>;
using IQ4_NL = Whole<IQ4_NLD>;
using MXFP4 = Whole<MXFP4D>;
using Q2_K = Whole<Q2_KD>;
using Q3_K = Whole<Q3_KD>;
using Q5_K = Whole<Q5_KD>;
using IQ4_XS = Whole<IQ4_XSD>;

// ---------------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------------

// The horizontal sums of 8 vectors (ar + 8j, j = 0..7) at once, in one fixed order for every
// output: x_k + x_{k+4} (low + high half), then (s0 + s2) + (s1 + s3). 19 instructions instead of
// ~48 for 8 separate sums in the same order (the previous epilogue; bitwise the same results).
// Panels end with this reduction of every output; at 8 rows of K = 1536 it was ~4% of a pass.
QD_INLINE __m256 hsum8x8(const float* ar) {
  __m256 s[4];
  QD_UNROLL
  for (int j = 0; j < 4; ++j) {  // s[j]: x_k + x_{k+4} of output j (low lane) and output j + 4 (high)
    const __m256 a = _mm256_load_ps(ar + j * 8), b = _mm256_load_ps(ar + (j + 4) * 8);
    s[j] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // per lane: [s0 + s2, s1 + s3] of output j, then of output j + 1
  const __m256 r01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
  const __m256 r23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
  return _mm256_hadd_ps(r01, r23);  // outputs 0..3 (low lane), 4..7 (high lane)
}

// Stores the 8 outputs of one panel row (acc ar) at yr: the first nn of them, plus bias if any,
// added to res if any (a residual stream: res + (x . w + b), the one rounding torch's `res + y`
// makes after the product, so the same bits).
QD_INLINE void store_panel_row(const float* ar, float* yr, int nn, const float* bias, const float* res = nullptr) {
  __m256 v = hsum8x8(ar);
  if (nn == NP) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if (res) v = _mm256_add_ps(_mm256_loadu_ps(res), v);
    _mm256_storeu_ps(yr, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int j = 0; j < nn; ++j) {
    const float y = bias ? tmp[j] + bias[j] : tmp[j];
    yr[j] = res ? res[j] + y : y;
  }
}

// Weight rows per register tile of TT input rows (measured: enough independent accumulators to
// hide the FMA latency, few enough that none is spilled).
template <class F>
constexpr int nn_for(int tt) {
  return tt == 1 ? 4 : tt == 2 ? (F::BS == 32 ? 4 : 2) : tt <= 4 ? 2 : 1;  // short 32-blocks: more rows
}

// acc[i][j] (8 lanes, at acc + i*NP*8 + j*8) += x[i, :len] * w[j, :len] lane-wise for TT input
// rows (stride ldx) and NN weight rows (blocks at b[j]); len = nblk * F::BS.
template <class F, int TT, int NN>
QD_INLINE void tile(const float* x, int64_t ldx, const uint8_t* const* b, int64_t nblk, float* acc) {
  __m256 a[TT][NN];
  const float* xr[TT];  // row pointers, so x loads are [register + constant]
  QD_UNROLL
  for (int i = 0; i < TT; ++i) {
    xr[i] = x + i * ldx;
    QD_UNROLL
    for (int j = 0; j < NN; ++j) a[i][j] = _mm256_load_ps(acc + i * NP * 8 + j * 8);
  }
  const uint8_t* p[NN];
  QD_UNROLL
  for (int j = 0; j < NN; ++j) p[j] = b[j];
  for (int64_t blk = 0; blk < nblk; ++blk) {
    typename F::Pre pre[NN];
    QD_UNROLL
    for (int j = 0; j < NN; ++j) F::prepare(p[j], pre[j]);
    QD_UNROLL
    for (int s = 0; s < F::NSEG; ++s) {
      QD_UNROLL
      for (int j = 0; j < NN; ++j) {
        F::seg(s, p[j], pre[j], [&](int v, __m256 w) __attribute__((always_inline)) {
          QD_UNROLL
          for (int i = 0; i < TT; ++i) a[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + 8 * v), w, a[i][j]);
        });
      }
    }
    QD_UNROLL
    for (int j = 0; j < NN; ++j) p[j] += F::TS;
    QD_UNROLL
    for (int i = 0; i < TT; ++i) xr[i] += F::BS;
  }
  QD_UNROLL
  for (int i = 0; i < TT; ++i)
    QD_UNROLL
    for (int j = 0; j < NN; ++j) _mm256_store_ps(acc + i * NP * 8 + j * 8, a[i][j]);
}

// TT input rows against all NP rows of the panel, NN rows at a time.
// Not inlined: each (format, TT) gets its own register allocation, whatever else is compiled.
template <class F, int TT>
__attribute__((noinline)) void tile_panel(const float* x, int64_t ldx, const uint8_t* const* b, int64_t nblk,
                                          float* acc) {
  constexpr int NN = nn_for<F>(TT);
  static_assert(NP % NN == 0, "NN must divide NP");
  for (int j = 0; j < NP; j += NN) tile<F, TT, NN>(x, ldx, b + j, nblk, acc + j * 8);
}

// tb input rows against the panel: tiles of TT_MAX rows, then one tile for the rest. The tile
// a row lands in changes only which registers hold its accumulators, never its arithmetic.
template <class F>
void rows_panel(const float* x, int64_t ldx, const uint8_t* const* b, int64_t nblk, float* acc, int tb) {
  int t = 0;
  for (; t + TT_MAX <= tb; t += TT_MAX) tile_panel<F, TT_MAX>(x + t * ldx, ldx, b, nblk, acc + t * NP * 8);
  const float* xt = x + t * ldx;
  float* at = acc + t * NP * 8;
  switch (tb - t) {
    case 0: break;
    case 1: tile_panel<F, 1>(xt, ldx, b, nblk, at); break;
    case 2: tile_panel<F, 2>(xt, ldx, b, nblk, at); break;
    case 3: tile_panel<F, 3>(xt, ldx, b, nblk, at); break;
    case 4: tile_panel<F, 4>(xt, ldx, b, nblk, at); break;
    case 5: tile_panel<F, 5>(xt, ldx, b, nblk, at); break;
    case 6: tile_panel<F, 6>(xt, ldx, b, nblk, at); break;
    case 7: tile_panel<F, 7>(xt, ldx, b, nblk, at); break;
    default: break;
  }
}

// ---- Scratch path (long inputs): each chunk of the panel is dequantized once into an L1
// scratch (NP rows x CHUNK floats, the same values as the fused path), then multiplied with the
// input rows by register tiles of TT x NN with x loaded once per vector. Per accumulator the
// vectors come in F::ORDER, the order the fused path's seg() emits them in, so both paths give a
// row the same bits.

template <class F>
QD_INLINE void dequant_chunk(const uint8_t* const* b, int64_t nblk, float* w) {
  for (int j = 0; j < NP; ++j) {
    const uint8_t* p = b[j];
    float* wj = w + j * CHUNK;
    for (int64_t blk = 0; blk < nblk; ++blk, p += F::TS, wj += F::BS) {
      typename F::Pre pre;
      F::prepare(p, pre);
      QD_UNROLL
      for (int s = 0; s < F::NSEG; ++s)
        F::seg(s, p, pre, [&](int v, __m256 x) __attribute__((always_inline)) { _mm256_store_ps(wj + 8 * v, x); });
    }
  }
}

template <class F, int TT, int NN>
QD_INLINE void micro(const float* x, int64_t ldx, const float* w, int64_t nblk, float* acc) {
  __m256 a[TT][NN];
  const float* xr[TT];
  QD_UNROLL
  for (int i = 0; i < TT; ++i) {
    xr[i] = x + i * ldx;
    QD_UNROLL
    for (int j = 0; j < NN; ++j) a[i][j] = _mm256_load_ps(acc + i * NP * 8 + j * 8);
  }
  for (int64_t blk = 0; blk < nblk; ++blk, w += F::BS) {
    QD_UNROLL
    for (int u = 0; u < F::BS / 8; ++u) {
      const int off = 8 * F::ORDER[u];
      __m256 wv[NN];
      QD_UNROLL
      for (int j = 0; j < NN; ++j) wv[j] = _mm256_load_ps(w + j * CHUNK + off);
      QD_UNROLL
      for (int i = 0; i < TT; ++i) {
        __m256 xv = _mm256_loadu_ps(xr[i] + off);
        if (NN > 1) __asm__("" : "+x"(xv));  // one load into a register, not one per FMA
        QD_UNROLL
        for (int j = 0; j < NN; ++j) a[i][j] = _mm256_fmadd_ps(xv, wv[j], a[i][j]);
      }
    }
    QD_UNROLL
    for (int i = 0; i < TT; ++i) xr[i] += F::BS;
  }
  QD_UNROLL
  for (int i = 0; i < TT; ++i)
    QD_UNROLL
    for (int j = 0; j < NN; ++j) _mm256_store_ps(acc + i * NP * 8 + j * 8, a[i][j]);
}

template <class F, int TT, int NN>
__attribute__((noinline)) void micro_panel(const float* x, int64_t ldx, const float* w, int64_t nblk, float* acc) {
  static_assert(NP % NN == 0, "NN must divide NP");
  for (int j = 0; j < NP; j += NN) micro<F, TT, NN>(x, ldx, w + j * CHUNK, nblk, acc + j * 8);
}

template <class F>
void scratch_rows(const float* x, int64_t ldx, const float* w, int64_t nblk, float* acc, int tb) {
  int t = 0;
  for (; t + 4 <= tb; t += 4) micro_panel<F, 4, 2>(x + t * ldx, ldx, w, nblk, acc + t * NP * 8);
  const float* xt = x + t * ldx;
  float* at = acc + t * NP * 8;
  switch (tb - t) {
    case 1: micro_panel<F, 1, 8>(xt, ldx, w, nblk, at); break;
    case 2: micro_panel<F, 2, 4>(xt, ldx, w, nblk, at); break;
    case 3: micro_panel<F, 3, 2>(xt, ldx, w, nblk, at); break;
    default: break;
  }
}

// Checks at load time that F::ORDER is the order seg() emits vectors in.
template <class F>
bool order_matches() {
  alignas(32) uint8_t blk[F::TS] = {};
  typename F::Pre pre;
  F::prepare(blk, pre);
  int n = 0;
  bool ok = true;
  for (int s = 0; s < F::NSEG; ++s)
    F::seg(s, blk, pre, [&](int v, __m256) { ok = ok && n < F::BS / 8 && F::ORDER[n++] == v; });
  return ok && n == F::BS / 8;
}

// One call's operands. x: [T, K] fp32; xp: x packed chunk-major ([K/CHUNK][T][XS], used if T > 1);
// W: N rows of K/BS blocks; y: [T, N].
struct Gemm {
  static constexpr int64_t XS = CHUNK + 8;  // packed row stride (floats); see gemm()
  const float* x;
  const float* xp;
  const uint8_t* W;
  const float* bias;
  float* y;
  int64_t T, K, N, row_bytes, pf_step;
};

// Prefetches the cache lines of [q, end) into L1 (l1) or L2.
QD_INLINE void prefetch_lines(const uint8_t* q, const uint8_t* end, bool l1) {
  if (l1)
    for (; q < end; q += 64) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
  else
    for (; q < end; q += 64) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T1);
}

// Panel p (output rows 8p .. 8p+7) for all T input rows; prefetches panel p + 1 if `pf`.
// acc: TB * NP * 8 floats, wbuf: NP * CHUNK floats (both 64-byte aligned, per thread).
template <class F>
void panel(const Gemm& g, int64_t p, bool pf, float* acc, float* wbuf) {
  const int64_t n0 = p * NP;
  const int nn = static_cast<int>(std::min<int64_t>(NP, g.N - n0));
  const uint8_t* rows[NP];  // rows past N repeat the last one; their results are dropped
  for (int j = 0; j < NP; ++j) rows[j] = g.W + std::min<int64_t>(n0 + j, g.N - 1) * g.row_bytes;
  for (int64_t t0 = 0; t0 < g.T; t0 += TB) {
    const int tb = static_cast<int>(std::min<int64_t>(TB, g.T - t0));
    std::memset(acc, 0, sizeof(float) * tb * NP * 8);
    for (int64_t c0 = 0; c0 < g.K; c0 += CHUNK) {
      if (t0 == 0 && pf) {  // the 8-row interleave defeats the hardware prefetchers: fetch the next panel
        const uint8_t* q = g.W + (n0 + NP) * g.row_bytes + c0 / CHUNK * g.pf_step;
        const uint8_t* qe = std::min(q + g.pf_step, g.W + std::min<int64_t>(g.N, n0 + 2 * NP) * g.row_bytes);
        prefetch_lines(q, qe, g.T == 1);  // consumed fast: straight into L1; slower consumers: into L2
      }
      const int64_t nblk = std::min<int64_t>(CHUNK, g.K - c0) / F::BS;
      const uint8_t* b[NP];
      for (int j = 0; j < NP; ++j) b[j] = rows[j] + c0 / F::BS * F::TS;
      if (g.T == 1) {
        rows_panel<F>(g.x + c0, g.K, b, nblk, acc, tb);
      } else if (tb < SCRATCH_MIN_T) {
        rows_panel<F>(g.xp + (c0 / CHUNK * g.T + t0) * Gemm::XS, Gemm::XS, b, nblk, acc, tb);
      } else {
        dequant_chunk<F>(b, nblk, wbuf);
        scratch_rows<F>(g.xp + (c0 / CHUNK * g.T + t0) * Gemm::XS, Gemm::XS, wbuf, nblk, acc, tb);
      }
    }
    for (int t = 0; t < tb; ++t)
      store_panel_row(acc + t * NP * 8, g.y + (t0 + t) * g.N + n0, nn, g.bias ? g.bias + n0 : nullptr);
  }
}

// y[T, N] = x[T, K] @ W[N, K]^T (+ bias). W: N rows of K/BS blocks.
template <class F>
void gemm(const float* x, int64_t T, int64_t K, const uint8_t* W, int64_t N, const float* bias, float* y,
          int nthreads) {
  const int64_t row_bytes = K / F::BS * F::TS;
  const int64_t npanels = (N + NP - 1) / NP;
  const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
  const int64_t pf_step = (NP * row_bytes / nchunks + 63) / 64 * 64;  // next-panel bytes to prefetch per chunk
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, npanels)));
  const int64_t run = std::max<int64_t>(1, npanels / (8 * nt));  // ~8 runs of panels per thread
  // Tiles read several rows of x at once, chunk by chunk. x is repacked chunk-major with a row
  // stride of XS = CHUNK + 8 floats: compact, and (unlike strides that are multiples of 1 KiB,
  // as every model's K is) free of L1 conflicts between the rows' loads.
  const int64_t xfloats = T > 1 ? nchunks * T * Gemm::XS + 16 : 0;
  static thread_local std::vector<float> xkeep;  // reused by the calling thread's short calls
  std::vector<float> xonce;                      // long prefills: freed after the call
  std::vector<float>& xbuf = xfloats <= XBUF_KEEP ? xkeep : xonce;
  if (static_cast<int64_t>(xbuf.size()) < xfloats) xbuf.resize(xfloats);
  // Shared by the team; 64-byte aligned (loads split across cache lines are slow).
  float* const xp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xbuf.data()) + 63) / 64 * 64);
  const Gemm g{x, xp, W, bias, y, T, K, N, row_bytes, pf_step};
#pragma omp parallel num_threads(nt)
  {
    if (T > 1) {
#pragma omp for schedule(static)
      for (int64_t ct = 0; ct < nchunks * T; ++ct) {
        const int64_t c0 = ct / T * CHUNK, t = ct % T;
        std::memcpy(xp + ct * Gemm::XS, x + t * K + c0, sizeof(float) * std::min<int64_t>(CHUNK, K - c0));
      }
    }
    alignas(64) float acc[TB * NP * 8];
    alignas(64) float wbuf[NP * CHUNK];
    // Runs of panels are handed out dynamically (on a shared machine a descheduled thread must
    // not hold up the call); which thread computes a panel never changes its arithmetic.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t r0 = 0; r0 < npanels; r0 += run) {
      const int64_t r1 = std::min(npanels, r0 + run);
      for (int64_t p = r0; p < r1; ++p) panel<F>(g, p, p + 1 < r1, acc, wbuf);
    }
  }
}

// y[N, K] = dequantized W, bit-exact to gguf.quants.dequantize.
template <class F>
void dequant_rows(const uint8_t* W, int64_t N, int64_t K, float* y, int nthreads) {
  const int64_t nblk = K / F::BS;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, N / 16 + 1)));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* b = W + n * nblk * F::TS;
    float* yr = y + n * K;
    for (int64_t i = 0; i < nblk; ++i, b += F::TS, yr += F::BS) {
      typename F::Pre pre;
      F::prepare(b, pre);
      QD_UNROLL
      for (int s = 0; s < F::NSEG; ++s)
        F::seg(s, b, pre, [&](int v, __m256 w) __attribute__((always_inline)) { _mm256_storeu_ps(yr + 8 * v, w); });
    }
  }
}

}  // namespace QD_NS
