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

#include <cstdint>
#include <cstring>

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
template <typename T, int64_t HD>
inline void rotate_head(const T* __restrict x, const float* __restrict c,
                        const float* __restrict s, T* __restrict y, int64_t hd_rt) {
  constexpr bool kBf16 = sizeof(T) == 2;
  const int64_t hd = HD ? HD : hd_rt;
  const int64_t h = hd / 2;
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

template <typename T, int64_t HD>
void rope(const T* x, int64_t nb, int64_t nh, int64_t nt, int64_t hd, int64_t sxb, int64_t sxn,
          int64_t sxt, const T* cos, const T* sgn, T* y, int64_t syb, int64_t syn, int64_t syt,
          bool inverse) {
  at::parallel_for(0, nb * nt, 8, [&](int64_t begin, int64_t end) {
    float cf[kMaxHeadDim], sf[kMaxHeadDim];
    const int64_t h = hd / 2;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / nt, t = row % nt;
      for (int64_t i = 0; i < hd; ++i) {
        const int64_t j = i < h ? i + h : i - h;
        cf[i] = load(cos[t * hd + i]);
        sf[i] = load(sgn[t * hd + (inverse ? j : i)]);
      }
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

}  // extern "C"
