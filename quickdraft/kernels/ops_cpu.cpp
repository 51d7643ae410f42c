// Small fused CPU ops for the decode / verify step: RMSNorm and RoPE in one call each.
//
// At one token per step a 1.5B model's layer is ~50 torch ops, and each op costs a few
// microseconds of dispatch whatever its size: RMSNorm is 6 of them, RoPE (q and k) 16. These
// replace them with one call each, computing the same formulas in fp32:
//   rms_norm: y = w * (x * (1 / sqrt(mean(x^2) + eps)))   (mean: fixed 8-lane order, one row alone);
//             with offset 1 (Gemma's and Qwen3.5's norms): y = (w + 1) * (x * r), the same bits as
//             torch's h * (1 + w) (both products and the sum are commutative)
//   rope:     y[d] = x[d] * cos[p, d] + rot[d] * sin[p, d],  rot = [-x[D/2:], x[:D/2]]
//   attend:   softmax(q . k_j * scale) . v_j over the cache slots each query row may see (decode
//             and verification rows: a chain's causal prefix, a sliding window, or a tree row's
//             listed slots), written straight into [T, heads * D] for the output projection;
//             with sinks (GPT-OSS), each head's sink logit joins the softmax as a key of value zero.
// Every row is computed on its own with one fixed sequence of float operations, so a row's result
// does not depend on the other rows of the call (batch invariance, as in the GEMMs). For attention
// this also means a tree row, which sees prefix + ancestors + itself, gets bitwise the result plain
// decoding gets for that token once the accepted path sits in consecutive slots.

#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include "ops_api.h"
#include "simd_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#define QD_LOAD_INLINE inline __attribute__((always_inline))

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

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, double offset) {
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
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = xp + t * H;
    float* yr = yp + t * H;
    const float r = 1.0f / std::sqrt(sum_squares(xr, H) / static_cast<float>(H) + e);
    if (offset == 0.0)
      for (int64_t i = 0; i < H; ++i) yr[i] = wp[i] * (xr[i] * r);
    else
      for (int64_t i = 0; i < H; ++i) yr[i] = (wp[i] + off) * (xr[i] * r);
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

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [hsum8(A), hsum8(B), hsum8(C), hsum8(D)] with hsum8's additions: each vector's halves (i, i + 4),
// then those sums' (0, 2) and (1, 3), then the two (float addition commutes, so only which values
// meet matters): the same bits as four hsum8 calls in a third of the shuffles.
inline __m128 hsum8x4(__m256 A, __m256 B, __m256 C, __m256 D) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(A, B, 0x20), _mm256_permute2f128_ps(A, B, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(C, D, 0x20), _mm256_permute2f128_ps(C, D, 0x31));
  // per 128-bit lane (lo: A, C; hi: B, D): [s0 + s2, s1 + s3] of each
  const __m256 m = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(m, m, _MM_SHUFFLE(3, 1, 3, 1)));
  // lo lane [fA, fC, ..], hi lane [fB, fD, ..] -> [fA, fB, fC, fD]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
}

// A q8_0 cache row (--kv-dtype q8_0): D values as D / 32 GGML Q8_0 blocks, an fp16 scale d and 32
// int8 q each; a value is q * d. A row is quantized alone (store_row), so what a token stores does
// not depend on the other rows of its pass.
struct __attribute__((packed)) Q8Block {
  uint16_t d;
  int8_t q[32];
};
static_assert(sizeof(Q8Block) == 34, "Q8Block layout");

// Values 8c .. 8c + 7 of a cache row as fp32: a float cache as is, an fp16 one (uint16 bits) widened
// exactly (F16C), a q8_0 one as q * d (one rounding, the same for every reader).
QD_LOAD_INLINE __m256 load8(const float* row, int64_t c) { return _mm256_loadu_ps(row + 8 * c); }
QD_LOAD_INLINE __m256 load8(const uint16_t* row, int64_t c) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * c)));
}
QD_LOAD_INLINE __m256 load8(const Q8Block* row, int64_t c) {
  const Q8Block& b = row[c / 4];
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.q + 8 * (c % 4)))));
  return _mm256_mul_ps(q, _mm256_set1_ps(_cvtsh_ss(b.d)));
}

// Query heads per pass over a kv head's keys / values (registers: KEYS x HEADS score chains,
// HEADS x 2 output vectors, within AVX2's 16).
#define UNROLL _Pragma("GCC unroll 8")
constexpr int HEADS = 6;
constexpr int KEYS = 2;

// Scores of keys idx[j0 .. j0 + NK) for NH heads: ps[g][j] = (q_g . k_j) * sc, each (head, key) one
// chain of FMAs over D from zero then hsum8, whatever heads and keys share the pass.
template <int NH, int NK, typename KV>
inline void scores(const float* const* qr, const KV* kb, int64_t ks1, const int64_t* idx, int64_t j0, int64_t nv,
                   float sc, float* const* ps) {
  const KV* kr[NK];
  __m256 a[NK][NH];
  UNROLL for (int u = 0; u < NK; ++u) {
    kr[u] = kb + idx[j0 + u] * ks1;
    UNROLL for (int g = 0; g < NH; ++g) a[u][g] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < nv; ++c) {
    __m256 kv[NK];
    UNROLL for (int u = 0; u < NK; ++u) kv[u] = load8(kr[u], c);
    UNROLL for (int g = 0; g < NH; ++g) {
      const __m256 qv = _mm256_loadu_ps(qr[g] + 8 * c);
      UNROLL for (int u = 0; u < NK; ++u) a[u][g] = _mm256_fmadd_ps(qv, kv[u], a[u][g]);
    }
  }
  if constexpr (NK == 2) {  // two heads' two keys at a time: four hsum8 in one pass, same sums
    int g = 0;
    for (; g + 2 <= NH; g += 2) {
      const __m128 f = hsum8x4(a[0][g], a[1][g], a[0][g + 1], a[1][g + 1]);
      const __m128 y = _mm_mul_ps(f, _mm_set1_ps(sc));
      _mm_storel_pi(reinterpret_cast<__m64*>(ps[g] + j0), y);
      _mm_storeh_pi(reinterpret_cast<__m64*>(ps[g + 1] + j0), y);
    }
    for (; g < NH; ++g) {
      ps[g][j0] = hsum8(a[0][g]) * sc;
      ps[g][j0 + 1] = hsum8(a[1][g]) * sc;
    }
  } else {
    UNROLL for (int u = 0; u < NK; ++u)
      UNROLL for (int g = 0; g < NH; ++g) ps[g][j0 + u] = hsum8(a[u][g]) * sc;
  }
}

// a_g[e] += sum_j p_g[j] v_j[8c + 8e ..] over j = 0 .. n - 1 in slot order, for NH heads and
// NC column chunks: the values' FMA chain, shared by the whole-row and the tiled paths.
template <int NH, int NC, typename KV>
QD_LOAD_INLINE void fma_values(const KV* vb, int64_t vs1, const int64_t* idx, int64_t n, int64_t c,
                               const float* const* ps, __m256 (&a)[NH][NC]) {
  for (int64_t j = 0; j < n; ++j) {
    const KV* vr = vb + idx[j] * vs1;
    __m256 vv[NC];
    UNROLL for (int e = 0; e < NC; ++e) vv[e] = load8(vr, c + e);
    UNROLL for (int g = 0; g < NH; ++g) {
      const __m256 pj = _mm256_broadcast_ss(ps[g] + j);
      UNROLL for (int e = 0; e < NC; ++e) a[g][e] = _mm256_fmadd_ps(pj, vv[e], a[g][e]);
    }
  }
}

// y_g[8c .. 8c + 8 NC) = (sum_j p_g[j] v_j[..]) * inv_g, j in slot order from zero, for NH heads.
template <int NH, int NC, typename KV>
inline void weighted_values(const KV* vb, int64_t vs1, const int64_t* idx, int64_t n, int64_t c,
                            float* const* ps, const float* inv, float* const* y) {
  __m256 acc[NH][NC];
  UNROLL for (int g = 0; g < NH; ++g)
    UNROLL for (int e = 0; e < NC; ++e) acc[g][e] = _mm256_setzero_ps();
  fma_values<NH, NC, KV>(vb, vs1, idx, n, c, ps, acc);
  UNROLL for (int g = 0; g < NH; ++g)
    UNROLL for (int e = 0; e < NC; ++e) _mm256_storeu_ps(y[g] + 8 * (c + e), _mm256_mul_ps(acc[g][e], _mm256_set1_ps(inv[g])));
}

// acc_g[8c .. 8c + 8 NC) += sum_j p_g[j] v_j[..] over j = 0 .. n - 1 in order (a tile of a row's
// slots: the accumulators are loaded from and stored back to memory, so a row cut into tiles runs
// exactly the FMA chain an uncut row runs).
template <int NH, int NC, typename KV>
inline void accumulate_values(const KV* vb, int64_t vs1, const int64_t* idx, int64_t n, int64_t c,
                              const float* const* ps, float* const* acc) {
  __m256 a[NH][NC];
  UNROLL for (int g = 0; g < NH; ++g)
    UNROLL for (int e = 0; e < NC; ++e) a[g][e] = _mm256_loadu_ps(acc[g] + 8 * (c + e));
  fma_values<NH, NC, KV>(vb, vs1, idx, n, c, ps, a);
  UNROLL for (int g = 0; g < NH; ++g)
    UNROLL for (int e = 0; e < NC; ++e) _mm256_storeu_ps(acc[g] + 8 * (c + e), a[g][e]);
}

// softmax(p) in place (p_j = exp(s_j - max), summed in a fixed order: 8 lanes, then the lanes, then
// the tail); returns 1 / sum. sink (GPT-OSS's learned sink logit of the head, or null): one more
// score, of a key whose value is zero, in the max and last in the sum.
inline float softmax_inplace(float* p, int64_t n, const float* sink) {
  // the max, 8 lanes at a time (a max is exact in any order; max_ps(p, m) keeps m where p is NaN,
  // as std::max(m, p) does, so NaN scores are skipped alike)
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  int64_t jj = 0;
  for (; jj + 8 <= n; jj += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(p + jj), m8);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float m = _mm_cvtss_f32(m4);
  for (; jj < n; ++jj) m = std::max(m, p[jj]);
  if (sink != nullptr) m = std::max(m, *sink);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum8(sum8);
  if (j < n) {
    alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t r = j; r < n; ++r) tail[r - j] = p[r] - m;
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t r = j; r < n; ++r) {
      p[r] = tail[r - j];
      sum += p[r];
    }
  }
  if (sink != nullptr) sum += std::exp(*sink - m);
  return 1.0f / sum;
}

template <int NH, typename KV>
void attend_heads_n(const float* const* qr, const KV* kb, int64_t ks1, const KV* vb, int64_t vs1,
                    const int64_t* idx, int64_t n, int64_t nv, float sc, float* const* ps, float* const* y,
                    const float* sk) {
  int64_t j0 = 0;
  for (; j0 + KEYS <= n; j0 += KEYS) scores<NH, KEYS>(qr, kb, ks1, idx, j0, nv, sc, ps);
  for (; j0 < n; ++j0) scores<NH, 1>(qr, kb, ks1, idx, j0, nv, sc, ps);
  float inv[NH];
  UNROLL for (int g = 0; g < NH; ++g) inv[g] = softmax_inplace(ps[g], n, sk ? sk + g : nullptr);
  int64_t c = 0;
  for (; c + 2 <= nv; c += 2) weighted_values<NH, 2>(vb, vs1, idx, n, c, ps, inv, y);
  if (c < nv) weighted_values<NH, 1>(vb, vs1, idx, n, c, ps, inv, y);
}

// The same attention for a block of rows sharing a kv head, keys and values streamed once per
// block in tiles of KEY_TILE slots (each row's slots are idx[r][0 .. n[r]); the block's rows reuse
// a tile from cache instead of each reading every key and value from memory). Per row it runs the
// FMA chains attend_heads_n runs (scores per (head, key) over D; values per output over the slots
// in order, tiles only spilling the accumulators), so results are bitwise the unblocked ones.
constexpr int64_t KEY_TILE = 64;
constexpr int ROW_BLOCK = 16;

// Slots t0 .. t0 + cnt - 1 of a cache (row stride s1) as fp32 rows of D at out: an fp16 or q8_0 tile
// widened once for all the rows of a block (the FMAs see the values they would convert themselves).
template <typename KV>
inline void widen_tile(const KV* src, int64_t s1, int64_t t0, int64_t cnt, int64_t D, float* out) {
  for (int64_t j = 0; j < cnt; ++j)
    for (int64_t c = 0; c < D / 8; ++c) _mm256_storeu_ps(out + j * D + 8 * c, load8(src + (t0 + j) * s1, c));
}

// IOTA[j] = j: the slot list of a widened tile (slots relative to its first)
struct Iota {
  int64_t v[KEY_TILE];
  constexpr Iota() : v() {
    for (int64_t j = 0; j < KEY_TILE; ++j) v[j] = j;
  }
};
constexpr Iota IOTA{};

// dense: every row's slots are 0, 1, 2, .. (chain rows without a window), so a tile's slots are the
// same for all rows; an fp16 cache's tile is then widened once (kt / vt: KEY_TILE * D floats each).
template <int NH, typename KV>
void attend_block_n(int nr, const float* const* const* qr, const KV* kb, int64_t ks1, const KV* vb, int64_t vs1,
                    const int64_t* const* idx, const int64_t* n, int64_t nv, float sc, float* const* const* ps,
                    float* const* const* acc, float* const* const* y, bool dense, float* kt, float* vt,
                    const float* sk) {
  constexpr bool HALF = !std::is_same_v<KV, float>;  // a 16-bit or q8_0 cache: tiles are widened
  const int64_t D = 8 * nv;
  int64_t most = 0;
  for (int r = 0; r < nr; ++r) most = std::max(most, n[r]);
  for (int64_t t0 = 0; t0 < most; t0 += KEY_TILE) {
    if (HALF && dense) {
      if constexpr (HALF) widen_tile(kb, ks1, t0, std::min(most - t0, KEY_TILE), D, kt);
      for (int r = 0; r < nr; ++r) {
        const int64_t cnt = std::max<int64_t>(0, std::min(n[r], t0 + KEY_TILE) - t0);
        float* pt[NH];
        UNROLL for (int g = 0; g < NH; ++g) pt[g] = ps[r][g] + t0;
        int64_t j0 = 0;
        for (; j0 + KEYS <= cnt; j0 += KEYS) scores<NH, KEYS>(qr[r], kt, D, IOTA.v, j0, nv, sc, pt);
        for (; j0 < cnt; ++j0) scores<NH, 1>(qr[r], kt, D, IOTA.v, j0, nv, sc, pt);
      }
      continue;
    }
    for (int r = 0; r < nr; ++r) {
      const int64_t t1 = std::min(n[r], t0 + KEY_TILE);
      int64_t j0 = t0;
      for (; j0 + KEYS <= t1; j0 += KEYS) scores<NH, KEYS>(qr[r], kb, ks1, idx[r], j0, nv, sc, ps[r]);
      for (; j0 < t1; ++j0) scores<NH, 1>(qr[r], kb, ks1, idx[r], j0, nv, sc, ps[r]);
    }
  }
  float inv[HEADS * 64];
  for (int r = 0; r < nr; ++r) {
    UNROLL for (int g = 0; g < NH; ++g) inv[r * HEADS + g] = softmax_inplace(ps[r][g], n[r], sk ? sk + g : nullptr);
    for (int g = 0; g < NH; ++g) std::fill(acc[r][g], acc[r][g] + 8 * nv, 0.0f);
  }
  for (int64_t t0 = 0; t0 < most; t0 += KEY_TILE) {
    const bool wide = HALF && dense;
    if constexpr (HALF)
      if (wide) widen_tile(vb, vs1, t0, std::min(most - t0, KEY_TILE), D, vt);
    for (int r = 0; r < nr; ++r) {
      if (t0 >= n[r]) continue;
      const int64_t cnt = std::min(n[r], t0 + KEY_TILE) - t0;
      const float* pt[NH];
      UNROLL for (int g = 0; g < NH; ++g) pt[g] = ps[r][g] + t0;
      int64_t c = 0;
      if (wide) {
        for (; c + 2 <= nv; c += 2) accumulate_values<NH, 2>(vt, D, IOTA.v, cnt, c, pt, acc[r]);
        if (c < nv) accumulate_values<NH, 1>(vt, D, IOTA.v, cnt, c, pt, acc[r]);
      } else {
        for (; c + 2 <= nv; c += 2) accumulate_values<NH, 2>(vb, vs1, idx[r] + t0, cnt, c, pt, acc[r]);
        if (c < nv) accumulate_values<NH, 1>(vb, vs1, idx[r] + t0, cnt, c, pt, acc[r]);
      }
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int g = 0; g < NH; ++g) {
      const __m256 iv = _mm256_set1_ps(inv[r * HEADS + g]);
      for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(y[r][g] + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc[r][g] + 8 * c), iv));
    }
}

template <typename KV>
inline void attend_block(int nh, int nr, const float* const* const* qr, const KV* kb, int64_t ks1, const KV* vb,
                         int64_t vs1, const int64_t* const* idx, const int64_t* n, int64_t nv, float sc,
                         float* const* const* ps, float* const* const* acc, float* const* const* y, bool dense,
                         float* kt, float* vt, const float* sk) {
  switch (nh) {
    case 1: attend_block_n<1>(nr, qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, acc, y, dense, kt, vt, sk); break;
    case 2: attend_block_n<2>(nr, qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, acc, y, dense, kt, vt, sk); break;
    case 3: attend_block_n<3>(nr, qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, acc, y, dense, kt, vt, sk); break;
    case 4: attend_block_n<4>(nr, qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, acc, y, dense, kt, vt, sk); break;
    case 5: attend_block_n<5>(nr, qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, acc, y, dense, kt, vt, sk); break;
    default: attend_block_n<6>(nr, qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, acc, y, dense, kt, vt, sk); break;
  }
}

// Attention of nh (<= HEADS) query heads of one row over the n slots idx of their kv head.
template <typename KV>
inline void attend_heads(int nh, const float* const* qr, const KV* kb, int64_t ks1, const KV* vb, int64_t vs1,
                         const int64_t* idx, int64_t n, int64_t nv, float sc, float* const* ps, float* const* y,
                         const float* sk) {
  switch (nh) {
    case 1: attend_heads_n<1>(qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, y, sk); break;
    case 2: attend_heads_n<2>(qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, y, sk); break;
    case 3: attend_heads_n<3>(qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, y, sk); break;
    case 4: attend_heads_n<4>(qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, y, sk); break;
    case 5: attend_heads_n<5>(qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, y, sk); break;
    default: attend_heads_n<6>(qr, kb, ks1, vb, vs1, idx, n, nv, sc, ps, y, sk); break;
  }
}

// Store D floats into the cache: as is, or rounded to fp16 (nearest even, as torch's .half()).
inline void store_row(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t D) {
  for (int64_t d = 0; d < D; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// q8_0, per 32 values: amax = max |x|, d = amax / 127, q = round-half-even(x * (1 / d)) (0 where d is
// 0), d stored as fp16 (nearest even); quickdraft/cache.py has the same rule in torch, bit for bit.
inline void store_row(Q8Block* dst, const float* src, int64_t D) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < D / 32; ++b) {
    const float* x = src + 32 * b;
    __m256 m = _mm256_setzero_ps();
    for (int v = 0; v < 4; ++v) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * v)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int v = 0; v < 4; ++v) q[v] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * v), id));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[b].q),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    dst[b].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// The rows' attention over a cache of element type KV (float, or fp16 bits as uint16_t).
template <typename KV>
void attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start, int64_t window,
                 float sc, bool tree, const int64_t* sp, const int64_t* op, const float* sinks, torch::Tensor& out) {
  const int64_t Hq = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0);
  const float* qp = q.data_ptr<float>();
  const KV* kp = static_cast<const KV*>(k.data_ptr());
  const KV* vp = static_cast<const KV*>(v.data_ptr());
  float* yp = out.data_ptr<float>();
  const int64_t unit = static_cast<int64_t>(sizeof(KV)) / k.element_size();  // tensor elements per KV (q8_0: 34 bytes)
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0) / unit, ks1 = k.stride(1) / unit;
  const int64_t vs0 = v.stride(0) / unit, vs1 = v.stride(1) / unit, group = Hq / Hkv, nv = D / 8;
  const int64_t S = std::min(k.size(1), v.size(1));
  // one work item per (kv head, block of up to ROW_BLOCK rows): the group's query heads and the
  // block's rows share every key and value load
  const int64_t blocks = (T + ROW_BLOCK - 1) / ROW_BLOCK, work = Hkv * blocks;
  // threads only when there is enough work to pay for waking them
  const int nt = static_cast<int>(std::min<int64_t>({at::get_num_threads(), work,
                                                      std::max<int64_t>(1, T * Hkv * group * S / 1024)}));
  qd_api::ReleaseGil nogil;
#pragma omp parallel num_threads(std::max(nt, 1))
  {
    std::vector<float> p, acc, tiles;
    std::vector<std::vector<int64_t>> idx(ROW_BLOCK);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t kh = w / blocks, i0 = (w % blocks) * ROW_BLOCK, i1 = std::min(T, i0 + ROW_BLOCK);
      const int nr = static_cast<int>(i1 - i0);
      int64_t n[ROW_BLOCK];
      int64_t total = 0;
      for (int r = 0; r < nr; ++r) {  // the slots row i0 + r sees, in slot order
        const int64_t i = i0 + r;
        auto& ix = idx[r];
        ix.clear();
        if (tree) {
          ix.assign(sp + op[i], sp + op[i + 1]);
        } else {
          const int64_t end = start + i + 1;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, end - window) : 0;
          for (int64_t j = lo; j < end; ++j) ix.push_back(j);
        }
        n[r] = static_cast<int64_t>(ix.size());
        total += n[r] + 8;
      }
      p.resize(HEADS * total);
      acc.resize(static_cast<size_t>(ROW_BLOCK) * HEADS * D);
      for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += HEADS) {
        const int nh = static_cast<int>(std::min<int64_t>(HEADS, (kh + 1) * group - h0));
        const float* qrow[ROW_BLOCK][HEADS];
        float* ps[ROW_BLOCK][HEADS];
        float* ac[ROW_BLOCK][HEADS];
        float* y[ROW_BLOCK][HEADS];
        const float* const* qr_r[ROW_BLOCK];
        float* const* ps_r[ROW_BLOCK];
        float* const* ac_r[ROW_BLOCK];
        float* const* y_r[ROW_BLOCK];
        const int64_t* idx_r[ROW_BLOCK];
        int live = 0;  // rows that see at least one slot
        int64_t off = 0, nl[ROW_BLOCK];
        for (int r = 0; r < nr; ++r) {
          const int64_t i = i0 + r;
          if (n[r] == 0) {
            for (int g = 0; g < nh; ++g) std::fill(yp + i * Hq * D + (h0 + g) * D, yp + i * Hq * D + (h0 + g + 1) * D, 0.0f);
            continue;
          }
          for (int g = 0; g < nh; ++g) {
            qrow[live][g] = qp + (h0 + g) * qs0 + i * qs1;
            ps[live][g] = p.data() + off + g * (n[r] + 8);
            ac[live][g] = acc.data() + (static_cast<int64_t>(live) * HEADS + g) * D;
            y[live][g] = yp + i * Hq * D + (h0 + g) * D;
          }
          off += HEADS * (n[r] + 8);
          qr_r[live] = qrow[live];
          ps_r[live] = ps[live];
          ac_r[live] = ac[live];
          y_r[live] = y[live];
          idx_r[live] = idx[r].data();
          nl[live] = n[r];
          ++live;
        }
        if (live == 1) {  // one row (a decode step): no tiles needed
          attend_heads<KV>(nh, qr_r[0], kp + kh * ks0, ks1, vp + kh * vs0, vs1, idx_r[0], nl[0], nv, sc, ps[0], y[0],
                           sinks ? sinks + h0 : nullptr);
        } else if (live > 1) {
          const bool dense = !tree && window <= 0;
          if (dense && tiles.empty()) tiles.resize(2 * KEY_TILE * D);
          attend_block<KV>(nh, live, qr_r, kp + kh * ks0, ks1, vp + kh * vs0, vs1, idx_r, nl, nv, sc, ps_r, ac_r, y_r,
                           dense, tiles.data(), tiles.data() + KEY_TILE * D, sinks ? sinks + h0 : nullptr);
        }
      }
    }
  }
}

template <typename KV>
void write_rows(torch::Tensor& k, torch::Tensor& v, const torch::Tensor& kn, const torch::Tensor& vn, int64_t start) {
  const int64_t Hkv = k.size(0), T = kn.size(1), D = kn.size(2);
  const int64_t unit = static_cast<int64_t>(sizeof(KV)) / k.element_size();
  KV* kp = static_cast<KV*>(k.data_ptr());
  KV* vp = static_cast<KV*>(v.data_ptr());
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t t = 0; t < T; ++t) {
      store_row(kp + (h * k.stride(0) + (start + t) * k.stride(1)) / unit,
                kn.data_ptr<float>() + h * kn.stride(0) + t * kn.stride(1), D);
      store_row(vp + (h * v.stride(0) + (start + t) * v.stride(1)) / unit,
                vn.data_ptr<float>() + h * vn.stride(0) + t * vn.stride(1), D);
    }
}

// q [Hq, T, D] float32 (unit last stride), k/v [Hkv, >= end, D] float32 or float16 (unit last
// stride; views of the cache): every key and value is widened to fp32 exactly, so an fp16 cache
// changes what is stored, never how a row is computed from it.
// chain rows: row i sees slots lo_i .. start + i (lo_i = 0, or the last `window` slots);
// tree rows (slots defined): row i sees slots[offsets[i] .. offsets[i+1]) in that order.
// Returns [T, Hq * D].
// k_new / v_new [Hkv, T, D] float32 (optional): this pass's keys and values, first written into
// slots start .. start + T - 1 of k / v (rounded to the cache's type); the rows see slots below start + T.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                     int64_t window, double scale, const c10::optional<torch::Tensor>& slots,
                     const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& k_new,
                     const c10::optional<torch::Tensor>& v_new, const c10::optional<torch::Tensor>& sinks) {
  auto f32_3d = [](const torch::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 3 && t.stride(2) == 1;
  };
  auto cache_3d = [](const torch::Tensor& t) {
    const auto st = t.scalar_type();
    return t.device().is_cpu() && (st == torch::kFloat32 || st == torch::kHalf || st == torch::kUInt8) && t.dim() == 3 &&
           t.stride(2) == 1;
  };
  TORCH_CHECK(f32_3d(q) && cache_3d(k) && cache_3d(v) && k.scalar_type() == v.scalar_type(),
              "q must be CPU float32 and k, v CPU float32, float16 or q8_0 bytes (one type) [heads, n, D] with unit "
              "last stride");
  const bool half = k.scalar_type() == torch::kHalf, q8 = k.scalar_type() == torch::kUInt8;
  const int64_t T = q.size(1), D = q.size(2), Hkv = k.size(0), Hq = q.size(0);
  const int64_t row = q8 ? D / 32 * 34 : D;  // a cache row's elements (q8_0: bytes of D / 32 blocks)
  TORCH_CHECK(D % (q8 ? 32 : 8) == 0 && k.size(2) == row && v.size(2) == row && v.size(0) == Hkv && Hkv > 0 &&
                  Hq % Hkv == 0,
              "head dims must match (D a multiple of 8; q8_0: of 32) and query heads be a multiple of kv heads");
  int64_t S = std::min(k.size(1), v.size(1));
  const bool write = k_new.has_value() && k_new->defined();
  torch::Tensor kw = k, vw = v;
  if (write) {
    TORCH_CHECK(v_new.has_value() && v_new->defined(), "k_new needs v_new");
    const torch::Tensor& kn = *k_new;
    const torch::Tensor& vn = *v_new;
    TORCH_CHECK(f32_3d(kn) && f32_3d(vn) && kn.size(0) == Hkv && vn.size(0) == Hkv && kn.size(1) == T &&
                    vn.size(1) == T && kn.size(2) == D && vn.size(2) == D,
                "k_new / v_new must be CPU float32 [kv heads, T, D] with unit last stride");
    TORCH_CHECK(start >= 0 && start + T <= S, "the new keys reach past the cache");
    if (q8)
      write_rows<Q8Block>(kw, vw, kn, vn, start);
    else if (half)
      write_rows<uint16_t>(kw, vw, kn, vn, start);
    else
      write_rows<float>(kw, vw, kn, vn, start);
    S = start + T;
  }
  const bool tree = slots.has_value() && slots->defined();
  const int64_t* sp = nullptr;
  const int64_t* op = nullptr;
  torch::Tensor sl, of;
  if (tree) {
    TORCH_CHECK(offsets.has_value() && offsets->defined(), "tree rows need offsets");
    sl = slots->contiguous();
    of = offsets->contiguous();
    TORCH_CHECK(sl.scalar_type() == torch::kInt64 && of.scalar_type() == torch::kInt64 && of.numel() == T + 1,
                "slots / offsets must be int64, offsets [T + 1]");
    sp = sl.data_ptr<int64_t>();
    op = of.data_ptr<int64_t>();
    for (int64_t i = 0; i < sl.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "slot ", sp[i], " out of range");
    for (int64_t i = 0; i < T; ++i) TORCH_CHECK(op[i] <= op[i + 1] && op[i + 1] <= sl.numel(), "bad offsets");
  } else {
    TORCH_CHECK(start >= 0 && start + T <= S, "rows reach past the keys");
  }
  const float* sk = nullptr;
  torch::Tensor sinks_c;
  if (sinks.has_value() && sinks->defined()) {
    sinks_c = sinks->contiguous();
    TORCH_CHECK(sinks_c.device().is_cpu() && sinks_c.scalar_type() == torch::kFloat32 && sinks_c.numel() == Hq,
                "sinks must be a CPU float32 tensor [query heads]");
    sk = sinks_c.data_ptr<float>();
  }
  auto out = torch::empty({T, Hq * D}, q.options());
  // the rows see slots below S only (the new keys' end when writing)
  const torch::Tensor kr = k.narrow(1, 0, S), vr = v.narrow(1, 0, S);
  if (q8)
    attend_rows<Q8Block>(q, kr, vr, start, window, static_cast<float>(scale), tree, sp, op, sk, out);
  else if (half)
    attend_rows<uint16_t>(q, kr, vr, start, window, static_cast<float>(scale), tree, sp, op, sk, out);
  else
    attend_rows<float>(q, kr, vr, start, window, static_cast<float>(scale), tree, sp, op, sk, out);
  return out;
}

}  // namespace

torch::Tensor qd_api::rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, double offset) {
  return ::rms_norm(x, w, eps, offset);
}
torch::Tensor qd_api::rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           const torch::Tensor& positions) {
  return ::rope(x, cos, sin, positions);
}
torch::Tensor qd_api::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                             int64_t window, double scale, const c10::optional<torch::Tensor>& slots,
                             const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& k_new,
                             const c10::optional<torch::Tensor>& v_new, const c10::optional<torch::Tensor>& sinks) {
  return ::attend(q, k, v, start, window, scale, slots, offsets, k_new, v_new, sinks);
}

// Streaming-read bandwidth of this machine: nthreads threads each read their share of a buffer of
// `bytes` (far larger than any cache) with 256-bit loads, `repeats` times; the best GB/s (1e9 bytes/s).
// The roofline of a decode step: every weight byte is read once per step.
double read_bandwidth(int64_t bytes, int64_t nthreads, int64_t repeats) {
  TORCH_CHECK(bytes >= (1 << 20) && nthreads >= 1 && repeats >= 1, "read_bandwidth: bytes >= 1 MiB, threads and repeats >= 1");
  const int64_t n = bytes / 128 * 4;  // 32-byte vectors, a multiple of 4
  std::vector<__m256i> buf(static_cast<size_t>(n));
  const int nt = static_cast<int>(nthreads);
  pybind11::gil_scoped_release nogil;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) buf[i] = _mm256_set1_epi64x(i);  // each thread touches its own pages first
  double best = 0.0;
  int64_t sink = 0;
  for (int64_t r = 0; r < repeats; ++r) {
    int64_t s = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nt) reduction(+ : s)
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t a = n * t / T / 4 * 4, b = n * (t + 1) / T / 4 * 4;
      __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;
      for (int64_t i = a; i < b; i += 4) {
        // odd repeats also prefetch 2 KB ahead, as the GEMM does: on AMD Zen 1 the hardware
        // prefetcher alone streams ~10% below what the decode passes reach (11.6 vs 12.8 GB/s)
        if (r % 2 == 1) _mm_prefetch(reinterpret_cast<const char*>(&buf[i + 64]), _MM_HINT_T0);
        x0 = _mm256_add_epi64(x0, _mm256_load_si256(&buf[i]));
        x1 = _mm256_add_epi64(x1, _mm256_load_si256(&buf[i + 1]));
        x2 = _mm256_add_epi64(x2, _mm256_load_si256(&buf[i + 2]));
        x3 = _mm256_add_epi64(x3, _mm256_load_si256(&buf[i + 3]));
      }
      x0 = _mm256_add_epi64(_mm256_add_epi64(x0, x1), _mm256_add_epi64(x2, x3));
      s += _mm256_extract_epi64(x0, 0);
    }
    const double dt = omp_get_wtime() - t0;
    sink += s;
    best = std::max(best, static_cast<double>(n) * 32.0 / dt / 1e9);
  }
  return sink == -1 ? 0.0 : best;  // (sink keeps the reads)
}

// Per row of x [R, V] (fp32), the index of its maximum as torch.argmax gives it: the first maximal index,
// and the first NaN where the row holds one (torch counts NaN as the maximum). One vector pass for the
// maximum (and whether a NaN is there), one to find its first index.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU float32 tensor [rows, V]");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax of an empty row");
  auto out = torch::empty({R}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * V;
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mx = _mm256_max_ps(mx, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float m = lanes[0];
    for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < V; ++i) {
      has_nan = has_nan || std::isnan(row[i]);
      m = std::max(m, row[i]);
    }
    int64_t at = 0;
    if (has_nan) {
      while (!std::isnan(row[at])) ++at;
    } else {
      const __m256 target = _mm256_set1_ps(m);
      int64_t j = 0;
      int hit = 0;
      for (; j + 8 <= V; j += 8) {
        hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), target, _CMP_EQ_OQ));
        if (hit) break;
      }
      if (hit) {
        at = j + __builtin_ctz(hit);
      } else {
        at = j;
        while (row[at] != m) ++at;
      }
    }
    o[r] = at;
  }
  return out;
}

void register_ops(pybind11::module& m) {
  m.def("read_bandwidth", &read_bandwidth,
        "streaming-read GB/s of nthreads threads over a buffer of bytes (best of repeats, every other one with "
        "software prefetch)",
        pybind11::arg("bytes"), pybind11::arg("num_threads"), pybind11::arg("repeats") = 3);
  m.def("argmax_rows", &argmax_rows,
        "per row of x [rows, V] (fp32) the first index of its maximum (the first NaN where one is), as torch.argmax",
        pybind11::arg("x"));
  m.def("rms_norm", &rms_norm, "(w + offset) * x / sqrt(mean(x^2) + eps) per row (fp32)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("offset") = 0.0);
  m.def("rope", &rope, "rotate-half RoPE of x [heads, T, D] at positions, from cos/sin tables [S, D]",
        pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"));
  m.def("attend", &attend,
        "softmax attention of query rows q [Hq, T, D] over the cache slots each may see -> [T, Hq * D]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("start"), pybind11::arg("window"),
        pybind11::arg("scale"), pybind11::arg("slots") = pybind11::none(), pybind11::arg("offsets") = pybind11::none(),
        pybind11::arg("k_new") = pybind11::none(), pybind11::arg("v_new") = pybind11::none(),
        pybind11::arg("sinks") = pybind11::none());
}
