// sekv's decode step on CPU for many compressed requests at once, one layer: score every span,
// zoom the best spans within each request's budget, spend the rows they leave over on the best
// single keys of the other spans, and attend full rows + summaries + the tokens read (through
// their spans' low-rank factors) in one softmax per query head.
//
// Torch reference: SeKVRuntime.attend_batch's torch path (ZoomPolicy.span_scores,
// segment_budgeted_zoom, ZoomPolicy.key_scores, segment_key_recall, batched_mixed_attention).
// Each (request, KV head) is computed on its own, in a fixed order, by one thread: a request's
// result does not depend on the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Ask for the cache lines of [p, p + bytes) ahead of use: rows are read once, scattered across
// requests and layers, and the loops are bound by memory latency, not arithmetic.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// exp(x) to about 2e-7 relative error (Cephes' expf polynomial), branch-free so that loops of it
// vectorise (glibc's expf does not); exactly 0 below -87.3 (so exp(-inf) = 0).
__attribute__((always_inline)) inline float exp_poly(float x) {
  const float lo = -87.3f, hi = 88.3f;
  const bool under = x < lo;
  x = x < lo ? lo : (x > hi ? hi : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.f : y * scale;
}

// log(x) for a positive normal x to about 1e-7 relative error (Cephes' logf polynomial),
// branch-free so that loops of it vectorise.
__attribute__((always_inline)) inline float log_poly(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  float e = static_cast<float>(((bits >> 23) & 0xff) - 126);
  bits = (bits & 0x807fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1.f : e;
  m = small ? m + m - 1.f : m - 1.f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// One float16 to float: the F16C instruction where there is one (c10::Half's conversion is bit twiddling,
// slow in the scoring loops, which convert a log count per centroid).
inline float half_to_float(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void to_float(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

#if defined(__AVX512F__)
// code_dots for G query heads known at compile time: the G accumulators of 16 centroids stay in registers.
template <int G, int BITS>
inline void code_dots_lanes(const uint8_t* codes, const float* qstep, float* acc, int64_t Dm, int64_t C, int64_t Ce,
                            int64_t D) {
  constexpr int m = 8 / BITS;
  for (int64_t c0 = 0; c0 < Ce; c0 += 16) {
    __m512 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Dm; ++j) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * C + c0)));
      for (int i = 0; i < m; ++i) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(((1 << BITS) - 1) << (i * BITS))));
        const int64_t d = j + i * Dm;
        for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(qstep[g * D + d]), v, a[g]);
      }
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * C + c0, a[g]);
  }
}
#endif

// acc[g * C + c] = sum_d qstep[g * D + d] * (code(c, d) << i * bits) for one span's codes [Dm, C] (see
// span_decode) and c < Ce, where d = j + i * Dm: the codes are masked in place, not shifted, and qstep
// carries the 2^(-i * bits) instead (scaling by a power of two is exact: the products are those of the
// shifted codes). val: C floats of scratch. With AVX-512 (C a multiple of 16, up to 4 query heads per KV
// head), 16 centroids per vector register, Ce rounded up to 16.
inline void code_dots(const uint8_t* codes, const float* qstep, float* acc, float* val, int64_t Dm, int64_t C,
                      int64_t Ce, int64_t G, int64_t D, int bits) {
#if defined(__AVX512F__)
  if (C % 16 == 0 && G <= 4) {
    using Lanes = void (*)(const uint8_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
    static constexpr Lanes lanes[4][3] = {
        {code_dots_lanes<1, 2>, code_dots_lanes<1, 4>, code_dots_lanes<1, 8>},
        {code_dots_lanes<2, 2>, code_dots_lanes<2, 4>, code_dots_lanes<2, 8>},
        {code_dots_lanes<3, 2>, code_dots_lanes<3, 4>, code_dots_lanes<3, 8>},
        {code_dots_lanes<4, 2>, code_dots_lanes<4, 4>, code_dots_lanes<4, 8>}};
    return lanes[G - 1][bits == 2 ? 0 : (bits == 4 ? 1 : 2)](codes, qstep, acc, Dm, C, Ce, D);
  }
#endif
  const int64_t m = 8 / bits;
  for (int64_t g = 0; g < G; ++g) std::fill(acc + g * C, acc + g * C + Ce, 0.f);
  for (int64_t j = 0; j < Dm; ++j) {
    const uint8_t* col = codes + j * C;
    for (int64_t i = 0; i < m; ++i) {
      const int mask = ((1 << bits) - 1) << (i * bits);
      const int64_t d = j + i * Dm;
#pragma omp simd
      for (int64_t c = 0; c < Ce; ++c) val[c] = static_cast<float>(col[c] & mask);
      for (int64_t g = 0; g < G; ++g) axpy(qstep[g * D + d], val, acc + g * C, Ce);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// Lane j of the result is the sum of t[j]'s 16 lanes: 16 horizontal sums for the price of about three.
inline __m512 transpose_sum16(const __m512* t) {
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * j], t[2 * j + 1]), _mm512_unpackhi_ps(t[2 * j], t[2 * j + 1]));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// Lane j = q . rows[j] for 16 rows of 16 * DV elements.
template <int DV>
inline __m512 dots16(const float* const* rows, const float* q) {
  __m512 qv[DV], t[16];
  for (int k = 0; k < DV; ++k) qv[k] = _mm512_loadu_ps(q + 16 * k);
  for (int j = 0; j < 16; ++j) {
    __m512 acc = _mm512_mul_ps(load16(rows[j]), qv[0]);
    for (int k = 1; k < DV; ++k) acc = _mm512_fmadd_ps(load16(rows[j] + 16 * k), qv[k], acc);
    t[j] = acc;
  }
  return transpose_sum16(t);
}

// exp_poly on 16 lanes.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), y, _mm512_castsi512_ps(e));
}

// The logsumexp of x_c = (base + acc[c]) * fscore + lcount[c] over c < n (n a multiple of 16; a -inf lcount adds
// nothing) as its two halves: top = max_c x_c and *sum = sum_c exp(x_c - top) (its log is taken later, 16 at a time).
inline float span_max_sumexp16(const float* acc, const float* lcount, float base, float fscore, int64_t n,
                               float* sum) {
  const __m512 b = _mm512_set1_ps(base), f = _mm512_set1_ps(fscore);
  auto logit = [&](int64_t c) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(b, _mm512_loadu_ps(acc + c)), f), _mm512_loadu_ps(lcount + c));
  };
  __m512 top = _mm512_set1_ps(kNegInf);
  for (int64_t c = 0; c < n; c += 16) top = _mm512_max_ps(top, logit(c));
  const float t = _mm512_reduce_max_ps(top);
  const __m512 tv = _mm512_set1_ps(t);
  __m512 acc_sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) acc_sum = _mm512_add_ps(acc_sum, exp16(_mm512_sub_ps(logit(c), tv)));
  *sum = _mm512_reduce_add_ps(acc_sum);
  return t;
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

template <int DV>
void row_logits_lanes(const float* const* rows, const float* const* next_rows, int64_t n, const float* qg, int64_t G,
                      float scale, float* logits, int64_t ld) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    if (i + 16 < n) {
      for (int j = 0; j < 16; ++j) prefetch(rows[i + 16 + j], DV * 64);
    }
    for (int64_t j = i; j < std::min<int64_t>(i + 16, n); ++j) prefetch(next_rows[j], DV * 64);
    for (int64_t g = 0; g < G; ++g) {
      _mm512_mask_storeu_ps(logits + g * ld + i, first_lanes(n - i),
                            _mm512_mul_ps(dots16<DV>(rows + i, qg + g * 16 * DV), sc));
    }
  }
}

// The G output rows held in registers over all n rows.
template <int G, int DV>
void weighted_rows_lanes(const float* const* rows, int64_t n, const float* w, int64_t ld, float* out) {
  __m512 acc[G][DV];
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < DV; ++k) acc[g][k] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch(rows[i + 8], DV * 64);
    __m512 x[DV];
    for (int k = 0; k < DV; ++k) x[k] = _mm512_loadu_ps(rows[i] + 16 * k);
    for (int g = 0; g < G; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * ld + i]);
      for (int k = 0; k < DV; ++k) acc[g][k] = _mm512_fmadd_ps(wg, x[k], acc[g][k]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < DV; ++k) _mm512_storeu_ps(out + (g * DV + k) * 16, acc[g][k]);
  }
}
#endif

// logits[g * ld + i] = (q_g . rows[i]) * scale for the G query heads q_g = qg + g * D and i < n. rows: n
// pointers to D floats, padded to a multiple of 16 (with pointers to any readable row) for the vector path;
// next_rows: n rows read next (the values), asked for from memory on the way.
void row_logits(const float* const* rows, const float* const* next_rows, int64_t n, const float* qg, int64_t G,
                int64_t D, float scale, float* logits, int64_t ld) {
#if defined(__AVX512F__)
  switch (D) {
    case 64: return row_logits_lanes<4>(rows, next_rows, n, qg, G, scale, logits, ld);
    case 128: return row_logits_lanes<8>(rows, next_rows, n, qg, G, scale, logits, ld);
    default: break;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch(rows[i + 8], D * 4);
    prefetch(next_rows[i], D * 4);
    for (int64_t g = 0; g < G; ++g) logits[g * ld + i] = dot(qg + g * D, rows[i], D) * scale;
  }
}

// out[g * D + d] = sum_i w[g * ld + i] * rows[i][d] (overwritten), for rows: n pointers to D floats.
void weighted_rows(const float* const* rows, int64_t n, const float* w, int64_t ld, int64_t G, int64_t D,
                   float* out) {
#if defined(__AVX512F__)
  if (D == 64) {
    switch (G) {
      case 1: return weighted_rows_lanes<1, 4>(rows, n, w, ld, out);
      case 2: return weighted_rows_lanes<2, 4>(rows, n, w, ld, out);
      case 3: return weighted_rows_lanes<3, 4>(rows, n, w, ld, out);
      case 4: return weighted_rows_lanes<4, 4>(rows, n, w, ld, out);
      default: break;
    }
  } else if (D == 128) {
    switch (G) {
      case 1: return weighted_rows_lanes<1, 8>(rows, n, w, ld, out);
      case 2: return weighted_rows_lanes<2, 8>(rows, n, w, ld, out);
      default: break;
    }
  }
#endif
  std::fill(out, out + G * D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch(rows[i + 8], D * 4);
    for (int64_t g = 0; g < G; ++g) axpy(w[g * ld + i], rows[i], out + g * D, D);
  }
}

// A key that orders (score, span) pairs as the zoom takes them: higher score first, then the earlier span.
// The float's bits are mapped so that unsigned order is numeric order (-inf lowest).
inline uint64_t order_key(float score, int64_t span) {
  score += 0.f;  // -0 and +0 alike, as they compare
  uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(span));
}

// The inputs of one request (batch position b).
struct Request {
  float* pages;  // [P, 2, block, Hkv, D]: each page's K rows, then its V rows
  const int64_t* table;  // [num_full / block rounded up, at least]: the page of every `block` rows
  int64_t block;
  int64_t num_full;
  const float* new_k;  // [Hkv, D]: written to row num_full - 1 first, or null
  const float* new_v;
  const void* summary_k;  // [S, Hkv, D] float or half (summary_half)
  const void* summary_v;
  bool summary_half;
  const int64_t* span_len;  // [S]
  int64_t num_spans;
  const void* centroid_k;  // [S, C, Hkv, D] half or float, or codes [S, Hkv, C, D / m] uint8
  bool centroid_half;
  int64_t code_bits;  // 0: centroids are half/float; else bits per code (m = 8 / bits codes per byte)
  const c10::Half* centroid_lo;  // [N, Hkv, D] (codes only): a range per group of spans
  const c10::Half* centroid_step;
  const int64_t* centroid_range;  // [S]: the range of each span
  const c10::Half* log_count;  // [S, Hkv, C], or null: centroid c is token c of its span (if it has one)
  int64_t num_centroids;
  const c10::Half* key_features;  // [S, H] or null: the learned term's scale per span and query head
  const float* coef_k;  // [P, Hkv, R], or the rows [P, Hkv, D] when `rows`
  const float* basis_k;  // [S, Hkv, R, D]
  const float* coef_v;
  const float* basis_v;
  const int64_t* row_offset;  // [S]
  int64_t rank;
  bool rows;  // the bases hold the span rows themselves (no basis)
  int64_t budget;
  int64_t whole_budget;  // the rows whole spans may take of budget
  float log_min_share;  // a span zoomed whole holds at least this log share of the request's span scores
  float fallback;  // a KV head whose rows read hold less than this share of a query's attention reads every row
  bool zoom_all;
  bool recall;  // the rows whole spans leave over go to single keys (every centroid one key)
};

// out[c] = log of the tokens centroid c of span s stands for (KV head kh), stored or implied (-inf: none).
inline void span_log_counts(const Request& r, int64_t s, int64_t kh, int64_t Hkv, int64_t C, float* out) {
  if (r.log_count) {
    to_float(r.log_count + (s * Hkv + kh) * C, out, C);
    return;
  }
  for (int64_t c = 0; c < C; ++c) out[c] = c < r.span_len[s] ? 0.f : kNegInf;
}

inline int64_t max_len(const Request& r) {
  int64_t longest = 0;
  for (int64_t s = 0; s < r.num_spans; ++s) longest = std::max(longest, r.span_len[s]);
  return longest;
}

// Row i's K (or V) for KV head kh in a request's pages.
inline float* full_row(const Request& r, int64_t i, int64_t kh, bool value, int64_t Hkv, int64_t D) {
  return r.pages + (((r.table[i / r.block] * 2 + value) * r.block + i % r.block) * Hkv + kh) * D;
}

const float* f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be contiguous float32");
  return t.data_ptr<float>();
}

const int64_t* i64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous(), name, " must be contiguous int64");
  return t.data_ptr<int64_t>();
}

}  // namespace

// q: [B, H, D] float32. Per request b (lists of B tensors): its full-resolution rows in pages
// row_pages [P_b, 2, block_b, Hkv, D] float32 (a page's K rows, then its V rows) with page_table [n_b] int64 (row i
// in page page_table[i / block_b]), of which the first num_full[b] rows ([B] int64) are attended; new_k/new_v
// [B, Hkv, D] float32 (or empty): each request's newest row, written to row num_full[b] - 1 before it is attended;
// summary_k/summary_v [S_b, Hkv, D] float32 or float16; span_len [S_b] int64; centroid_k [S_b, C_b, Hkv, D]
// float16 or float32, or codes [S_b, Hkv, D / m, C_b] uint8 at code_bits bits each (m = 8 / code_bits per byte,
// byte [j, c] holding centroid c's channels j + i * D / m in bits [i * code_bits, ...)) with centroid_lo/centroid_step
// [N_b, Hkv, D] float16 and centroid_range [S_b] int64 (span s's value = lo[range[s]] + step[range[s]] * code; empty
// lists when no request has codes); log_count [S_b, Hkv, C_b] float16, or empty when every centroid is one key; key_features [S_b, H] float16 (empty
// list: no learned term); coef_k/coef_v [P_b, Hkv, R_b] and basis_k/basis_v [S_b, Hkv, R_b, D]
// float32 (empty bases: coef_k/coef_v are the span rows [P_b, Hkv, D]); row_offset [S_b] int64. budgets [B] int64 zoom rows per KV head (a span costs
// |s| - 1), whole_budgets [B] int64 the most of them whole spans take, min_shares [B] float32 the least share of
// the request's span scores (a softmax over its eligible spans' group scores, per KV head) a span zoomed whole
// holds; fallbacks [B] float32: where keys are recalled, a KV head whose rows read (full rows, zoomed spans, recalled
// keys) hold less than this share of one of its query heads' attention (full rows' logits exact, every other key's
// its code logit) reads every span's rows instead (0: never); zoom_all [B] bool; recall_keys: the rows a request's whole spans leave over go to the best single keys
// of its other eligible spans, one row each (requests whose centroids are their keys: empty log_count), a key
// scored as its centroid's logit plus what its span's score adds to their logsumexp, and a summary then stands for
// its span's tokens not read. query_features [B, H, D] float32 or empty: the learned term of span s
// for head h is (query_features[b, h] . summary_k[s, h / G]) * key_features[s, h]; bias, threshold [H] float32 (a span is eligible for head h when its score > threshold[h]).
// Returns (out [B, H, D] float32, zoomed_spans [B] int64: the spans zoomed by any head, recalled_keys [B] int64:
// the single keys read, summed over KV heads, exact_heads [B] int64: the KV heads that read every row, per request).
std::vector<torch::Tensor> span_decode(
    const torch::Tensor& q, const std::vector<torch::Tensor>& row_pages, const std::vector<torch::Tensor>& page_table,
    const torch::Tensor& num_full, const torch::Tensor& new_k, const torch::Tensor& new_v,
    const std::vector<torch::Tensor>& summary_k, const std::vector<torch::Tensor>& summary_v,
    const std::vector<torch::Tensor>& span_len, const std::vector<torch::Tensor>& centroid_k,
    const std::vector<torch::Tensor>& log_count, const std::vector<torch::Tensor>& centroid_lo,
    const std::vector<torch::Tensor>& centroid_step, const std::vector<torch::Tensor>& centroid_range, int64_t code_bits,
    const std::vector<torch::Tensor>& key_features,
    const std::vector<torch::Tensor>& coef_k, const std::vector<torch::Tensor>& basis_k,
    const std::vector<torch::Tensor>& coef_v, const std::vector<torch::Tensor>& basis_v,
    const std::vector<torch::Tensor>& row_offset, const torch::Tensor& budgets, const torch::Tensor& whole_budgets,
    const torch::Tensor& min_shares, const torch::Tensor& fallbacks, const torch::Tensor& zoom_all,
    bool recall_keys, const torch::Tensor& query_features, const torch::Tensor& bias, const torch::Tensor& threshold,
    double scale, double score_scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(static_cast<int64_t>(row_pages.size()) == B && page_table.size() == row_pages.size() &&
                  summary_k.size() == row_pages.size() && summary_v.size() == row_pages.size() &&
                  span_len.size() == row_pages.size() && centroid_k.size() == row_pages.size() &&
                  log_count.size() == row_pages.size() && coef_k.size() == row_pages.size() &&
                  basis_k.size() == row_pages.size() && coef_v.size() == row_pages.size() &&
                  basis_v.size() == row_pages.size() && row_offset.size() == row_pages.size(),
              "every per-request list must have B = q.size(0) tensors");
  TORCH_CHECK(code_bits == 0 || ((code_bits == 2 || code_bits == 4 || code_bits == 8) &&
                                  static_cast<int64_t>(centroid_lo.size()) == B && centroid_step.size() == centroid_lo.size() &&
                                  centroid_range.size() == centroid_lo.size()),
              "code_bits must be 0, or 2, 4 or 8 with B centroid_lo, centroid_step and centroid_range tensors");
  const bool learned = !key_features.empty();
  TORCH_CHECK(!learned || static_cast<int64_t>(key_features.size()) == B, "key_features: B tensors or none");
  const int64_t Hkv = summary_k.empty() ? 1 : summary_k[0].size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "H must be a multiple of the KV heads");
  const int64_t G = H / Hkv;
  TORCH_CHECK(!learned || (query_features.dim() == 3 && query_features.size(0) == B && query_features.size(1) == H &&
                           query_features.size(2) == D),
              "query_features must be [B, H, D]");
  const float* qp = f32(q, "q");
  const float* qf = learned ? f32(query_features, "query_features") : nullptr;
  const float* bias_p = f32(bias, "bias");
  const float* thr_p = f32(threshold, "threshold");
  const int64_t* budget_p = i64(budgets, "budgets");
  const int64_t* whole_budget_p = i64(whole_budgets, "whole_budgets");
  const float* min_share_p = f32(min_shares, "min_shares");
  const float* fallback_p = f32(fallbacks, "fallbacks");
  TORCH_CHECK(zoom_all.scalar_type() == torch::kBool, "zoom_all must be bool");
  const bool* zoom_all_p = zoom_all.data_ptr<bool>();
  TORCH_CHECK(budgets.numel() == B && whole_budgets.numel() == B && min_shares.numel() == B &&
                  fallbacks.numel() == B && zoom_all.numel() == B,
              "budgets, whole_budgets, min_shares, fallbacks and zoom_all must have B entries");

  const int64_t* num_full_p = i64(num_full, "num_full");
  TORCH_CHECK(num_full.numel() == B, "num_full must have B entries");
  const bool appending = new_k.numel() > 0;
  TORCH_CHECK(!appending || (new_k.dim() == 3 && new_k.size(0) == B && new_k.size(1) == Hkv && new_k.size(2) == D &&
                             new_v.sizes() == new_k.sizes()),
              "new_k/new_v must be [B, Hkv, D] alike, or empty");
  const float* new_k_p = appending ? f32(new_k, "new_k") : nullptr;
  const float* new_v_p = appending ? f32(new_v, "new_v") : nullptr;
  std::vector<Request> reqs(B);
  std::vector<int64_t> span_offset(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    Request& r = reqs[b];
    const auto& pages = row_pages[b];
    r.pages = const_cast<float*>(f32(pages, "row_pages"));
    r.table = i64(page_table[b], "page_table");
    r.num_full = num_full_p[b];
    r.new_k = appending ? new_k_p + b * Hkv * D : nullptr;
    r.new_v = appending ? new_v_p + b * Hkv * D : nullptr;
    r.summary_half = summary_k[b].scalar_type() == torch::kHalf;
    TORCH_CHECK((r.summary_half || summary_k[b].scalar_type() == torch::kFloat32) &&
                    summary_v[b].scalar_type() == summary_k[b].scalar_type() && summary_k[b].is_contiguous() &&
                    summary_v[b].is_contiguous(),
                "summary_k/summary_v must be contiguous, both float32 or both float16");
    r.summary_k = summary_k[b].data_ptr();
    r.summary_v = summary_v[b].data_ptr();
    r.span_len = i64(span_len[b], "span_len");
    r.num_spans = span_len[b].numel();
    TORCH_CHECK(pages.dim() == 5 && pages.size(1) == 2 && pages.size(2) > 0 && pages.size(3) == Hkv &&
                    pages.size(4) == D,
                "row_pages must be [P, 2, block, Hkv, D]");
    r.block = pages.size(2);
    TORCH_CHECK(r.num_full >= (appending ? 1 : 0) && r.num_full <= page_table[b].numel() * r.block,
                "num_full must be within the rows of page_table's pages (at least 1 with new rows)");
    for (int64_t i = 0; i < (r.num_full + r.block - 1) / r.block; ++i)
      TORCH_CHECK(r.table[i] >= 0 && r.table[i] < pages.size(0), "page_table entries must be pages of row_pages");
    TORCH_CHECK(summary_k[b].dim() == 3 && summary_k[b].size(0) == r.num_spans && summary_k[b].size(1) == Hkv &&
                    summary_k[b].size(2) == D && summary_v[b].sizes() == summary_k[b].sizes(),
                "summary_k/summary_v must be [S, Hkv, D] with S = span_len.numel()");
    const auto& ck = centroid_k[b];
    r.code_bits = ck.scalar_type() == torch::kByte ? code_bits : 0;
    TORCH_CHECK(ck.scalar_type() != torch::kByte || code_bits > 0, "uint8 centroid codes need code_bits > 0");
    if (r.code_bits) {
      const int64_t m = 8 / r.code_bits;
      TORCH_CHECK(ck.is_contiguous() && ck.dim() == 4 && ck.size(0) == r.num_spans && ck.size(1) == Hkv &&
                      ck.size(2) * m == D,
                  "centroid codes must be contiguous [S, Hkv, D / m, C] uint8, m = 8 / code_bits");
      const auto& lo = centroid_lo[b];
      const auto& st = centroid_step[b];
      TORCH_CHECK(lo.scalar_type() == torch::kHalf && st.scalar_type() == torch::kHalf && lo.is_contiguous() &&
                      st.is_contiguous() && lo.numel() % (Hkv * D) == 0 && st.numel() == lo.numel(),
                  "centroid_lo/centroid_step must be contiguous float16 [N, Hkv, D]");
      r.centroid_lo = lo.data_ptr<c10::Half>();
      r.centroid_step = st.data_ptr<c10::Half>();
      TORCH_CHECK(centroid_range[b].numel() == r.num_spans, "centroid_range must be [S] int64");
      r.centroid_range = i64(centroid_range[b], "centroid_range");
      const int64_t ranges = lo.numel() / (Hkv * D);
      for (int64_t s = 0; s < r.num_spans; ++s) {
        TORCH_CHECK(r.centroid_range[s] >= 0 && r.centroid_range[s] < ranges, "centroid_range out of [0, N)");
      }
      r.num_centroids = ck.size(3);
    } else {
      TORCH_CHECK(ck.is_contiguous() && ck.dim() == 4 && ck.size(0) == r.num_spans && ck.size(2) == Hkv &&
                      ck.size(3) == D,
                  "centroid_k must be contiguous [S, C, Hkv, D]");
      TORCH_CHECK(ck.scalar_type() == torch::kHalf || ck.scalar_type() == torch::kFloat32,
                  "centroid_k must be float16 or float32 (or uint8 codes with code_bits > 0)");
      r.num_centroids = ck.size(1);
    }
    r.centroid_half = ck.scalar_type() == torch::kHalf;
    r.centroid_k = ck.data_ptr();
    const bool counts = log_count[b].numel() > 0;
    TORCH_CHECK(!counts || (log_count[b].scalar_type() == torch::kHalf && log_count[b].is_contiguous() &&
                            log_count[b].numel() == r.num_spans * Hkv * r.num_centroids),
                "log_count must be contiguous float16 [S, Hkv, C] or empty");
    TORCH_CHECK(counts || r.num_spans == 0 || r.num_centroids >= max_len(r), "log_count may be empty only when "
                "every span has at most C tokens (each centroid one key)");
    r.log_count = counts ? log_count[b].data_ptr<c10::Half>() : nullptr;
    if (learned) {
      TORCH_CHECK(key_features[b].scalar_type() == torch::kHalf && key_features[b].is_contiguous(),
                  "key_features must be contiguous float16");
      TORCH_CHECK(zoom_all_p[b] || (key_features[b].dim() == 2 && key_features[b].size(0) == r.num_spans &&
                                    key_features[b].size(1) == H),
                  "key_features must be [S, H] (any shape for a request that zooms every span)");
      r.key_features = key_features[b].data_ptr<c10::Half>();
    }
    r.coef_k = f32(coef_k[b], "coef_k");
    r.coef_v = f32(coef_v[b], "coef_v");
    r.row_offset = i64(row_offset[b], "row_offset");
    r.rows = basis_k[b].numel() == 0;
    TORCH_CHECK(r.rows == (basis_v[b].numel() == 0), "keys and values must both be rows or both factors");
    r.basis_k = r.rows ? nullptr : f32(basis_k[b], "basis_k");
    r.basis_v = r.rows ? nullptr : f32(basis_v[b], "basis_v");
    r.rank = r.rows ? D : basis_k[b].size(2);
    TORCH_CHECK(coef_k[b].size(2) == r.rank && coef_v[b].size(2) == r.rank &&
                    (r.rows || basis_v[b].size(2) == r.rank),
                "keys and values must share the rank (rows: head_dim)");
    r.budget = budget_p[b];
    r.whole_budget = std::min(whole_budget_p[b], r.budget);
    r.log_min_share = std::log(min_share_p[b]);
    r.fallback = fallback_p[b];
    r.zoom_all = zoom_all_p[b];
    r.recall = recall_keys && !r.zoom_all && r.log_count == nullptr;
    span_offset[b + 1] = span_offset[b] + r.num_spans;
  }
  auto out = torch::empty({B, H, D}, q.options());
  float* out_p = out.data_ptr<float>();
  std::vector<char> zoom_flags(span_offset[B] * Hkv, 0);  // [sum S_b, Hkv]: each task writes its own head
  std::vector<int64_t> recalled_keys(B * Hkv, 0);  // [B, Hkv]: keys read one by one
  std::vector<char> exact_heads(B * Hkv, 0);  // [B, Hkv]: read every row (exact fallback)
  const float fscale = static_cast<float>(scale), fscore = static_cast<float>(score_scale);

  // Tasks differ in cost (prompt lengths, spans, zoomed rows): handed out one at a time, not in
  // equal blocks. Each is computed by one thread alone, so results do not depend on the schedule.
  const int64_t tasks = B * Hkv;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> cent(D), step(D), unshift(D), qstep(G * D), base(G), val, acc_c, lcount, learned_term,
        group, logits, scores, lse, sums, qb, acc, key_logit, key_shift, rebuilt, sum_k, sum_v,
        full_logit;
    const std::vector<float> zero_row(D, 0.f);
    std::vector<const float*> krows, vrows;
    std::vector<uint64_t> order, picks;
    std::vector<char> zoomed, key_read;
    std::vector<int64_t> key_span, key_token, span_read;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / Hkv, kh = task % Hkv;
      const Request& r = reqs[b];
      const int64_t S = r.num_spans, C = r.num_centroids, R = r.rank;
      const float* qg = qp + (b * H + kh * G) * D;  // the G query heads of this KV head
      if (r.new_k) {
        std::copy(r.new_k + kh * D, r.new_k + (kh + 1) * D, full_row(r, r.num_full - 1, kh, false, Hkv, D));
        std::copy(r.new_v + kh * D, r.new_v + (kh + 1) * D, full_row(r, r.num_full - 1, kh, true, Hkv, D));
      }
      if (r.code_bits) {
        val.resize(C);
        acc_c.resize(G * C);
        lcount.resize(C);
      }
      // This KV head's summary rows as floats: row s at summary_k_f + s * summary_ld (float16 ones converted).
      const float *summary_k_f, *summary_v_f;
      int64_t summary_ld;
      if (r.summary_half) {
        sum_k.resize(S * D);
        sum_v.resize(S * D);
        const c10::Half* hk = static_cast<const c10::Half*>(r.summary_k);
        const c10::Half* hv = static_cast<const c10::Half*>(r.summary_v);
        for (int64_t s = 0; s < S; ++s) {
          to_float(hk + (s * Hkv + kh) * D, sum_k.data() + s * D, D);
          to_float(hv + (s * Hkv + kh) * D, sum_v.data() + s * D, D);
        }
        summary_k_f = sum_k.data();
        summary_v_f = sum_v.data();
        summary_ld = D;
      } else {
        summary_k_f = static_cast<const float*>(r.summary_k) + kh * D;
        summary_v_f = static_cast<const float*>(r.summary_v) + kh * D;
        summary_ld = Hkv * D;
      }

      // 1. Span scores: logsumexp over centroids (+ the learned term); the group's best eligible head.
      group.assign(S, kNegInf);
      if (!r.zoom_all) {
        // raw[(s * G + g) * C + c] = q_g . c_sc * score_scale + log n_sc; then a logsumexp over c.
        scores.resize(S * G * C);
        lse.resize(S * G);
        sums.resize(S * G);
        if (r.recall) key_logit.resize(S * G * C);
        const int64_t csize = r.centroid_half ? 2 : 4;
        if (r.code_bits) {
          const int64_t Dm = D * r.code_bits / 8;
          for (int64_t d = 0; d < D; ++d) unshift[d] = std::ldexp(1.f, -static_cast<int>(d / Dm * r.code_bits));
        }
        for (int64_t s = 0; s < S && r.code_bits; ++s) {
          // q . (lo + step * code) = q . lo + (q * step) . code. A span's codes are [D / m, C]: the C
          // centroids side by side, so every channel updates all C scores in vector lanes.
          const int64_t bits = r.code_bits, Dm = D * bits / 8;
          const uint8_t* codes = static_cast<const uint8_t*>(r.centroid_k) + (s * Hkv + kh) * Dm * C;
          if (s + 2 < S) {
            prefetch(codes + 2 * Hkv * Dm * C, Dm * C);
            prefetch(r.centroid_lo + (r.centroid_range[s + 2] * Hkv + kh) * D, D * 2);
            prefetch(r.centroid_step + (r.centroid_range[s + 2] * Hkv + kh) * D, D * 2);
            if (r.log_count) prefetch(r.log_count + ((s + 2) * Hkv + kh) * C, C * 2);
          }
          to_float(r.centroid_lo + (r.centroid_range[s] * Hkv + kh) * D, cent.data(), D);
          to_float(r.centroid_step + (r.centroid_range[s] * Hkv + kh) * D, step.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            for (int64_t d = 0; d < D; ++d) qstep[g * D + d] = qg[g * D + d] * step[d] * unshift[d];
          }
          // Centroids past the span's last non-empty one (its tokens, when every key is a centroid)
          // count 0: they are neither scored nor summed.
          span_log_counts(r, s, kh, Hkv, C, lcount.data());
          int64_t Ce = C;
          while (Ce > 1 && lcount[Ce - 1] == kNegInf) --Ce;
          code_dots(codes, qstep.data(), acc_c.data(), val.data(), Dm, C, std::min<int64_t>(C, (Ce + 15) / 16 * 16),
                    G, D, static_cast<int>(bits));
          for (int64_t g = 0; g < G; ++g) base[g] = dot(qg + g * D, cent.data(), D);
          if (r.recall) {  // each key's logit, for the keys recalled one by one
            for (int64_t g = 0; g < G; ++g) {
              float* dst = key_logit.data() + (s * G + g) * C;
              const float* a = acc_c.data() + g * C;
              for (int64_t c = 0; c < Ce; ++c) dst[c] = (base[g] + a[c]) * fscore + lcount[c];
              std::fill(dst + Ce, dst + C, kNegInf);
            }
          }
#if defined(__AVX512F__)
          if (C % 16 == 0) {  // the logsumexp right away, from registers (but its log)
            for (int64_t g = 0; g < G; ++g) {
              lse[s * G + g] = span_max_sumexp16(acc_c.data() + g * C, lcount.data(), base[g], fscore,
                                                 (Ce + 15) / 16 * 16, &sums[s * G + g]);
            }
            continue;
          }
#endif
          for (int64_t g = 0; g < G; ++g) {
            const float bg = base[g];
            const float* a = acc_c.data() + g * C;
            float* dst = scores.data() + (s * G + g) * C;
#pragma omp simd
            for (int64_t c = 0; c < Ce; ++c) dst[c] = (bg + a[c]) * fscore + lcount[c];
            std::fill(dst + Ce, dst + C, kNegInf);
          }
        }
        for (int64_t s = 0; s < S && !r.code_bits; ++s) {
          if (s + 4 < S) {
            for (int64_t c = 0; c < C; ++c) {
              prefetch(static_cast<const char*>(r.centroid_k) + (((s + 4) * C + c) * Hkv + kh) * D * csize, D * csize);
            }
          }
          for (int64_t c = 0; c < C; ++c) {
            const int64_t at = ((s * C + c) * Hkv + kh) * D;
            if (r.centroid_half) {
              to_float(static_cast<const c10::Half*>(r.centroid_k) + at, cent.data(), D);
            } else {
              to_float(static_cast<const float*>(r.centroid_k) + at, cent.data(), D);
            }
            const float lc = r.log_count ? half_to_float(r.log_count[(s * Hkv + kh) * C + c])
                                         : (c < r.span_len[s] ? 0.f : kNegInf);
            for (int64_t g = 0; g < G; ++g) scores[(s * G + g) * C + c] = dot(qg + g * D, cent.data(), D) * fscore + lc;
          }
        }
        // Every (span, head) has a centroid with a finite logit (a non-empty cluster): the
        // shifted sums below are in [1, C].
        const int64_t SG = S * G, SGC = S * G * C;
        float* sc = scores.data();
        float* mx = lse.data();
#if defined(__AVX512F__)
        const bool lse_done = r.code_bits && C % 16 == 0;
#else
        const bool lse_done = false;
#endif
        if (!lse_done) {
          if (r.recall && !r.code_bits) std::copy(sc, sc + SGC, key_logit.data());
          for (int64_t i = 0; i < SG; ++i) {
            float top = kNegInf;
#pragma omp simd reduction(max : top)
            for (int64_t c = 0; c < C; ++c) top = sc[i * C + c] > top ? sc[i * C + c] : top;
            mx[i] = top;
            for (int64_t c = 0; c < C; ++c) sc[i * C + c] -= mx[i];
          }
          // one flat loop: whole vectors whatever C is
#pragma omp simd
          for (int64_t i = 0; i < SGC; ++i) sc[i] = exp_poly(sc[i]);
          for (int64_t i = 0; i < SG; ++i) {
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t c = 0; c < C; ++c) sum += sc[i * C + c];
            sums[i] = sum;
          }
        }
        const float* sm = sums.data();
#pragma omp simd
        for (int64_t i = 0; i < SG; ++i) mx[i] += log_poly(sm[i]);
        if (learned) {
          // (W^T W q / sqrt(d_r)) . k_bar / |W k_bar|: the summary keys the attention reads anyway
          learned_term.resize(G * S);
          const float* qfg = qf + (b * H + kh * G) * D;
          for (int64_t s = 0; s < S; ++s) {
            const float* ks = summary_k_f + s * summary_ld;
            for (int64_t g = 0; g < G; ++g) {
              learned_term[g * S + s] = dot(qfg + g * D, ks, D) * half_to_float(r.key_features[s * H + kh * G + g]);
            }
          }
        }
        if (r.recall) key_shift.assign(S * G, kNegInf);
        for (int64_t s = 0; s < S; ++s) {
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kh * G + g;
            float score = lse[s * G + g];
            if (learned) score += learned_term[g * S + s];
            score += bias_p[h];
            if (score > thr_p[h]) {
              group[s] = std::max(group[s], score);
              // a key's score: its logit plus what the span's score adds to their logsumexp
              if (r.recall) key_shift[s * G + g] = score - lse[s * G + g];
            }
          }
        }
      }
      // 2. Zoom: spans by descending group score (ties: earlier span first) while the rows fit.
      zoomed.assign(S, r.zoom_all ? 1 : 0);
      key_span.clear();
      key_token.clear();
      if (!r.zoom_all) {
        // A max-heap of (score, span) keys, popped only as far as the budget goes (a few of S).
        order.resize(S);
        for (int64_t s = 0; s < S; ++s) order[s] = order_key(group[s], s);
        std::make_heap(order.begin(), order.end());
        // a span's log share of the request's span scores: its score less their logsumexp
        float total = kNegInf;
        if (r.log_min_share > kNegInf) {
          float top = kNegInf;
          for (int64_t s = 0; s < S; ++s) top = std::max(top, group[s]);
          if (top > kNegInf) {
            float sum = 0.f;
            for (int64_t s = 0; s < S; ++s) sum += std::exp(group[s] - top);
            total = top + std::log(sum);
          }
        }
        int64_t rows = 0;
        for (auto end = order.end(); end != order.begin(); --end) {
          std::pop_heap(order.begin(), end);
          const int64_t s = static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(*(end - 1)));
          if (rows + r.span_len[s] - 1 > r.whole_budget || group[s] == kNegInf) break;
          if (r.log_min_share > kNegInf && group[s] - total < r.log_min_share) break;
          rows += r.span_len[s] - 1;
          zoomed[s] = 1;
        }
        // 2b. The rows left over: the best single keys of the spans not zoomed (a key: its best eligible
        // head's score), ties to the earlier key, one row each.
        const int64_t left = r.budget - rows;
        if (r.recall && left > 0) {
          picks.clear();
          for (int64_t s = 0; s < S; ++s) {
            if (zoomed[s] || group[s] == kNegInf) continue;
            for (int64_t c = 0; c < r.span_len[s]; ++c) {
              float best = kNegInf;
              for (int64_t g = 0; g < G; ++g) {
                best = std::max(best, key_logit[(s * G + g) * C + c] + key_shift[s * G + g]);
              }
              if (best > kNegInf) picks.push_back(order_key(best, s * C + c));
            }
          }
          const int64_t k = std::min<int64_t>(left, static_cast<int64_t>(picks.size()));
          std::nth_element(picks.begin(), picks.begin() + k, picks.end(), std::greater<uint64_t>());
          std::sort(picks.begin(), picks.begin() + k, [](uint64_t a, uint64_t b) {
            return static_cast<uint32_t>(a) > static_cast<uint32_t>(b);  // by key index: span, then token
          });
          for (int64_t i = 0; i < k; ++i) {
            const int64_t at = static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(picks[i]));
            key_span.push_back(at / C);
            key_token.push_back(at % C);
          }
        }
      }
      // 2c. Exact fallback: the share of each query head's estimated attention on the rows read; below the
      // request's fallback for any of them, every span is read.
      if (r.recall && r.fallback > 0.f) {
        key_read.assign(S * C, 0);
        for (size_t i = 0; i < key_span.size(); ++i) key_read[key_span[i] * C + key_token[i]] = 1;
        full_logit.resize(r.num_full);
        float least = 1.f;
        for (int64_t g = 0; g < G; ++g) {
          // exp-sums of the rows read and of the keys not read, both against the largest logit of all (the share
          // read is their ratio), in two passes so that the sums vectorise
          float top = kNegInf;
          for (int64_t i = 0; i < r.num_full; ++i) {
            full_logit[i] = dot(qg + g * D, full_row(r, i, kh, false, Hkv, D), D) * fscale;
            top = std::max(top, full_logit[i]);
          }
          for (int64_t s = 0; s < S; ++s) {
            const float* kl = key_logit.data() + (s * G + g) * C;
            for (int64_t c = 0; c < r.span_len[s]; ++c) top = std::max(top, kl[c]);
          }
          if (top == kNegInf) continue;
          float read = 0.f, miss = 0.f;
          for (int64_t i = 0; i < r.num_full; ++i) read += exp_poly(full_logit[i] - top);
          for (int64_t s = 0; s < S; ++s) {
            const float* kl = key_logit.data() + (s * G + g) * C;
            const int64_t len = r.span_len[s];
            if (zoomed[s]) {
#pragma omp simd reduction(+ : read)
              for (int64_t c = 0; c < len; ++c) read += exp_poly(kl[c] - top);
              continue;
            }
            const char* kr = key_read.data() + s * C;
#pragma omp simd reduction(+ : read, miss)
            for (int64_t c = 0; c < len; ++c) {
              const float e = exp_poly(kl[c] - top);
              read += kr[c] ? e : 0.f;
              miss += kr[c] ? 0.f : e;
            }
          }
          if (miss == 0.f) continue;
          least = std::min(least, read / (read + miss));
        }
        if (least < r.fallback) {
          std::fill(zoomed.begin(), zoomed.end(), 1);
          key_span.clear();
          key_token.clear();
          exact_heads[b * Hkv + kh] = 1;
        }
      }
      int64_t zoom_tokens = 0, summaries = 0;
      const int64_t keys_read = static_cast<int64_t>(key_span.size());
      recalled_keys[b * Hkv + kh] = keys_read;
      span_read.assign(S, 0);
      for (int64_t i = 0; i < keys_read; ++i) span_read[key_span[i]] += 1;
      for (int64_t s = 0; s < S; ++s) {
        if (zoomed[s]) {
          zoom_flags[(span_offset[b] + s) * Hkv + kh] = 1;
          zoom_tokens += r.span_len[s];
        } else if (span_read[s] < r.span_len[s]) {
          summaries += 1;
        }
      }
      // 3. Logits of every row this KV head's queries attend: full rows, summaries of the spans
      // not zoomed (standing for their tokens not read), zoomed tokens and recalled keys (their rows in
      // place, or q . k = (q B^T) . c through the span's factors for zoomed spans, keys rebuilt).
      const int64_t n = r.num_full + summaries + zoom_tokens + keys_read;
      krows.clear();
      vrows.clear();
      for (int64_t i = 0; i < r.num_full; ++i) {
        krows.push_back(full_row(r, i, kh, false, Hkv, D));
        vrows.push_back(full_row(r, i, kh, true, Hkv, D));
      }
      for (int64_t s = 0; s < S; ++s) {
        if (zoomed[s] || span_read[s] == r.span_len[s]) continue;
        krows.push_back(summary_k_f + s * summary_ld);
        vrows.push_back(summary_v_f + s * summary_ld);
      }
      for (int64_t s = 0; s < S && r.rows; ++s) {
        if (!zoomed[s]) continue;
        for (int64_t t = 0; t < r.span_len[s]; ++t) {
          krows.push_back(r.coef_k + ((r.row_offset[s] + t) * Hkv + kh) * D);
          vrows.push_back(r.coef_v + ((r.row_offset[s] + t) * Hkv + kh) * D);
        }
      }
      if (!r.rows) rebuilt.resize(2 * keys_read * D);
      for (int64_t i = 0; i < keys_read; ++i) {
        const int64_t s = key_span[i], row = (r.row_offset[s] + key_token[i]) * Hkv + kh;
        if (r.rows) {
          krows.push_back(r.coef_k + row * D);
          vrows.push_back(r.coef_v + row * D);
          continue;
        }
        // a recalled key's rows rebuilt from its span's factors: c B
        float* k_row = rebuilt.data() + 2 * i * D;
        float* v_row = k_row + D;
        std::fill(k_row, k_row + 2 * D, 0.f);
        for (int64_t j = 0; j < R; ++j) {
          axpy(r.coef_k[row * R + j], r.basis_k + ((s * Hkv + kh) * R + j) * D, k_row, D);
          axpy(r.coef_v[row * R + j], r.basis_v + ((s * Hkv + kh) * R + j) * D, v_row, D);
        }
        krows.push_back(k_row);
        vrows.push_back(v_row);
      }
      const int64_t direct = static_cast<int64_t>(krows.size());  // rows read in place
      while (krows.size() % 16) krows.push_back(zero_row.data());
      logits.resize(G * n);
      qb.resize(G * R);
      acc.resize(G * R);
      row_logits(krows.data(), vrows.data(), direct, qg, G, D, fscale, logits.data(), n);
      {
        // a summary stands for its span's tokens not read
        int64_t at = r.num_full;
        for (int64_t s = 0; s < S; ++s) {
          if (zoomed[s] || span_read[s] == r.span_len[s]) continue;
          const float bias_len = std::log(static_cast<float>(r.span_len[s] - span_read[s]));
          for (int64_t g = 0; g < G; ++g) logits[g * n + at] += bias_len;
          ++at;
        }
      }
      int64_t at = direct;
      for (int64_t s = 0; s < S && !r.rows; ++s) {
        if (!zoomed[s]) continue;
        const float* basis = r.basis_k + (s * Hkv + kh) * R * D;
        for (int64_t k = 0; k < R; ++k) {
          for (int64_t g = 0; g < G; ++g) qb[g * R + k] = dot(basis + k * D, qg + g * D, D) * fscale;
        }
        for (int64_t t = 0; t < r.span_len[s]; ++t, ++at) {
          const float* c = r.coef_k + ((r.row_offset[s] + t) * Hkv + kh) * R;
          for (int64_t g = 0; g < G; ++g) logits[g * n + at] = dot(c, qb.data() + g * R, R);
        }
      }
      // 4. Softmax and the weighted sum of values (zoomed values through their factors:
      // p V = (p C_v) B_v).
      for (int64_t g = 0; g < G; ++g) {
        float* lg = logits.data() + g * n;
        const float m = *std::max_element(lg, lg + n);
        float den = 0.f;
#pragma omp simd reduction(+ : den)
        for (int64_t i = 0; i < n; ++i) {
          lg[i] = exp_poly(lg[i] - m);
          den += lg[i];
        }
        // normalise the weights now: the value sums below are then the output
        const float inv = 1.f / den;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) lg[i] *= inv;
      }
      float* og = out_p + (b * H + kh * G) * D;  // the group's G output rows
      weighted_rows(vrows.data(), direct, logits.data(), n, G, D, og);
      at = direct;
      for (int64_t s = 0; s < S && !r.rows; ++s) {
        if (!zoomed[s]) continue;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < r.span_len[s]; ++t, ++at) {
          const float* c = r.coef_v + ((r.row_offset[s] + t) * Hkv + kh) * R;
          for (int64_t g = 0; g < G; ++g) axpy(logits[g * n + at], c, acc.data() + g * R, R);
        }
        const float* basis = r.basis_v + (s * Hkv + kh) * R * D;
        for (int64_t k = 0; k < R; ++k) {
          for (int64_t g = 0; g < G; ++g) axpy(acc[g * R + k], basis + k * D, og + g * D, D);
        }
      }
    }
  }
  auto zoomed_spans = torch::zeros({B}, q.options().dtype(torch::kInt64));
  auto recalled = torch::zeros({B}, q.options().dtype(torch::kInt64));
  auto exact = torch::zeros({B}, q.options().dtype(torch::kInt64));
  int64_t* zs = zoomed_spans.data_ptr<int64_t>();
  int64_t* rk = recalled.data_ptr<int64_t>();
  int64_t* ex = exact.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = span_offset[b]; s < span_offset[b + 1]; ++s) {
      zs[b] += std::any_of(zoom_flags.begin() + s * Hkv, zoom_flags.begin() + (s + 1) * Hkv, [](char z) { return z; });
    }
    rk[b] = std::accumulate(recalled_keys.begin() + b * Hkv, recalled_keys.begin() + (b + 1) * Hkv, int64_t{0});
    ex[b] = std::count(exact_heads.begin() + b * Hkv, exact_heads.begin() + (b + 1) * Hkv, 1);
  }
  return {out, zoomed_spans, recalled, exact};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Named arguments only (keyword-only in Python): 32 of them, several of the same type.
  m.def("span_decode", &span_decode, "sekv decode attention of many compressed requests, one layer (CPU)", py::kw_only(),
        py::arg("q"), py::arg("row_pages"), py::arg("page_table"), py::arg("num_full"), py::arg("new_k"),
        py::arg("new_v"), py::arg("summary_k"), py::arg("summary_v"), py::arg("span_len"), py::arg("centroid_k"),
        py::arg("log_count"), py::arg("centroid_lo"), py::arg("centroid_step"), py::arg("centroid_range"),
        py::arg("code_bits"),
        py::arg("key_features"), py::arg("coef_k"), py::arg("basis_k"), py::arg("coef_v"), py::arg("basis_v"),
        py::arg("row_offset"), py::arg("budgets"), py::arg("whole_budgets"), py::arg("min_shares"), py::arg("fallbacks"), py::arg("zoom_all"), py::arg("recall_keys"),
        py::arg("query_features"), py::arg("bias"),
        py::arg("threshold"), py::arg("scale"), py::arg("score_scale"));
}
