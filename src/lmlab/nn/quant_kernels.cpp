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
// Built with -mavx2 -mfma where the CPU has them (the intrinsics below), else the plain loops.

#include <ATen/Parallel.h>

#include <algorithm>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LMLAB_AVX2 1
#else
#define LMLAB_AVX2 0
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

// One output row n of the int4 product for M (compile-time) rows of x.
template <int M>
void int4_row(const float* x, int64_t K, const uint8_t* p, const float* s, const float* z,
              int64_t G, float* out) {
  RowSums<M> r;
#if LMLAB_AVX2
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(15);
#endif
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const float sg = s[g], zg = z[g] - 8.0f * sg;  // w_hat = code * s + (z - 8 s)
    int64_t k = k0;
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

template <int M, typename RowFn>
void run_rows(int64_t N, int64_t K, float* y, RowFn row) {
  // At least 2^20 weights (~0.1-0.5 ms) per task: one parallel region ends in a barrier, and on
  // a machine with more busy threads than cores a descheduled thread stalls the others for a time
  // slice. Measured here (2 cores, load 8): 16K-weight tasks made the 576 x 576 layer 4x slower
  // on 2 threads than on 1. So decode's small layers run on one thread and the LM head on all.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(K, 1));
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
  LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
    int4_row<M>(x, K, p + n * (K / 2), s + n * ng, z + n * ng, G, out);
  }));
  return 0;
}

int lmlab_int8_mm(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s,
                   int64_t N, int64_t G, float* y) {
  if (M < 1 || M > kMaxRows || N < 1 || K < 1 || G < 1 || K % G) return 1;  // refused
  const int64_t ng = K / G;
  LMLAB_DISPATCH_ROWS(M, run_rows<M>(N, K, y, [&](int64_t n, float* out) {
    int8_row<M>(x, K, q + n * K, s + n * ng, G, out);
  }));
  return 0;
}

int lmlab_kernels_avx2() { return LMLAB_AVX2; }

int lmlab_kernels_max_rows() { return static_cast<int>(kMaxRows); }

}  // extern "C"
