// lmlab's CPU kernels for weight-only quantized linear layers at few rows (decode):
// y (M, N) = x (M, K) @ w_hat.T with w_hat the dequantized (N, K) weight of lmlab.nn.quant.
//
// Legend: M rows of x (1..8, more are refused: Python dequantizes then), N out_features,
// K in_features (already padded to a multiple of G by the caller), G group size.
//   int8: q (N, K) int8, s (N, K/G) float32:           w_hat = q * s
//   int4: p (N, K/2) uint8, s, z (N, K/G) float32:     w_hat = (nibble - 8) * s + z
//         byte j of a row holds column 2j in its low nibble, 2j+1 in its high nibble (the stored
//         form of lmlab.nn.quant.pack_int4), so the little-endian uint32 at byte 4i holds columns
//         8i..8i+7 in nibbles 0..7: one broadcast load, a per-lane shift by 0, 4, .., 28 and a mask
//         give 8 codes in 8 int32 lanes.
// Each output row's weights are dequantized once to float32 (8 at a time) and fused-multiply-
// added into M float32 accumulators; rows are split over threads with at::parallel_for.
// Built with -mavx2 -mfma where the CPU has them (the intrinsics below), else the plain loops;
// with -mavx512f too where it has AVX-512, int4 groups are read 16 codes at a time (32 per step,
// two accumulator chains) before the AVX2 loop takes what is left: 1.07-1.27x the AVX2 path
// per layer at batch 1-2 (SmolLM2's shapes, one thread, loaded Xeon; docs/quantization.md).
// With AVX-512 the common groups have wider paths, 4 output rows per pass sharing the loads of x
// and one 4-row horizontal sum: int4 with G % 32 == 0 ("int4 x float32" below) and int8 with
// G % 16 == 0 ("int8 x float32"), 2.3-3.2x the paths above per layer.
//
// lmlab_a8_mm (act_bits = 8, llama.cpp's Q8_0 x Q4_1 / Q8_0 idea): x is quantized to int8 per
// block of 32 columns first and each block's product is an integer dot product (AVX512-VNNI or
// AVX-VNNI dpbusd where the CPU has it, AVX2 maddubs + madd otherwise, plain loops without AVX2),
// scaled by weight scale x activation scale in float32; the weight stream is software-prefetched.
// See "int8 activations" below; with AVX512-VNNI + AVX512BW, int4 and the usual groups take the
// "4 blocks per 512-bit step" path and int8 with G % 32 == 0 the "2 blocks per 512-bit step" one
// (4 output rows per pass each, x quantized with AVX-512).
//
// Threads: output rows in contiguous ranges of at least LMLAB_MIN_TASK weights (64K: decode's
// 576 x 576 layer is split in two halves on 2 threads, 1.5-1.7x one thread from memory on a
// quiet machine; on a machine with more busy threads than cores a descheduled worker stalls the
// call for a time slice, which 1M-weight tasks, the earlier setting, avoided for small layers).
// Every row's float32 sum is computed in the same order whatever range holds it, so the results
// do not depend on the thread count.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LMLAB_AVX2 1
#else
#define LMLAB_AVX2 0
#endif
#if LMLAB_AVX2 && defined(__AVX512F__)
#define LMLAB_AVX512 1
#else
#define LMLAB_AVX512 0
#endif
// The u8 x s8 -> s32 dot product of the int8-activation kernels: 1 AVX512-VNNI (256-bit form,
// needs AVX512VL), 2 AVX-VNNI, 0 AVX2's maddubs + madd (exact here: |u s| pair sums <= 32258).
#if LMLAB_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LMLAB_VNNI 1
#elif LMLAB_AVX2 && defined(__AVXVNNI__)
#define LMLAB_VNNI 2
#else
#define LMLAB_VNNI 0
#endif
// Two blocks per 512-bit dpbusd where the CPU has AVX512-VNNI and AVX512BW (byte masks).
#if LMLAB_AVX512 && LMLAB_VNNI == 1 && defined(__AVX512BW__)
#define LMLAB_VNNI512 1
#else
#define LMLAB_VNNI512 0
#endif

namespace {

constexpr int64_t kMaxRows = 8;

inline float sum8(const float* v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

#if LMLAB_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Independent accumulator chains per row of x: an FMA's latency is ~4-5 cycles, so one chain
// (M = 1) would wait on itself; M chains of M rows give the same overlap from M >= 4.
template <int M>
constexpr int kChains = M >= 4 ? 1 : (M == 1 ? 4 : 2);

// 8 int4 codes (columns c..c+7 from the uint32 at src) as 8 floats
inline __m256 nibbles8(const uint8_t* src, __m256i shifts, __m256i mask) {
  int32_t word;
  std::memcpy(&word, src, 4);
  __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
}

inline __m256 int8x8(const int8_t* src) {
  int64_t word;
  std::memcpy(&word, src, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(word)));
}
#endif

// The partial sums of one output row for M rows of x: with AVX2, kChains<M> vector accumulator
// chains per row (acc); always, 8 scalar partial sums per row for the columns the vector loops
// leave (tail, indexed by column % 8: rounding like AVX2). finish() writes each row's total.
template <int M>
struct RowSums {
  float tail[M][8] = {};
#if LMLAB_AVX2
  __m256 acc[M][kChains<M>];

  RowSums() {
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < kChains<M>; ++u) acc[m][u] = _mm256_setzero_ps();
  }
#endif

  void finish(float* out) const {
    for (int m = 0; m < M; ++m) {
#if LMLAB_AVX2
      __m256 a = acc[m][0];
      for (int u = 1; u < kChains<M>; ++u) a = _mm256_add_ps(a, acc[m][u]);
      out[m] = hsum(a) + sum8(tail[m]);
#else
      out[m] = sum8(tail[m]);
#endif
    }
  }
};

#if LMLAB_AVX512
// 16 int4 codes (columns c..c+15 from the 8 bytes at src) as 16 floats: dwords 0 and 1 of the
// bytes spread to lanes 0-7 and 8-15, each shifted right by 4 x (lane mod 8) and masked.
inline __m512 nibbles16(const uint8_t* src, __m512i idx, __m512i shifts, __m512i mask) {
  int64_t word;
  std::memcpy(&word, src, 8);
  const __m512i v = _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(_mm_cvtsi64_si128(word)));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, shifts), mask));
}

// (16 lanes) -> (8 lanes): the sum of its two halves.
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The 4 horizontal sums of a[0..3] in lanes 0..3.
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // each 128-bit lane of x01: (r0, r1, r0, r1); of x23: (r2, r3, r2, r3)
  const __m512 y = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))));
  const __m256 h = fold16(y);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The sum of a's lanes in hsum4's order: a row gets the same float32 total whether it is reduced
// alone or with 3 others (threads' row ranges do not change the numbers).
inline float hsum16(__m512 a) { return _mm_cvtss_f32(hsum4(a, a, a, a)); }

// out[r * M + m] = the lanes of acc[r][m] summed (hsum4's order whether R is 4 or not)
template <int M, int R>
inline void reduce_rows(__m512 (&acc)[R][M], float* out) {
  if constexpr (R == 4) {
    for (int m = 0; m < M; ++m) {
      alignas(16) float t[4];
      _mm_store_ps(t, hsum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
      for (int r = 0; r < 4; ++r) out[r * M + m] = t[r];
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) out[r * M + m] = hsum16(acc[r][m]);
  }
}

// The offset term of asymmetric int4 rows, 16 groups at a time: acc[r][m] += (z - 8 s)[r, g] *
// xs[m, g] over the ng groups (xs (M, ng): each group's sum of x, or of the rounded x for +a8).
template <int M, int R>
inline void add_offsets(const float* xs, int64_t ng, const float* s, const float* z,
                        __m512 (&acc)[R][M]) {
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int64_t g = 0; g < ng; g += 16) {
    const __mmask16 k = ng - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (ng - g)) - 1);
    __m512 xg[M];
    for (int m = 0; m < M; ++m) xg[m] = _mm512_maskz_loadu_ps(k, xs + m * ng + g);
    for (int r = 0; r < R; ++r) {
      const __m512 zc = _mm512_fnmadd_ps(eight, _mm512_maskz_loadu_ps(k, s + r * ng + g),
                                         _mm512_maskz_loadu_ps(k, z + r * ng + g));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(zc, xg[m], acc[r][m]);
    }
  }
}
#endif

// Output rows [begin, end) of y (M, N), R = 4 / 2 / 1 rows a pass for M <= 2 / <= 4 / more (the
// accumulators stay in registers), the rest one by one: rows(std::integral_constant<int, R>, n,
// out) writes rows n..n+R-1 as out[r * M + m].
template <int M, class Rows>
void row_range(int64_t N, int64_t begin, int64_t end, float* y, Rows rows) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  float out[R * M];
  int64_t n = begin;
  auto put = [&](int count) {
    for (int r = 0; r < count; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = out[r * M + m];
  };
  for (; n + R <= end; n += R) {
    rows(std::integral_constant<int, R>{}, n, out);
    put(R);
  }
  for (; n < end; ++n) {
    rows(std::integral_constant<int, 1>{}, n, out);
    put(1);
  }
}

// One output row n of the int4 product for M (compile-time) rows of x.
template <int M>
void int4_row(const float* x, int64_t K, const uint8_t* p, const float* s, const float* z,
              int64_t G, float* out) {
  RowSums<M> r;
#if LMLAB_AVX2
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(15);
#endif
#if LMLAB_AVX512
  const __m512i idx16 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i sh16 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i mask16 = _mm512_set1_epi32(15);
  __m512 acc16[M][2];
  for (int m = 0; m < M; ++m) acc16[m][0] = acc16[m][1] = _mm512_setzero_ps();
#endif
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const float sg = s[g], zg = z[g] - 8.0f * sg;  // w_hat = code * s + (z - 8 s)
    int64_t k = k0;
#if LMLAB_AVX512
    {
      const __m512 vs = _mm512_set1_ps(sg), vz = _mm512_set1_ps(zg);
      for (; k + 32 <= k0 + G; k += 32) {
        const __m512 w0 = _mm512_fmadd_ps(nibbles16(p + k / 2, idx16, sh16, mask16), vs, vz);
        const __m512 w1 = _mm512_fmadd_ps(nibbles16(p + k / 2 + 8, idx16, sh16, mask16), vs, vz);
        for (int m = 0; m < M; ++m) {
          acc16[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc16[m][0]);
          acc16[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), acc16[m][1]);
        }
      }
      for (; k + 16 <= k0 + G; k += 16) {
        const __m512 w0 = _mm512_fmadd_ps(nibbles16(p + k / 2, idx16, sh16, mask16), vs, vz);
        for (int m = 0; m < M; ++m)
          acc16[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc16[m][0]);
      }
    }
#endif
#if LMLAB_AVX2
    const __m256 vs = _mm256_set1_ps(sg), vz = _mm256_set1_ps(zg);
    constexpr int U = kChains<M>;
    for (; k + 8 * U <= k0 + G; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 w = _mm256_fmadd_ps(nibbles8(p + (k + 8 * u) / 2, shifts, mask), vs, vz);
        for (int m = 0; m < M; ++m)
          r.acc[m][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k + 8 * u), r.acc[m][u]);
      }
    }
    for (; k + 8 <= k0 + G; k += 8) {
      const __m256 w = _mm256_fmadd_ps(nibbles8(p + k / 2, shifts, mask), vs, vz);
      for (int m = 0; m < M; ++m)
        r.acc[m][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k), r.acc[m][0]);
    }
#endif
    for (; k < k0 + G; ++k) {  // G % 8 columns (or all of them without AVX2)
      const uint8_t b = p[k / 2];
      const float w = static_cast<float>((k & 1) ? (b >> 4) : (b & 15)) * sg + zg;
      for (int m = 0; m < M; ++m) r.tail[m][k & 7] += w * x[m * K + k];
    }
  }
#if LMLAB_AVX512
  for (int m = 0; m < M; ++m)
    r.acc[m][0] = _mm256_add_ps(r.acc[m][0], fold16(_mm512_add_ps(acc16[m][0], acc16[m][1])));
#endif
  r.finish(out);
}

// One output row n of the int8 product.
template <int M>
void int8_row(const float* x, int64_t K, const int8_t* q, const float* s, int64_t G,
              float* out) {
  RowSums<M> r;
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const float sg = s[g];
    int64_t k = k0;
#if LMLAB_AVX2
    const __m256 vs = _mm256_set1_ps(sg);
    constexpr int U = kChains<M>;
    for (; k + 8 * U <= k0 + G; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 w = _mm256_mul_ps(int8x8(q + k + 8 * u), vs);
        for (int m = 0; m < M; ++m)
          r.acc[m][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k + 8 * u), r.acc[m][u]);
      }
    }
    for (; k + 8 <= k0 + G; k += 8) {
      const __m256 w = _mm256_mul_ps(int8x8(q + k), vs);
      for (int m = 0; m < M; ++m)
        r.acc[m][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k), r.acc[m][0]);
    }
#endif
    for (; k < k0 + G; ++k) {
      const float w = static_cast<float>(q[k]) * sg;
      for (int m = 0; m < M; ++m) r.tail[m][k & 7] += w * x[m * K + k];
    }
  }
  r.finish(out);
}

// ---- int8 activations (act_bits = 8) ----
// Each row of x is quantized once per call, per block of A columns (A = 32 when G % 32 == 0,
// else A = G, so a block never straddles a weight group): d = max|x| / 127 (float32),
// xq = round-half-even(x / d) in [-127, 127] (all 0 when d == 0), and xs = d * sum(xq) for the
// int4 offset term. y[m, n] = sum over blocks b (group g of b) of
//   int8:  s[g] d_b * sum(q xq)
//   int4:  s[g] d_b * sum(code xq) + (z[g] - 8 s[g]) xs_b       (w_hat = code s + (z - 8 s))
// with the integer sums exact in int32 and the rest in float32. With AVX2 and A == 32 a block
// is one 256-bit u8 x s8 dot product (VNNI dpbusd, else maddubs + madd): int4 codes are the
// unsigned operand (a block's 16 bytes: low nibbles = even columns in the low 128 bits, high
// nibbles = odd columns in the high 128, so xq is stored in that order per block); int8 weights
// take llama.cpp's sign trick: |xq| unsigned times q carrying xq's sign.

constexpr int64_t kPrefetch = 1024;
// Tunables of the AVX-512 paths (-D to A/B them; benchmarks/quant_kernel_ab.py, docs):
// LMLAB_PF: weight bytes prefetched ahead (4 KiB: 1.03-1.14x 1 KiB at 2 threads, K 576 / 1536);
// LMLAB_PFSZ: rows ahead for the scales / zeros; LMLAB_MIN_TASK: weights per thread task at least.
#ifndef LMLAB_PF
#define LMLAB_PF 4096
#endif
#ifndef LMLAB_PFSZ
#define LMLAB_PFSZ 4
#endif
#ifndef LMLAB_MIN_TASK
#define LMLAB_MIN_TASK (int64_t{1} << 16)
#endif

struct ActQ {
  std::vector<int8_t> q;   // (M, K), per block in the kernel's column order
  std::vector<uint8_t> a;  // |q| (int8 weights' SIMD path)
  std::vector<float> d;    // (M, K/A) block scales
  std::vector<float> s;    // (M, K/A) d * sum(q)
};

void quantize_acts(const float* x, int64_t M, int64_t K, int64_t A, bool split_even_odd,
                   ActQ& out) {
  const int64_t nb = K / A;
  out.q.resize(M * K);
  out.a.resize(M * K);
  out.d.resize(M * nb);
  out.s.resize(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * A;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < A; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        finite = finite && std::isfinite(xb[i]);
      }
      // a NaN or inf in the block makes its scale NaN, so the outputs it meets are NaN (as in
      // the float path) rather than finite numbers from clamped codes
      const float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      int8_t* qb = out.q.data() + m * K + b * A;
      uint8_t* ab = out.a.data() + m * K + b * A;
      int32_t sum = 0;
      for (int64_t i = 0; i < A; ++i) {
        float r = d > 0.0f ? std::nearbyint(xb[i] / d) : 0.0f;
        r = std::min(127.0f, std::max(-127.0f, r));
        const int8_t v = static_cast<int8_t>(r);
        sum += v;
        const int64_t j = split_even_odd ? (i / 2 + (i & 1) * (A / 2)) : i;
        qb[j] = v;
        ab[j] = static_cast<uint8_t>(v < 0 ? -v : v);
      }
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum);
    }
  }
}

#if LMLAB_AVX2
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if LMLAB_VNNI == 1
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif LMLAB_VNNI == 2
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// One output row, A == 32, M rows of quantized x: two float accumulator chains per row
// (even/odd blocks) so that M = 1 does not wait on one chain's FMA latency.
template <int M, bool Int4>
void a8_row_simd(const ActQ& xa, int64_t K, const uint8_t* w, const float* s, const float* z,
                 int64_t G, float* out) {
  const int64_t nb = K / 32, bpg = G / 32;
  __m256 acc[M][2];
  float off[M] = {};
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m128i lo4 = _mm_set1_epi8(15);
  // software prefetch of the weight stream kPrefetch bytes ahead (into the next rows: rows are
  // contiguous) and of the scales / zeros a few rows ahead
  constexpr int64_t wb = Int4 ? 16 : 32;
  const int64_t ng = K / G;
  _mm_prefetch(reinterpret_cast<const char*>(s + 4 * ng), _MM_HINT_T0);
  if constexpr (Int4) _mm_prefetch(reinterpret_cast<const char*>(z + 4 * ng), _MM_HINT_T0);
  int64_t g = 0, left = bpg, b = 0;
#if LMLAB_VNNI512
  {
    // blocks b and b + 1 in one 512-bit register each step: lanes 0-7 block b, 8-15 block b + 1
    __m512 acc5[M];
    for (int m = 0; m < M; ++m) acc5[m] = _mm512_setzero_ps();
    const __m256i lo4x = _mm256_set1_epi8(15);
    // the scale vector of a pair of blocks: lanes 0-7 from float 0 of a __m128, 8-15 from float 1
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    auto two = [](const float* f) {  // 2 floats into lanes 0, 1
      return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)));
    };
    if constexpr (Int4) {
      if (G == 32) {
        // llama.cpp's Q4_1 shape, one group per block: the two blocks' scales s * d and offset
        // terms (z - 8 s) * xs come from 2-float loads, no group bookkeeping
        const __m128 eight = _mm_set1_ps(8.0f);
        __m128 offv[M];
        for (int m = 0; m < M; ++m) offv[m] = _mm_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
          if ((b * wb) % 64 == 0)
            _mm_prefetch(reinterpret_cast<const char*>(w + b * wb + kPrefetch), _MM_HINT_T0);
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 16));
          const __m256i lo = _mm256_and_si256(raw, lo4x);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4x);
          const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          const __m512i codes = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
          const __m128 s2 = two(s + b);
          const __m128 zc2 = _mm_fnmadd_ps(eight, s2, two(z + b));  // z - 8 s
          for (int m = 0; m < M; ++m) {
            const __m512i xv = _mm512_loadu_si512(xa.q.data() + m * K + b * 32);
            const __m512 dot =
                _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xv));
            const __m128 sd = _mm_mul_ps(s2, two(xa.d.data() + m * nb + b));
            const __m512 sc = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(sd));
            acc5[m] = _mm512_fmadd_ps(dot, sc, acc5[m]);
            offv[m] = _mm_fmadd_ps(zc2, two(xa.s.data() + m * nb + b), offv[m]);
          }
        }
        for (int m = 0; m < M; ++m) {
          alignas(16) float o[4];
          _mm_store_ps(o, offv[m]);
          off[m] += o[0] + o[1];
        }
        g = b;  // one block per group: the loops below take the odd last block, if any
        left = 1;
      }
    }
    for (; b + 2 <= nb; b += 2) {
      if ((b * wb) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * wb + kPrefetch), _MM_HINT_T0);
      const int64_t g0 = g;
      if (--left == 0) {
        ++g;
        left = bpg;
      }
      const int64_t g1 = g;
      if (--left == 0) {
        ++g;
        left = bpg;
      }
      const float s0 = s[g0], s1 = s[g1];
      const __m128 s01 = _mm_unpacklo_ps(_mm_set_ss(s0), _mm_set_ss(s1));
      if constexpr (Int4) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 16));
        const __m256i lo = _mm256_and_si256(raw, lo4x);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4x);
        // 128-bit lanes [lo b, lo b+1, hi b, hi b+1] -> [lo b, hi b, lo b+1, hi b+1]
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        const __m512i codes = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
        const float z0 = z[g0] - 8.0f * s0, z1 = z[g1] - 8.0f * s1;
        for (int m = 0; m < M; ++m) {
          const __m512i xv = _mm512_loadu_si512(xa.q.data() + m * K + b * 32);
          const __m512 dot =
              _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xv));
          const __m128 sd = _mm_mul_ps(s01, two(xa.d.data() + m * nb + b));
          const __m512 sc = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(sd));
          acc5[m] = _mm512_fmadd_ps(dot, sc, acc5[m]);
          const float* xs = xa.s.data() + m * nb + b;
          off[m] += z0 * xs[0] + z1 * xs[1];
        }
      } else {
        const __m512i wv = _mm512_loadu_si512(w + b * 32);
        for (int m = 0; m < M; ++m) {
          const __m512i xv = _mm512_loadu_si512(xa.q.data() + m * K + b * 32);
          const __m512i ax = _mm512_loadu_si512(xa.a.data() + m * K + b * 32);
          // q with xq's sign (0 where xq is 0: |xq| is 0 there anyway)
          const __m512i sw =
              _mm512_mask_sub_epi8(wv, _mm512_movepi8_mask(xv), _mm512_setzero_si512(), wv);
          const __m512 dot =
              _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sw));
          const __m128 sd = _mm_mul_ps(s01, two(xa.d.data() + m * nb + b));
          const __m512 sc = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(sd));
          acc5[m] = _mm512_fmadd_ps(dot, sc, acc5[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) acc[m][0] = fold16(acc5[m]);
  }
#endif
  for (; b < nb; ++b) {
    if ((b * wb) % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * wb + kPrefetch), _MM_HINT_T0);
    const float sg = s[g];
    const int par = static_cast<int>(b & 1);
    if constexpr (Int4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), lo4),
                                             _mm_and_si128(raw, lo4));
      const float zg = z[g] - 8.0f * sg;
      for (int m = 0; m < M; ++m) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q.data() + m * K + b * 32));
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(codes, xv));
        if (par)
          acc[m][1] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sg * xa.d[m * nb + b]), acc[m][1]);
        else
          acc[m][0] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sg * xa.d[m * nb + b]), acc[m][0]);
        off[m] += zg * xa.s[m * nb + b];
      }
    } else {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
      for (int m = 0; m < M; ++m) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q.data() + m * K + b * 32));
        const __m256i ax =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.a.data() + m * K + b * 32));
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(ax, _mm256_sign_epi8(wv, xv)));
        if (par)
          acc[m][1] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sg * xa.d[m * nb + b]), acc[m][1]);
        else
          acc[m][0] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sg * xa.d[m * nb + b]), acc[m][0]);
      }
    }
    if (--left == 0) {
      ++g;
      left = bpg;
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + off[m];
}
#endif

#if LMLAB_VNNI512
// ---- int4 weights x int8 activations, 4 blocks per 512-bit step (AVX512-VNNI + AVX512BW) ----
// For groups with 128 % G == 0 or G % 128 == 0 (G a multiple of 32: SmolLM2's 32 included).
// A quad is 4 blocks of 32 columns = 64 code bytes of a row: one 512-bit load; its low nibbles
// are the even columns of the 4 blocks (bytes 16j..16j+15 = block j), its high nibbles the odd
// ones, so two dpbusd against the activations stored per quad as [64 even | 64 odd] bytes give
// each block's dot product in the 4 int32 lanes of its 128-bit lane (no shuffles). Each block's
// scale s[g] d_b is applied to its 4 lanes in float32 (s from one short load and a lane permute,
// d from a replicated copy made once per call); the offset term sum_g (z - 8 s)[g] xs[g]
// (xs[g] = sum of d_b sum(xq) over g's blocks) is a separate 16-groups-at-a-time dot product;
// each output row is reduced horizontally once.

struct ActQuads {
  int64_t nq = 0;            // quads per row (the last may have 1..3 blocks: zero-padded)
  std::vector<int8_t> q;     // (M, nq, 128): per quad 64 even-column then 64 odd-column bytes
  std::vector<float> dv;     // (M, nq, 16): block j's d in lanes 4j..4j+3 (0 past the row)
  std::vector<float> xs;     // (M, ng): per weight group, sum over its blocks of d * sum(xq)
};

inline bool quad_groups(int64_t G) { return G % 32 == 0 && (128 % G == 0 || G % 128 == 0); }

// x (M, K) -> ActQuads, the same d and xq as quantize_acts (A = 32), in the quad layout.
void quantize_quads(const float* x, int64_t M, int64_t K, int64_t G, ActQuads& out) {
  const int64_t nb = K / 32, nq = (nb + 3) / 4, ng = K / G, bpg = G / 32;
  out.nq = nq;
  out.q.assign(M * nq * 128, 0);
  out.dv.assign(M * nq * 16, 0.0f);
  out.xs.assign(M * ng, 0.0f);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      // x - x is NaN exactly where x is NaN or inf
      const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), _mm512_setzero_ps(),
                                               _CMP_NEQ_UQ) |
                            _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), _mm512_setzero_ps(),
                                               _CMP_NEQ_UQ);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      int8_t* qq = out.q.data() + (m * nq + b / 4) * 128 + 16 * (b % 4);
      int32_t sum = 0;
      if (d > 0.0f) {  // else the block's codes stay 0 (d == 0: all zero; NaN: NaN anyway)
        const __m512 vd = _mm512_set1_ps(d);
        constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_div_ps(v0, vd), kRound);
        __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_div_ps(v1, vd), kRound);
        q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
        q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qq),
                         _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, even, q1)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qq + 64),
                         _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, odd, q1)));
      }
      float* dv = out.dv.data() + (m * nq + b / 4) * 16 + 4 * (b % 4);
      dv[0] = dv[1] = dv[2] = dv[3] = d;
      out.xs[m * ng + b / bpg] += d * static_cast<float>(sum);
    }
  }
}

// R consecutive output rows (codes w, K/2 bytes a row; s, z their K/G scales and zeros, row after
// row) for M rows of x: out[r * M + m]. The activation loads are shared by the R rows.
template <int M, int R>
void a8_quad_rows(const ActQuads& xa, int64_t K, const uint8_t* w, const float* s, const float* z,
                  int64_t G, float* out) {
  const int64_t nb = K / 32, nq = xa.nq, ng = K / G, rb = K / 2;
  const __m512i lo4 = _mm512_set1_epi8(15);
  // which of the 4 loaded scales each lane takes: block j's group within the quad
  const __m512i sidx = G == 32   ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                       : G == 64 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                 : _mm512_setzero_si512();
  const int64_t spq = G >= 128 ? 1 : 128 / G;  // groups per full quad
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
#if LMLAB_PFSZ > 0
  for (int r = 0; r < R; ++r) {  // the scales and zeros of rows a few rows ahead
    _mm_prefetch(reinterpret_cast<const char*>(s + (r + LMLAB_PFSZ) * ng), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(z + (r + LMLAB_PFSZ) * ng), _MM_HINT_T0);
  }
#endif
  for (int64_t q = 0; q < nq; ++q) {
    const int64_t left = nb - 4 * q;
    const int64_t sbase = G >= 128 ? q * 128 / G : q * spq;
    const bool full = left >= 4;
    const __mmask64 wmask = full ? ~__mmask64{0} : (__mmask64{1} << (16 * left)) - 1;
    const __mmask8 smask =
        static_cast<__mmask8>((1u << (G >= 128 ? 1 : full ? spq : (left * 32 + G - 1) / G)) - 1);
    __m512i xe[M], xo[M];
    __m512 dv[M];
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = xa.q.data() + (m * nq + q) * 128;
      xe[m] = _mm512_loadu_si512(xq);
      xo[m] = _mm512_loadu_si512(xq + 64);
      dv[m] = _mm512_loadu_ps(xa.dv.data() + (m * nq + q) * 16);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w + r * rb + 64 * q;
      _mm_prefetch(reinterpret_cast<const char*>(wr + LMLAB_PF), _MM_HINT_T0);
      const __m512i raw = full ? _mm512_loadu_si512(wr) : _mm512_maskz_loadu_epi8(wmask, wr);
      const __m128 s4 = _mm_maskz_loadu_ps(smask, s + r * ng + sbase);
      const __m512i lo = _mm512_and_si512(raw, lo4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
      const __m512 srep = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(s4));
      for (int m = 0; m < M; ++m) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe[m]);
        dot = _mm512_dpbusd_epi32(dot, hi, xo[m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(srep, dv[m]),
                                    acc[r][m]);
      }
    }
  }
  add_offsets<M, R>(xa.xs.data(), ng, s, z, acc);
  reduce_rows<M, R>(acc, out);
}

// Output rows [begin, end) of the quad kernel: R = 4 rows at a time (2 from M = 3, 1 from M = 5:
// the accumulators stay in registers), the rest one by one.
template <int M>
void a8_quad_range(const ActQuads& xa, int64_t K, int64_t N, const uint8_t* w, const float* s,
                   const float* z, int64_t G, int64_t begin, int64_t end, float* y) {
  const int64_t rb = K / 2, ng = K / G;
  row_range<M>(N, begin, end, y, [&](auto r, int64_t n, float* out) {
    a8_quad_rows<M, decltype(r)::value>(xa, K, w + n * rb, s + n * ng, z + n * ng, G, out);
  });
}
// ---- int8 weights x int8 activations, 2 blocks per 512-bit step (AVX512-VNNI + AVX512BW) ----
// G % 32 == 0. x quantized once per call (the same d and xq as quantize_acts) in natural column
// order with |xq| beside it; per pair of blocks and output row: one 64-byte load of codes, the
// codes given xq's sign (llama.cpp's trick: |xq| is the unsigned operand), one dpbusd, and the
// scale s[g] d_b per 8-lane half (d from a copy replicated once per call). With one group per
// row (int8's default) s is applied once per row at the end. R output rows share the x loads.
struct ActPairs {
  int64_t np = 0;          // pairs of blocks per row (the last may hold one block: zero-padded)
  std::vector<int8_t> q;   // (M, np * 64) xq, natural column order
  std::vector<uint8_t> a;  // (M, np * 64) |xq|
  std::vector<float> dv;   // (M, np, 16): block 2p's d in lanes 0-7, 2p + 1's in 8-15
};

void quantize_pairs(const float* x, int64_t M, int64_t K, ActPairs& out) {
  const int64_t nb = K / 32, np = (nb + 1) / 2;
  out.np = np;
  out.q.assign(M * np * 64, 0);
  out.a.assign(M * np * 64, 0);
  out.dv.assign(M * np * 16, 0.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), _mm512_setzero_ps(),
                                               _CMP_NEQ_UQ) |
                            _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), _mm512_setzero_ps(),
                                               _CMP_NEQ_UQ);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      if (d > 0.0f) {
        const __m512 vd = _mm512_set1_ps(d);
        constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_div_ps(v0, vd), kRound);
        __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_div_ps(v1, vd), kRound);
        q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
        q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
        int8_t* qb = out.q.data() + m * np * 64 + b * 32;
        uint8_t* ab = out.a.data() + m * np * 64 + b * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtepi32_epi8(_mm512_abs_epi32(q0)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + 16),
                         _mm512_cvtepi32_epi8(_mm512_abs_epi32(q1)));
      }
      float* dv = out.dv.data() + (m * np + b / 2) * 16 + 8 * (b % 2);
      for (int i = 0; i < 8; ++i) dv[i] = d;
    }
}

template <int M, int R>
void a8_pair_rows(const ActPairs& xa, int64_t K, const int8_t* w, const float* s, int64_t G,
                  float* out) {
  const int64_t nb = K / 32, np = xa.np, ng = K / G;
  const bool row_scale = ng == 1;
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(s + (r + LMLAB_PFSZ) * ng), _MM_HINT_T0);
  for (int64_t p = 0; p < np; ++p) {
    const bool full = 2 * p + 2 <= nb;
    __m512i xq[M], xabs[M];
    __mmask64 neg[M];
    __m512 dv[M];
    for (int m = 0; m < M; ++m) {
      xq[m] = _mm512_loadu_si512(xa.q.data() + m * np * 64 + p * 64);
      xabs[m] = _mm512_loadu_si512(xa.a.data() + m * np * 64 + p * 64);
      neg[m] = _mm512_movepi8_mask(xq[m]);
      dv[m] = _mm512_loadu_ps(xa.dv.data() + (m * np + p) * 16);
    }
    const int64_t g0 = 64 * p / G, g1 = full ? (64 * p + 32) / G : g0;
    for (int r = 0; r < R; ++r) {
      const int8_t* wr = w + r * K + 64 * p;
      _mm_prefetch(reinterpret_cast<const char*>(wr + LMLAB_PF), _MM_HINT_T0);
      const __m512i wv = full ? _mm512_loadu_si512(wr)
                              : _mm512_maskz_loadu_epi8(~__mmask64{0} >> 32, wr);
      __m512 srep = _mm512_setzero_ps();
      if (!row_scale) {
        const __m128 s2 = _mm_unpacklo_ps(_mm_set_ss(s[r * ng + g0]), _mm_set_ss(s[r * ng + g1]));
        srep = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(s2));
      }
      for (int m = 0; m < M; ++m) {
        const __m512i sw = _mm512_mask_sub_epi8(wv, neg[m], _mm512_setzero_si512(), wv);
        const __m512 dot =
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xabs[m], sw));
        acc[r][m] = _mm512_fmadd_ps(dot, row_scale ? dv[m] : _mm512_mul_ps(srep, dv[m]),
                                    acc[r][m]);
      }
    }
  }
  reduce_rows<M, R>(acc, out);
  if (row_scale)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) out[r * M + m] *= s[r];
}

template <int M>
void a8_pair_range(const ActPairs& xa, int64_t K, int64_t N, const int8_t* w, const float* s,
                   int64_t G, int64_t begin, int64_t end, float* y) {
  const int64_t ng = K / G;
  row_range<M>(N, begin, end, y, [&](auto r, int64_t n, float* out) {
    a8_pair_rows<M, decltype(r)::value>(xa, K, w + n * K, s + n * ng, G, out);
  });
}
#endif

#if LMLAB_AVX512
// ---- int4 weights x float32 activations, G % 32 == 0, AVX-512 ----
// Per 32-column block of a row (16 code bytes): vpmovzxbd spreads the bytes to 16 int32 lanes,
// & 15 gives the even columns, >> 4 the odd ones; x is stored once per call per block as
// [16 even | 16 odd] floats, so a block is 2 converts, a multiply and an FMA, and its group's
// scale is applied once per block: y = sum_g s[g] sum_k code x + sum_g (z - 8 s)[g] xsum[g]
// (xsum[g]: the sum of x over the group, once per call). R output rows share the x loads.
struct ActSplit {
  std::vector<float> x;     // (M, K): per 32-block 16 even-column then 16 odd-column values
  std::vector<float> xsum;  // (M, ng)
};

void split_acts(const float* x, int64_t M, int64_t K, int64_t G, ActSplit& out) {
  const int64_t nb = K / 32, ng = K / G;
  out.x.resize(M * K);
  out.xsum.assign(M * ng, 0.0f);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      _mm512_storeu_ps(out.x.data() + m * K + b * 32, _mm512_permutex2var_ps(v0, even, v1));
      _mm512_storeu_ps(out.x.data() + m * K + b * 32 + 16, _mm512_permutex2var_ps(v0, odd, v1));
      out.xsum[m * ng + b * 32 / G] += _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
}

template <int M, int R>
void int4_split_rows(const ActSplit& xa, int64_t K, const uint8_t* w, const float* s,
                     const float* z, int64_t G, float* out) {
  const int64_t nb = K / 32, ng = K / G, rb = K / 2, bpg = G / 32;
  const __m512i lo4 = _mm512_set1_epi32(15);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(s + (r + LMLAB_PFSZ) * ng), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(z + (r + LMLAB_PFSZ) * ng), _MM_HINT_T0);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512 xe[M], xo[M];
    for (int m = 0; m < M; ++m) {
      xe[m] = _mm512_loadu_ps(xa.x.data() + m * K + b * 32);
      xo[m] = _mm512_loadu_ps(xa.x.data() + m * K + b * 32 + 16);
    }
    const int64_t g = b / bpg;
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w + r * rb + 16 * b;
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + LMLAB_PF), _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr)));
      const __m512 ce = _mm512_cvtepi32_ps(_mm512_and_si512(v, lo4));
      const __m512 co = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      const __m512 sv = _mm512_set1_ps(s[r * ng + g]);
      for (int m = 0; m < M; ++m) {
        const __m512 part = _mm512_fmadd_ps(ce, xe[m], _mm512_mul_ps(co, xo[m]));
        acc[r][m] = _mm512_fmadd_ps(part, sv, acc[r][m]);
      }
    }
  }
  add_offsets<M, R>(xa.xsum.data(), ng, s, z, acc);
  reduce_rows<M, R>(acc, out);
}

template <int M>
void int4_split_range(const ActSplit& xa, int64_t K, int64_t N, const uint8_t* w, const float* s,
                      const float* z, int64_t G, int64_t begin, int64_t end, float* y) {
  const int64_t rb = K / 2, ng = K / G;
  row_range<M>(N, begin, end, y, [&](auto r, int64_t n, float* out) {
    int4_split_rows<M, decltype(r)::value>(xa, K, w + n * rb, s + n * ng, z + n * ng, G, out);
  });
}
#endif

#if LMLAB_AVX512
// ---- int8 weights x float32 activations, G % 16 == 0, AVX-512 ----
// 16 codes per step (vpmovsxbd + convert + one FMA per row of x) summed per group, the group's
// scale applied once per group; R output rows share the x loads.
template <int M, int R>
void int8_wide_rows(const float* x, int64_t K, const int8_t* q, const float* s, int64_t G,
                    float* out) {
  const int64_t ng = K / G;
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 part[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) part[r][m] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const int8_t* qr = q + r * K + k;
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(qr + LMLAB_PF), _MM_HINT_T0);
        const __m512 w = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr))));
        for (int m = 0; m < M; ++m) part[r][m] = _mm512_fmadd_ps(w, xv[m], part[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sv = _mm512_set1_ps(s[r * ng + g]);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(part[r][m], sv, acc[r][m]);
    }
  }
  reduce_rows<M, R>(acc, out);
}

template <int M>
void int8_wide_range(const float* x, int64_t K, int64_t N, const int8_t* q, const float* s,
                     int64_t G, int64_t begin, int64_t end, float* y) {
  const int64_t ng = K / G;
  row_range<M>(N, begin, end, y, [&](auto r, int64_t n, float* out) {
    int8_wide_rows<M, decltype(r)::value>(x, K, q + n * K, s + n * ng, G, out);
  });
}
#endif

// The same sums, plain loops, any A (natural column order).
template <int M, bool Int4>
void a8_row_plain(const ActQ& xa, int64_t K, int64_t A, const uint8_t* w, const float* s,
                  const float* z, int64_t G, float* out) {
  const int64_t nb = K / A;
  for (int m = 0; m < M; ++m) out[m] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b * A / G;
    const float sg = s[g];
    const float zg = Int4 ? z[g] - 8.0f * sg : 0.0f;
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = xa.q.data() + m * K + b * A;
      int32_t dot = 0;
      for (int64_t i = 0; i < A; ++i) {
        const int64_t k = b * A + i;
        const int32_t c = Int4 ? ((k & 1) ? (w[k / 2] >> 4) : (w[k / 2] & 15))
                               : static_cast<int32_t>(reinterpret_cast<const int8_t*>(w)[k]);
        dot += c * xq[i];
      }
      out[m] += sg * xa.d[m * nb + b] * static_cast<float>(dot);
      if (Int4) out[m] += zg * xa.s[m * nb + b];
    }
  }
}

// Output rows split over threads in contiguous ranges, at least LMLAB_MIN_TASK weights each.
template <typename RangeFn>
void run_ranges(int64_t N, int64_t K, RangeFn range) {
  const int64_t grain = std::max<int64_t>(1, LMLAB_MIN_TASK / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, range);
}

template <int M, typename RowFn>
void run_rows(int64_t N, int64_t K, float* y, RowFn row) {
  const int64_t grain = std::max<int64_t>(1, LMLAB_MIN_TASK / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[M];
    for (int64_t n = begin; n < end; ++n) {
      row(n, out);
      for (int m = 0; m < M; ++m) y[m * N + n] = out[m];
    }
  });
}

#define LMLAB_DISPATCH_ROWS(M_RT, BODY)            \
  switch (M_RT) {                                  \
    case 1: { constexpr int M = 1; BODY; } break;  \
    case 2: { constexpr int M = 2; BODY; } break;  \
    case 3: { constexpr int M = 3; BODY; } break;  \
    case 4: { constexpr int M = 4; BODY; } break;  \
    case 5: { constexpr int M = 5; BODY; } break;  \
    case 6: { constexpr int M = 6; BODY; } break;  \
    case 7: { constexpr int M = 7; BODY; } break;  \
    default: { constexpr int M = 8; BODY; } break; \
  }

}  // namespace

// The C entry points (called through ctypes with data pointers; lmlab.nn.quant_kernel checks the
// shapes, dtypes, contiguity and 1 <= M <= 8 before calling). y is (M, N), written in full;
// the return value is 0, or 1 for sizes refused (then y is not written).
extern "C" {

int lmlab_int4_mm(const float* x, int64_t M, int64_t K, const uint8_t* p, const float* s,
                   const float* z, int64_t N, int64_t G, float* y) {
  if (M < 1 || M > kMaxRows || N < 1 || K < 1 || G < 1 || K % G || G % 2) return 1;  // refused
  const int64_t ng = K / G;
#if LMLAB_AVX512
  if (G % 32 == 0) {
    thread_local ActSplit buf;  // reused by this caller's thread (workers get it by reference)
    const ActSplit& xa = buf;
    split_acts(x, M, K, G, buf);
    LMLAB_DISPATCH_ROWS(M, run_ranges(N, K, [&](int64_t begin, int64_t end) {
      int4_split_range<M>(xa, K, N, p, s, z, G, begin, end, y);
    }));
    return 0;
  }
#endif
  LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
    int4_row<M>(x, K, p + n * (K / 2), s + n * ng, z + n * ng, G, out);
  }));
  return 0;
}

int lmlab_int8_mm(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s,
                   int64_t N, int64_t G, float* y) {
  if (M < 1 || M > kMaxRows || N < 1 || K < 1 || G < 1 || K % G) return 1;  // refused
  const int64_t ng = K / G;
#if LMLAB_AVX512
  if (G % 16 == 0) {
    LMLAB_DISPATCH_ROWS(M, run_ranges(N, K, [&](int64_t begin, int64_t end) {
      int8_wide_range<M>(x, K, N, q, s, G, begin, end, y);
    }));
    return 0;
  }
#endif
  LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
    int8_row<M>(x, K, q + n * K, s + n * ng, G, out);
  }));
  return 0;
}

// x quantized to int8 per block (act_bits = 8, see ActQ above); same operands otherwise.
int lmlab_a8_mm(int bits, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* s,
                const float* z, int64_t N, int64_t G, float* y) {
  if (M < 1 || M > kMaxRows || N < 1 || K < 1 || G < 1 || K % G) return 1;  // refused
  if ((bits != 4 && bits != 8) || (bits == 4 && G % 2)) return 1;
  const int64_t A = G % 32 == 0 ? 32 : G, ng = K / G;
  const bool simd = LMLAB_AVX2 && A == 32;
#if LMLAB_VNNI512
  if (bits == 4 && quad_groups(G)) {
    thread_local ActQuads buf;  // reused by this caller's thread (workers get it by reference)
    const ActQuads& xq = buf;
    quantize_quads(x, M, K, G, buf);
    LMLAB_DISPATCH_ROWS(M, run_ranges(N, K, [&](int64_t begin, int64_t end) {
      a8_quad_range<M>(xq, K, N, w, s, z, G, begin, end, y);
    }));
    return 0;
  }
  if (bits == 8 && G % 32 == 0) {
    thread_local ActPairs buf;
    const ActPairs& xp = buf;
    quantize_pairs(x, M, K, buf);
    const int8_t* q = reinterpret_cast<const int8_t*>(w);
    LMLAB_DISPATCH_ROWS(M, run_ranges(N, K, [&](int64_t begin, int64_t end) {
      a8_pair_range<M>(xp, K, N, q, s, G, begin, end, y);
    }));
    return 0;
  }
#endif
  ActQ xa;
  quantize_acts(x, M, K, A, simd && bits == 4, xa);
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
#if LMLAB_AVX2
  if (simd) {
    if (bits == 4) {
      LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
        a8_row_simd<M, true>(xa, K, w + n * row_bytes, s + n * ng, z + n * ng, G, out);
      }));
    } else {
      LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
        a8_row_simd<M, false>(xa, K, w + n * row_bytes, s + n * ng, z, G, out);
      }));
    }
    return 0;
  }
#endif
  if (bits == 4) {
    LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
      a8_row_plain<M, true>(xa, K, A, w + n * row_bytes, s + n * ng, z + n * ng, G, out);
    }));
  } else {
    LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
      a8_row_plain<M, false>(xa, K, A, w + n * row_bytes, s + n * ng, z, G, out);
    }));
  }
  return 0;
}

// The layer's float32 weight w (N, K) = (code - c) s + z group-wise (c = 0 for int8, 8 for
// int4), in one pass: QuantLinear's path for more rows than the kernels take (a prompt), whose
// product then runs as a float32 matmul. bits 8: q int8 (N, K); bits 4: q uint8 (N, K/2), column
// 2j in the low nibble. Returns 1 for sizes refused (w not written).
int lmlab_dequantize(int bits, const uint8_t* q, const float* s, const float* z, int64_t N,
                     int64_t K, int64_t G, float* w) {
  if (N < 1 || K < 1 || G < 1 || K % G || (bits != 4 && bits != 8) || (bits == 4 && G % 2))
    return 1;
  const int64_t ng = K / G;
  const int64_t grain = std::max<int64_t>(1, LMLAB_MIN_TASK / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < ng; ++g) {
        const float sg = s[n * ng + g], zg = z[n * ng + g];
        float* out = w + n * K + g * G;
        if (bits == 8) {
          const int8_t* c = reinterpret_cast<const int8_t*>(q) + n * K + g * G;
          for (int64_t j = 0; j < G; ++j) out[j] = static_cast<float>(c[j]) * sg + zg;
        } else {
          const uint8_t* c = q + n * (K / 2) + g * (G / 2);
          for (int64_t j = 0; j < G / 2; ++j) {
            out[2 * j] = static_cast<float>((c[j] & 15) - 8) * sg + zg;
            out[2 * j + 1] = static_cast<float>((c[j] >> 4) - 8) * sg + zg;
          }
        }
      }
    }
  });
  return 0;
}

int lmlab_kernels_avx2() { return LMLAB_AVX2; }

int lmlab_kernels_vnni() { return LMLAB_VNNI; }

int lmlab_kernels_avx512() { return LMLAB_AVX512; }

int lmlab_kernels_max_rows() { return static_cast<int>(kMaxRows); }

}  // extern "C"
