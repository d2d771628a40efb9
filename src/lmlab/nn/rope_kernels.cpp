// lmlab's CPU kernel for rotary position embeddings (RoPE, half-split layout) in training:
// one pass over q or k (or both, joined on the head dim) instead of torch's four (x * cos, the
// rolled copy, its product, the sum) forward and four backward.
//
// Legend: B batch, N heads, T tokens, hd head_dim (even, h = hd / 2), strides in elements.
// x (B, N, T, hd) with any strides (the last one 1), cos and sgn (T, hd) contiguous, where sgn is
// sin with its first half negated ([-sin1, sin2]); y (B, N, T, hd) with any strides (last 1).
//
//   forward (inverse = 0):  y[i] = x[i] cos[i] + x[j] sgn[i]       j = (i + h) mod hd
//   backward (inverse = 1): y[i] = x[i] cos[i] + x[j] sgn[j]       (x = the output's gradient)
//
// which is x * cos + roll(x, h) * sgn and its autograd backward, g * cos + roll(g * sgn, -h).
// Every product and the sum round as torch's eager ops round them: float32 is plain IEEE
// arithmetic (built with -ffp-contract=off: no fused multiply-add), bfloat16 is computed in
// float32 and rounded to bfloat16 (nearest even) after each product and after the sum, as
// torch's CPU kernels do. So the result is bit-equal to the eager formula in both dtypes
// (tests/unit/test_rope_kernel.py). (B, T) rows are split over threads with at::parallel_for.

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 1024;

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f rounded to bfloat16 (nearest even, as c10::BFloat16), as a float32; branch-free so that the
// row loops vectorize. No NaN test is needed for the values rounded here: a NaN among them
// comes from a bfloat16 input or is the default NaN of inf * 0 or inf - inf, so its low 16 bits
// are 0 and adding at most 0x8000 leaves it the same NaN.
inline float round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

inline float load(float v) { return v; }
inline float load(uint16_t v) { return bf16_to_f32(v); }
inline void store(float v, float* dst) { *dst = v; }
inline void store(float v, uint16_t* dst) {  // v is already bfloat16-exact: truncation
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *dst = static_cast<uint16_t>(u >> 16);
}

// One head's row of hd channels (HD: hd known at compile time, 0 for any): y[i] = x[i] c[i] +
// x[j] s[i], j = (i + hd/2) mod hd, where s is already the row's sgn (forward) or sgn[j]
// (inverse). Bf16 (T = uint16_t): each product and the sum rounded to bfloat16.
#if defined(__AVX512F__)
// Sixteen channels at a time, the same operations in the same order: float32 a product, a
// product and a sum (no fused multiply-add); bfloat16 each rounded as round_bf16 rounds.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 round16(__m512 v) {  // round_bf16, lane by lane
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(__m512 v, float* p) { _mm512_storeu_ps(p, v); }
inline void store16(__m512 v, uint16_t* p) {  // v already bfloat16-exact: truncation
  __m256i w = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
}
#endif

template <typename T, int64_t HD>
inline void rotate_head(const T* __restrict x, const float* __restrict c,
                        const float* __restrict s, T* __restrict y, int64_t hd_rt) {
  constexpr bool kBf16 = sizeof(T) == 2;
  const int64_t hd = HD ? HD : hd_rt;
  const int64_t h = hd / 2;
#if defined(__AVX512F__)
  if (h % 16 == 0) {  // head_dim 32, 64, 128, ...: whole vectors in each half
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t lo = half * h, other = (1 - half) * h;
      for (int64_t i = 0; i < h; i += 16) {
        const __m512 a = _mm512_mul_ps(load16(x + lo + i), _mm512_loadu_ps(c + lo + i));
        const __m512 b = _mm512_mul_ps(load16(x + other + i), _mm512_loadu_ps(s + lo + i));
        const __m512 v = kBf16 ? round16(_mm512_add_ps(round16(a), round16(b))) : _mm512_add_ps(a, b);
        store16(v, y + lo + i);
      }
    }
    return;
  }
#endif
  float xf[kMaxHeadDim];
  for (int64_t i = 0; i < hd; ++i) xf[i] = load(x[i]);
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t lo = half * h, other = (1 - half) * h;  // i in [lo, lo + h), j = other + ..
    for (int64_t i = 0; i < h; ++i) {
      const float a = xf[lo + i] * c[lo + i];
      const float b = xf[other + i] * s[lo + i];
      float v;
      if (kBf16) {
        v = round_bf16(round_bf16(a) + round_bf16(b));
      } else {
        v = a + b;
      }
      store(v, &y[lo + i]);
    }
  }
}

// One row's tables as float32: cf = cos[0..hd), sf = sgn[0..hd) (forward) or sgn[j], j = (i +
// hd/2) mod hd (the inverse rotation); sixteen channels at a time when both halves are whole
// vectors (the same values: a widening is exact).
template <typename T>
inline void load_tables(const T* cos, const T* sgn, float* cf, float* sf, int64_t hd,
                        bool inverse) {
  const int64_t half = hd / 2;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    for (int64_t i = 0; i < hd; i += 16) {
      _mm512_storeu_ps(cf + i, load16(cos + i));
      const int64_t j = !inverse ? i : (i < half ? i + half : i - half);
      _mm512_storeu_ps(sf + i, load16(sgn + j));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < hd; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    cf[i] = load(cos[i]);
    sf[i] = load(sgn[inverse ? j : i]);
  }
}

template <typename T, int64_t HD>
void rope(const T* x, int64_t nb, int64_t nh, int64_t nt, int64_t hd, int64_t sxb, int64_t sxn,
          int64_t sxt, const T* cos, const T* sgn, T* y, int64_t syb, int64_t syn, int64_t syt,
          bool inverse) {
  at::parallel_for(0, nb * nt, 8, [&](int64_t begin, int64_t end) {
    float cf[kMaxHeadDim], sf[kMaxHeadDim];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / nt, t = row % nt;
      load_tables(cos + t * hd, sgn + t * hd, cf, sf, hd, inverse);
      for (int64_t n = 0; n < nh; ++n) {
        rotate_head<T, HD>(x + b * sxb + n * sxn + t * sxt, cf, sf, y + b * syb + n * syn + t * syt,
                           hd);
      }
    }
  });
}

template <typename T>
void rope_any(const T* x, int64_t nb, int64_t nh, int64_t nt, int64_t hd, int64_t sxb,
              int64_t sxn, int64_t sxt, const T* cos, const T* sgn, T* y, int64_t syb,
              int64_t syn, int64_t syt, bool inverse) {
  // the common head sizes unrolled at compile time
#define LMLAB_ROPE_HD(N)                                                                     \
  if (hd == N) {                                                                           \
    rope<T, N>(x, nb, nh, nt, hd, sxb, sxn, sxt, cos, sgn, y, syb, syn, syt, inverse);     \
    return;                                                                                \
  }
  LMLAB_ROPE_HD(32)
  LMLAB_ROPE_HD(64)
  LMLAB_ROPE_HD(128)
#undef LMLAB_ROPE_HD
  rope<T, 0>(x, nb, nh, nt, hd, sxb, sxn, sxt, cos, sgn, y, syb, syn, syt, inverse);
}

// ---- q, k and v of one fused projection, in one call each way -------------------------------
//
// qkv (B, T, H + 2K, hd) contiguous, the projection's output (bias-free when a bias is given);
// bias ((H + 2K) hd) or null, float32 or bfloat16 (BT). Forward: each row x (+ bias, rounded to
// T as a biased matmul output is) -> q (B, H, T, hd) and k (B, K, T, hd) rotated, v (B, K, T,
// hd) copied, each contiguous. Backward: dq, dk (rotated back), dv (each contiguous, or null:
// zeros) -> dqkv (B, T, H + 2K, hd), and the bias gradient (float32 column sums of dqkv as
// stored) when dbias is not null, summed over fixed row blocks then in block order (the same
// bits for any thread count).

inline float add_rounded(float a, float b, float) { return a + b; }
inline float add_rounded(float a, float b, uint16_t) {
  float v = a + b;
  return v != v ? v : round_bf16(v);  // an added float32 NaN may carry any payload
}

// xb[i] = x[i] + bias[i] rounded to T (add_rounded), sixteen lanes at a time when hd allows: the
// same sum and rounding per element (a NaN sum kept as is, then truncated as store truncates).
template <typename T, typename BT>
inline void add_bias_row(const T* x, const BT* bias, T* xb, int64_t hd) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= hd; i += 16) {
    __m512 v = _mm512_add_ps(load16(x + i), load16(bias + i));
    if (sizeof(T) == 2) {
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      v = _mm512_mask_blend_ps(nan, round16(v), v);
    }
    store16(v, xb + i);
  }
#endif
  for (; i < hd; ++i) store(add_rounded(load(x[i]), load(bias[i]), T()), &xb[i]);
}

// acc[i] += out[i] (float32), sixteen lanes at a time when hd allows (the same sums).
template <typename T>
inline void accumulate_row(const T* out, float* acc, int64_t hd) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= hd; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), load16(out + i)));
#endif
  for (; i < hd; ++i) acc[i] += load(out[i]);
}

#if defined(__AVX512F__)
// The split's whole-vector path (h = hd / 2 a multiple of 16, AVX-512): each head's two halves
// are read once, the bias added to both in registers (no row buffer to store and read back),
// and both rotated halves computed from them: the same operations on the same values as
// add_bias_row, rotate_head and accumulate_row above, so the same bits (a NaN sum is truncated as
// add_bias_row's store truncates it). About 2x the rows-of-calls path at head_dim 32 and 64.

// x + bias rounded to T as add_bias_row stores it; x alone without a bias.
template <typename T, typename BT>
inline __m512 load_biased(const T* x, const BT* bias) {
  __m512 v = load16(x);
  if (bias == nullptr) return v;
  v = _mm512_add_ps(v, load16(bias));
  if (sizeof(T) == 2) {
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512 cut = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    v = _mm512_mask_blend_ps(nan, round16(v), cut);
  }
  return v;
}

// a c + b s, as rotate_head computes one lane (bfloat16: each product and the sum rounded).
template <typename T>
inline __m512 rotate16(__m512 a, const float* c, __m512 b, const float* s) {
  const __m512 x = _mm512_mul_ps(a, _mm512_loadu_ps(c));
  const __m512 y = _mm512_mul_ps(b, _mm512_loadu_ps(s));
  return sizeof(T) == 2 ? round16(_mm512_add_ps(round16(x), round16(y))) : _mm512_add_ps(x, y);
}

// One head of hd channels: y = rotate(x + bias) (rotate: cf, sf as load_tables made them), or
// y = x + bias copied (rotate false); acc += y when acc is not null.
template <typename T, typename BT, int64_t HD>
inline void head16(const T* __restrict x, const BT* __restrict bias, const float* __restrict cf,
                   const float* __restrict sf, T* __restrict y, float* __restrict acc,
                   bool rotate, int64_t hd_rt) {
  const int64_t h = (HD ? HD : hd_rt) / 2;
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 lo = load_biased(x + i, bias ? bias + i : bias);
    const __m512 hi = load_biased(x + h + i, bias ? bias + h + i : bias);
    const __m512 ylo = rotate ? rotate16<T>(lo, cf + i, hi, sf + i) : lo;
    const __m512 yhi = rotate ? rotate16<T>(hi, cf + h + i, lo, sf + h + i) : hi;
    store16(ylo, y + i);
    store16(yhi, y + h + i);
    if (acc) {
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), ylo));
      _mm512_storeu_ps(acc + h + i, _mm512_add_ps(_mm512_loadu_ps(acc + h + i), yhi));
    }
  }
}
#endif

template <typename T, typename BT, int64_t HD>
void rope_split(const T* qkv, const BT* bias, int64_t nb, int64_t nt, int64_t h, int64_t kv,
                int64_t hd, const T* cos, const T* sgn, T* q, T* k, T* v) {
  const int64_t heads = h + 2 * kv;
  at::parallel_for(0, nb * nt, 8, [&](int64_t begin, int64_t end) {
    float cf[kMaxHeadDim], sf[kMaxHeadDim];
    T xb[kMaxHeadDim];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / nt, t = row % nt;
      load_tables(cos + t * hd, sgn + t * hd, cf, sf, hd, false);
#if defined(__AVX512F__)
      if ((hd / 2) % 16 == 0) {
        for (int64_t n = 0; n < heads; ++n) {
          T* y = n < h        ? q + ((b * h + n) * nt + t) * hd
                 : n < h + kv ? k + ((b * kv + n - h) * nt + t) * hd
                              : v + ((b * kv + n - h - kv) * nt + t) * hd;
          head16<T, BT, HD>(qkv + (row * heads + n) * hd, bias ? bias + n * hd : bias, cf, sf, y,
                            nullptr, n < h + kv, hd);
        }
        continue;
      }
#endif
      for (int64_t n = 0; n < heads; ++n) {
        const T* x = qkv + (row * heads + n) * hd;
        if (bias) {
          add_bias_row(x, bias + n * hd, xb, hd);
          x = xb;
        }
        if (n < h) {
          rotate_head<T, HD>(x, cf, sf, q + ((b * h + n) * nt + t) * hd, hd);
        } else if (n < h + kv) {
          rotate_head<T, HD>(x, cf, sf, k + ((b * kv + n - h) * nt + t) * hd, hd);
        } else {
          std::memcpy(v + ((b * kv + n - h - kv) * nt + t) * hd, x, hd * sizeof(T));
        }
      }
    }
  });
}

template <typename T, int64_t HD>
void rope_split_backward(const T* dq, const T* dk, const T* dv, int64_t nb, int64_t nt, int64_t h,
                         int64_t kv, int64_t hd, const T* cos, const T* sgn, T* dqkv,
                         float* dbias) {
  const int64_t heads = h + 2 * kv, width = heads * hd, rows = nb * nt;
  // row blocks fixed by the shape alone (see the header): at most 64, at least 16 rows each
  int64_t blocks = (rows + 15) / 16;
  if (blocks > 64) blocks = 64;
  if (blocks < 1) blocks = 1;
  const int64_t per = (rows + blocks - 1) / blocks;
  std::vector<float> sums(dbias ? static_cast<size_t>(blocks * width) : 0, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
    float cf[kMaxHeadDim], sf[kMaxHeadDim];
    for (int64_t blk = k0; blk < k1; ++blk) {
      float* acc = dbias ? sums.data() + blk * width : nullptr;
      const int64_t r1 = (blk + 1) * per < rows ? (blk + 1) * per : rows;
      for (int64_t row = blk * per; row < r1; ++row) {
        const int64_t b = row / nt, t = row % nt;
        load_tables(cos + t * hd, sgn + t * hd, cf, sf, hd, true);
        for (int64_t n = 0; n < heads; ++n) {
          T* out = dqkv + (row * heads + n) * hd;
#if defined(__AVX512F__)
          if ((hd / 2) % 16 == 0) {
            const T* g = n < h        ? (dq ? dq + ((b * h + n) * nt + t) * hd : nullptr)
                         : n < h + kv ? (dk ? dk + ((b * kv + n - h) * nt + t) * hd : nullptr)
                                      : (dv ? dv + ((b * kv + n - h - kv) * nt + t) * hd : nullptr);
            if (g) {
              head16<T, T, HD>(g, nullptr, cf, sf, out, acc ? acc + n * hd : nullptr,
                               n < h + kv, hd);
            } else {
              std::memset(static_cast<void*>(out), 0, hd * sizeof(T));
            }
            continue;
          }
#endif
          const T* g = n < h ? (dq ? dq + ((b * h + n) * nt + t) * hd : nullptr)
                       : n < h + kv ? (dk ? dk + ((b * kv + n - h) * nt + t) * hd : nullptr)
                                    : (dv ? dv + ((b * kv + n - h - kv) * nt + t) * hd : nullptr);
          if (!g) {
            std::memset(static_cast<void*>(out), 0, hd * sizeof(T));
          } else if (n < h + kv) {
            rotate_head<T, HD>(g, cf, sf, out, hd);
          } else {
            std::memcpy(out, g, hd * sizeof(T));
          }
          if (acc) accumulate_row(out, acc + n * hd, hd);
        }
      }
    }
  });
  if (dbias) {
    for (int64_t i = 0; i < width; ++i) dbias[i] = 0.0f;
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t i = 0; i < width; ++i) dbias[i] += sums[blk * width + i];
  }
}

template <typename T, typename BT>
void rope_split_any(const void* qkv, const void* bias, int64_t nb, int64_t nt, int64_t h,
                    int64_t kv, int64_t hd, const void* cos, const void* sgn, void* q, void* k,
                    void* v) {
  auto x = static_cast<const T*>(qkv);
  auto bp = static_cast<const BT*>(bias);
  auto c = static_cast<const T*>(cos);
  auto sg = static_cast<const T*>(sgn);
  auto qp = static_cast<T*>(q);
  auto kp = static_cast<T*>(k);
  auto vp = static_cast<T*>(v);
#define LMLAB_ROPE_HD(N)                                                     \
  if (hd == N) {                                                             \
    rope_split<T, BT, N>(x, bp, nb, nt, h, kv, hd, c, sg, qp, kp, vp);       \
    return;                                                                  \
  }
  LMLAB_ROPE_HD(32)
  LMLAB_ROPE_HD(64)
  LMLAB_ROPE_HD(128)
#undef LMLAB_ROPE_HD
  rope_split<T, BT, 0>(x, bp, nb, nt, h, kv, hd, c, sg, qp, kp, vp);
}

template <typename T>
void rope_split_backward_any(const void* dq, const void* dk, const void* dv, int64_t nb, int64_t nt,
                             int64_t h, int64_t kv, int64_t hd, const void* cos, const void* sgn,
                             void* dqkv, float* dbias) {
  auto a = static_cast<const T*>(dq);
  auto b = static_cast<const T*>(dk);
  auto c = static_cast<const T*>(dv);
  auto cs = static_cast<const T*>(cos);
  auto sg = static_cast<const T*>(sgn);
  auto out = static_cast<T*>(dqkv);
#define LMLAB_ROPE_HD(N)                                                              \
  if (hd == N) {                                                                      \
    rope_split_backward<T, N>(a, b, c, nb, nt, h, kv, hd, cs, sg, out, dbias);        \
    return;                                                                           \
  }
  LMLAB_ROPE_HD(32)
  LMLAB_ROPE_HD(64)
  LMLAB_ROPE_HD(128)
#undef LMLAB_ROPE_HD
  rope_split_backward<T, 0>(a, b, c, nb, nt, h, kv, hd, cs, sg, out, dbias);
}

}  // namespace

extern "C" {

// dtype 0: float32, 1: bfloat16. Returns 0, or 1 for a head_dim it does not take (odd, > 1024).
int lmlab_rope(int dtype, const void* x, int64_t nb, int64_t nh, int64_t nt, int64_t hd,
               int64_t sxb, int64_t sxn, int64_t sxt, const void* cos, const void* sgn, void* y,
               int64_t syb, int64_t syn, int64_t syt, int inverse) {
  if (hd < 2 || hd % 2 || hd > kMaxHeadDim) return 1;
  if (dtype == 0) {
    rope_any<float>(static_cast<const float*>(x), nb, nh, nt, hd, sxb, sxn, sxt,
                static_cast<const float*>(cos), static_cast<const float*>(sgn),
                static_cast<float*>(y), syb, syn, syt, inverse != 0);
  } else if (dtype == 1) {
    rope_any<uint16_t>(static_cast<const uint16_t*>(x), nb, nh, nt, hd, sxb, sxn, sxt,
                   static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sgn),
                   static_cast<uint16_t*>(y), syb, syn, syt, inverse != 0);
  } else {
    return 1;
  }
  return 0;
}

int lmlab_rope_max_head_dim() { return static_cast<int>(kMaxHeadDim); }

// dtype 0: float32, 1: bfloat16 (qkv, cos, sgn, q, k, v); bias_dtype likewise for the bias (null
// for none). Returns 0, or 1 for what it does not take (an odd or too large head_dim, a dtype).
int lmlab_rope_split(int dtype, const void* qkv, const void* bias, int bias_dtype, int64_t nb,
                     int64_t nt, int64_t h, int64_t kv, int64_t hd, const void* cos,
                     const void* sgn, void* q, void* k, void* v) {
  if (hd < 2 || hd % 2 || hd > kMaxHeadDim) return 1;
  if (dtype == 0 && (bias == nullptr || bias_dtype == 0)) {
    rope_split_any<float, float>(qkv, bias, nb, nt, h, kv, hd, cos, sgn, q, k, v);
  } else if (dtype == 1 && (bias == nullptr || bias_dtype == 0)) {
    rope_split_any<uint16_t, float>(qkv, bias, nb, nt, h, kv, hd, cos, sgn, q, k, v);
  } else if (dtype == 1 && bias_dtype == 1) {
    rope_split_any<uint16_t, uint16_t>(qkv, bias, nb, nt, h, kv, hd, cos, sgn, q, k, v);
  } else {
    return 1;
  }
  return 0;
}

// dq, dk, dv: contiguous or null (zeros); dbias: ((H + 2K) hd,) float32 or null.
int lmlab_rope_split_backward(int dtype, const void* dq, const void* dk, const void* dv, int64_t nb,
                              int64_t nt, int64_t h, int64_t kv, int64_t hd, const void* cos,
                              const void* sgn, void* dqkv, float* dbias) {
  if (hd < 2 || hd % 2 || hd > kMaxHeadDim) return 1;
  if (dtype == 0) {
    rope_split_backward_any<float>(dq, dk, dv, nb, nt, h, kv, hd, cos, sgn, dqkv, dbias);
  } else if (dtype == 1) {
    rope_split_backward_any<uint16_t>(dq, dk, dv, nb, nt, h, kv, hd, cos, sgn, dqkv, dbias);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
