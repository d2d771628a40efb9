// lmlab's CPU kernels for training: passes that torch's eager graph makes separately, made once.
//
// 1. A linear layer's bias + GELU (lmlab.nn.train_kernel.bias_gelu).
//
// Legend: R rows (batch x tokens), C columns (the layer's d_ff outputs), h (R, C) the matmul's
// output without its bias, b (C,) the bias (float32 or the input's dtype; absent = 0).
//
//   forward:  y = gelu(h + b)                                  (R, C), h's dtype
//   backward: dz = g * gelu'(h + b)                            (R, C), h's dtype
//             db = sum over rows of dz (float32 accumulation)  (C,) float32
//
// where gelu(z) = z Phi(z) (Hendrycks & Gimpel 2016, exact: Phi the normal CDF) and gelu'(z) =
// Phi(z) + z phi(z); approximate = 1 is GPT-2's tanh form, gelu(z) = z (1 + tanh(k (z + a z^3)))
// / 2, k = sqrt(2 / pi), a = 0.044715. Torch's eager path makes these passes: addmm's bias
// broadcast into its output, the GEMM's read of it, gelu, gelu_backward, and the bias
// gradient's column sum; here the matmul runs without its bias and one pass does the rest.
//
// 2. Causal softmax over attention scores (lmlab.nn.train_kernel.causal_softmax).
//
// Legend: N batch x heads, T tokens; S (N, T, T) scores. Forward P[n, i, j] = softmax over
// j <= i of S[n, i, :] for j <= i, 0 for j > i (torch: masked_fill of -inf above the diagonal,
// then softmax over the whole row: two passes over all T^2 entries); backward dS = P (dP -
// rowsum(P dP)) over j <= i, 0 above (torch's softmax backward runs over whole rows). Only the
// lower triangle is read, and both may run in place (P over S, dS over dP).
//
// Arithmetic is float32 (bfloat16 values widened, each result rounded once, to nearest even).
// erf(u) = u P(u^2) / Q(u^2) on |u| <= 3.92 (+-1 beyond, as in float32), a rational fit with
// absolute error below 6e-7; e^x by a degree-5 fit after range reduction (relative error
// 2.4e-7). So values are within about 1e-6 of the float64 formulas before the one rounding:
// not bit-equal to torch's kernels, which round the biased matmul output to bfloat16 before
// the GELU, use other approximations (Abramowitz & Stegun 7.1.26 with their own exp), and sum
// the softmax in another order. Like theirs, Phi(z) = (1 + erf) / 2 has only absolute accuracy
// where it is tiny (z below about -4). NaN in gives NaN out. AVX-512 (F + BW) builds run
// sixteen columns at a time with the same formulas; other builds and the last C mod 16 columns
// run them scalar. Rows are split over threads with at::parallel_for; the bias gradient sums
// fixed row blocks each in float32, then adds the block sums in order: the same bits for any
// thread count.

#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LMLAB_TRAIN_AVX512 1
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f rounded to bfloat16, nearest even (as c10::BFloat16); a NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(f != f ? nan : r);
}

inline float load(float v) { return v; }
inline float load(uint16_t v) { return bf16_to_f32(v); }
inline void store(float v, float* dst) { *dst = v; }
inline void store(float v, uint16_t* dst) { *dst = f32_to_bf16(v); }
inline float rounded(float v, float) { return v; }
inline float rounded(float v, uint16_t) { return bf16_to_f32(f32_to_bf16(v)); }

// The fits (see the header): erf's rational on |u| <= kErfClamp, e^r's polynomial.
constexpr float kErfClamp = 3.92f;
constexpr float kErfP[7] = {1.1283792e+00f,  1.7916071e-01f, 4.7802895e-02f, 2.8543177e-03f,
                            1.2474964e-04f, -1.9711647e-06f, 2.1797161e-08f};
constexpr float kErfQ[5] = {1.0f, 4.9211022e-01f, 1.0640265e-01f, 1.2590531e-02f, 7.6154672e-04f};
constexpr float kExpP[6] = {1.0000001f, 0.99999964f, 0.499989f, 0.16667663f, 0.04191505f,
                            0.00829172f};
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpLo = -87.0f;  // e^x is taken at max(x, -87): 1.6e-38, not 0, below it
constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhK = 0.79788456080286536f, kTanhA = 0.044715f;  // sqrt(2 / pi), GPT-2's a

// e^x for x <= 1 (NaN for NaN): x = n ln2 + r, |r| <= ln2 / 2, e^r by kExpP, times 2^n.
inline float exp_f(float x) {
  float xc = x < kExpLo ? kExpLo : x;  // NaN compares false: stays NaN
  float n = std::nearbyint(xc * kLog2e);
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpP[5];
  for (int i = 4; i >= 0; --i) p = p * r + kExpP[i];
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// erf(u): the rational fit inside +-kErfClamp, exactly +-1 outside (as float32's erf is there)
inline float erf_f(float u) {
  float uc = u > kErfClamp ? kErfClamp : (u < -kErfClamp ? -kErfClamp : u);  // NaN stays
  float s = uc * uc;
  float p = kErfP[6], q = kErfQ[4];
  for (int i = 5; i >= 0; --i) p = p * s + kErfP[i];
  for (int i = 3; i >= 0; --i) q = q * s + kErfQ[i];
  return u >= kErfClamp ? 1.0f : (u <= -kErfClamp ? -1.0f : uc * p / q);
}

// gelu(z) and, when want_grad, gelu'(z) into *grad.
template <bool want_grad, bool approximate>
inline float gelu(float z, float* grad) {
  if (!approximate) {
    float cdf = 0.5f + 0.5f * erf_f(z * kSqrtHalf);
    if (want_grad) *grad = cdf + z * (kInvSqrt2Pi * exp_f(-0.5f * z * z));
    return z * cdf;
  }
  float u = kTanhK * (z + kTanhA * z * z * z);
  float e = exp_f(-2.0f * (u < 0.0f ? -u : u));  // tanh(|u|) = (1 - e) / (1 + e)
  float th = (1.0f - e) / (1.0f + e);
  th = u < 0.0f ? -th : th;
  float cdf = 0.5f * (1.0f + th);
  if (want_grad) *grad = cdf + 0.5f * z * (1.0f - th * th) * kTanhK * (1.0f + 3.0f * kTanhA * z * z);
  return z * cdf;
}

#ifdef LMLAB_TRAIN_AVX512
// The same formulas sixteen lanes at a time. 1 / x is rcp14 refined by one Newton step
// (relative error about 1e-8, where the divide is exact); max(lo, x) and min(hi, x) keep a NaN
// x (the second operand wins).
inline __m512 bcast(float v) { return _mm512_set1_ps(v); }

inline __m512 exp16(__m512 x) {
  const __m512 shift = bcast(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  __m512 xc = _mm512_max_ps(bcast(kExpLo), x);
  __m512 big = _mm512_fmadd_ps(xc, bcast(kLog2e), shift);
  __m512 n = _mm512_sub_ps(big, shift);
  __m512 r = _mm512_fnmadd_ps(n, bcast(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, bcast(kLn2Lo), r);
  __m512 p = bcast(kExpP[5]);
  for (int i = 4; i >= 0; --i) p = _mm512_fmadd_ps(p, r, bcast(kExpP[i]));
  // big's low mantissa bits hold n (two's complement): (n + 127) << 23 is 2^n
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(big), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

inline __m512 recip16(__m512 d) {
  __m512 t = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, bcast(2.0f)));
}

inline __m512 erf16(__m512 u) {
  __m512 uc = _mm512_min_ps(bcast(kErfClamp), _mm512_max_ps(bcast(-kErfClamp), u));
  __m512 s = _mm512_mul_ps(uc, uc);
  __m512 p = bcast(kErfP[6]), q = bcast(kErfQ[4]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, s, bcast(kErfP[i]));
  for (int i = 3; i >= 0; --i) q = _mm512_fmadd_ps(q, s, bcast(kErfQ[i]));
  __m512 r = _mm512_mul_ps(_mm512_mul_ps(uc, p), recip16(q));
  // exactly +-1 outside the fit's range (a NaN compares false and stays)
  __mmask16 out = _mm512_cmp_ps_mask(_mm512_abs_ps(u), bcast(kErfClamp), _CMP_GE_OQ);
  return _mm512_mask_blend_ps(out, r, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), bcast(1.0f), bcast(-1.0f)));
}

template <bool want_grad, bool approximate>
inline __m512 gelu16(__m512 z, __m512* grad) {
  const __m512 half = bcast(0.5f), one = bcast(1.0f);
  if (!approximate) {
    __m512 cdf = _mm512_fmadd_ps(half, erf16(_mm512_mul_ps(z, bcast(kSqrtHalf))), half);
    if (want_grad) {
      __m512 pdf = _mm512_mul_ps(bcast(kInvSqrt2Pi), exp16(_mm512_mul_ps(bcast(-0.5f), _mm512_mul_ps(z, z))));
      *grad = _mm512_fmadd_ps(z, pdf, cdf);
    }
    return _mm512_mul_ps(z, cdf);
  }
  __m512 z2 = _mm512_mul_ps(z, z);
  __m512 u = _mm512_mul_ps(bcast(kTanhK), _mm512_fmadd_ps(_mm512_mul_ps(bcast(kTanhA), z2), z, z));
  __m512 e = exp16(_mm512_mul_ps(bcast(-2.0f), _mm512_abs_ps(u)));
  __m512 th = _mm512_mul_ps(_mm512_sub_ps(one, e), recip16(_mm512_add_ps(one, e)));
  __mmask16 neg = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ);
  th = _mm512_mask_sub_ps(th, neg, _mm512_setzero_ps(), th);
  __m512 cdf = _mm512_mul_ps(half, _mm512_add_ps(one, th));
  if (want_grad) {
    __m512 sech2 = _mm512_fnmadd_ps(th, th, one);
    __m512 du = _mm512_mul_ps(bcast(kTanhK), _mm512_fmadd_ps(bcast(3.0f * kTanhA), z2, one));
    *grad = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(half, z), sech2), du, cdf);
  }
  return _mm512_mul_ps(z, cdf);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Stores v (rounded to T) and returns the value stored, as float32.
inline __m512 store16(__m512 v, float* p) {
  _mm512_storeu_ps(p, v);
  return v;
}
inline __m512 store16(__m512 v, uint16_t* p) {
#if defined(__AVX512BF16__)
  __m256i w = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // nearest even, NaN quiet
#else
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  __m256i w = _mm512_cvtepi32_epi16(r);
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}
#endif

// y[r, :] = gelu(h[r, :] + b) for rows [r0, r1) (HasBias false: b unused).
template <typename T, typename B, bool HasBias, bool Approx>
void forward_rows(const T* __restrict__ h, const B* __restrict__ b, T* __restrict__ y, int64_t r0,
                  int64_t r1, int64_t c) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict__ hr = h + r * c;
    T* __restrict__ yr = y + r * c;
    int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
    for (; j + 16 <= c; j += 16) {
      __m512 z = load16(hr + j);
      if (HasBias) z = _mm512_add_ps(z, load16(b + j));
      store16(gelu16<false, Approx>(z, nullptr), yr + j);
    }
#endif
    for (; j < c; ++j) store(gelu<false, Approx>(load(hr[j]) + (HasBias ? load(b[j]) : 0.0f), nullptr), yr + j);
  }
}

// dz[r, :] = g[r, :] gelu'(h[r, :] + b) for rows [r0, r1), and (WantSum) acc[:] += the column
// sums of dz as stored (rounded to T: what the unfused graph's bias gradient sums).
template <typename T, typename B, bool HasBias, bool WantSum, bool Approx>
void backward_rows(const T* __restrict__ g, const T* __restrict__ h, const B* __restrict__ b,
                   T* __restrict__ dz, float* __restrict__ acc, int64_t r0, int64_t r1, int64_t c) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict__ gr = g + r * c;
    const T* __restrict__ hr = h + r * c;
    T* __restrict__ dr = dz + r * c;
    int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
    for (; j + 16 <= c; j += 16) {
      __m512 z = load16(hr + j);
      if (HasBias) z = _mm512_add_ps(z, load16(b + j));
      __m512 d;
      gelu16<true, Approx>(z, &d);
      __m512 v = store16(_mm512_mul_ps(load16(gr + j), d), dr + j);
      if (WantSum) _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), v));
    }
#endif
    for (; j < c; ++j) {
      float d;
      gelu<true, Approx>(load(hr[j]) + (HasBias ? load(b[j]) : 0.0f), &d);
      float v = load(gr[j]) * d;
      store(v, dr + j);
      if (WantSum) acc[j] += rounded(v, T());
    }
  }
}

constexpr int64_t kGrain = 16384;  // elements per parallel task, at least

constexpr int64_t kMaxBlocks = 64;  // row blocks of the bias gradient's sums, at most

int64_t grain_rows(int64_t c) { return c >= kGrain ? 1 : kGrain / (c > 0 ? c : 1); }

template <typename T, typename B>
void forward(const void* h, const void* b, void* y, int64_t rows, int64_t c, bool approx) {
  at::parallel_for(0, rows, grain_rows(c), [&](int64_t r0, int64_t r1) {
    auto hp = static_cast<const T*>(h);
    auto bp = static_cast<const B*>(b);
    auto yp = static_cast<T*>(y);
    if (b && approx) forward_rows<T, B, true, true>(hp, bp, yp, r0, r1, c);
    else if (b) forward_rows<T, B, true, false>(hp, bp, yp, r0, r1, c);
    else if (approx) forward_rows<T, B, false, true>(hp, bp, yp, r0, r1, c);
    else forward_rows<T, B, false, false>(hp, bp, yp, r0, r1, c);
  });
}

template <typename T, typename B>
void backward(const void* g, const void* h, const void* b, void* dz, float* db, int64_t rows,
              int64_t c, bool approx) {
  // row blocks fixed by the shape alone (at::parallel_for's split depends on the thread
  // count): each block's column sums in its own buffer, then added in block order, so the bias
  // gradient has the same bits for any number of threads.
  int64_t grain = grain_rows(c);
  int64_t blocks = (rows + grain - 1) / grain;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks < 1) blocks = 1;
  int64_t per = (rows + blocks - 1) / blocks;
  std::vector<float> sums(db ? static_cast<size_t>(blocks * c) : 0, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      int64_t r0 = k * per, r1 = r0 + per < rows ? r0 + per : rows;
      if (r0 >= r1) continue;
      auto gp = static_cast<const T*>(g);
      auto hp = static_cast<const T*>(h);
      auto bp = static_cast<const B*>(b);
      auto dp = static_cast<T*>(dz);
      float* acc = db ? sums.data() + k * c : nullptr;
      if (b && db && approx) backward_rows<T, B, true, true, true>(gp, hp, bp, dp, acc, r0, r1, c);
      else if (b && db) backward_rows<T, B, true, true, false>(gp, hp, bp, dp, acc, r0, r1, c);
      else if (b && approx) backward_rows<T, B, true, false, true>(gp, hp, bp, dp, acc, r0, r1, c);
      else if (b) backward_rows<T, B, true, false, false>(gp, hp, bp, dp, acc, r0, r1, c);
      else if (approx) backward_rows<T, B, false, false, true>(gp, hp, bp, dp, acc, r0, r1, c);
      else backward_rows<T, B, false, false, false>(gp, hp, bp, dp, acc, r0, r1, c);
    }
  });
  if (db) {
    for (int64_t j = 0; j < c; ++j) db[j] = 0.0f;
    for (int64_t k = 0; k < blocks; ++k)
      for (int64_t j = 0; j < c; ++j) db[j] += sums[k * c + j];
  }
}


// ---- causal softmax -------------------------------------------------------------------------

#ifdef LMLAB_TRAIN_AVX512
inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline __m512 load16_masked(const float* p, __mmask16 m, __m512 fill) {
  return _mm512_mask_loadu_ps(fill, m, p);
}
inline __m512 load16_masked(const uint16_t* p, __mmask16 m, __m512 fill) {
  __m256i w = _mm256_maskz_loadu_epi16(m, p);
  __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  return _mm512_mask_blend_ps(m, fill, v);
}
#endif

// One row: p[0..n) = softmax(s[0..n)), p[n..t) = 0; e is a float scratch row of >= n.
template <typename T>
void softmax_row(const T* s, T* p, float* e, int64_t n, int64_t t) {
  float m = -INFINITY, sum = 0.0f;
  int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, load16(s + j));
  if (j < n) vm = _mm512_max_ps(vm, load16_masked(s + j, tail_mask(n - j), _mm512_set1_ps(-INFINITY)));
  m = _mm512_reduce_max_ps(vm);
  j = 0;
  __m512 vsum = _mm512_setzero_ps(), bm = _mm512_set1_ps(m);
  for (; j + 16 <= n; j += 16) {
    __m512 v = exp16(_mm512_sub_ps(load16(s + j), bm));
    _mm512_storeu_ps(e + j, v);
    vsum = _mm512_add_ps(vsum, v);
  }
  if (j < n) {
    __mmask16 k = tail_mask(n - j);
    __m512 v = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(load16_masked(s + j, k, bm), bm)));
    _mm512_mask_storeu_ps(e + j, k, v);
    vsum = _mm512_add_ps(vsum, v);
  }
  sum = _mm512_reduce_add_ps(vsum);
  float inv = 1.0f / sum;
  __m512 vinv = _mm512_set1_ps(inv);
  j = 0;
  for (; j + 16 <= n; j += 16) store16(_mm512_mul_ps(_mm512_loadu_ps(e + j), vinv), p + j);
  for (; j < n; ++j) store(e[j] * inv, p + j);
#else
  for (j = 0; j < n; ++j) m = load(s[j]) > m ? load(s[j]) : m;
  for (j = 0; j < n; ++j) {
    e[j] = exp_f(load(s[j]) - m);
    sum += e[j];
  }
  float inv = 1.0f / sum;
  for (j = 0; j < n; ++j) store(e[j] * inv, p + j);  // a NaN score: NaN sum, NaN row
#endif
  std::memset(static_cast<void*>(p + n), 0, static_cast<size_t>(t - n) * sizeof(T));
}

// One row: ds[0..n) = p (dp - sum(p dp)) over [0, n), ds[n..t) = 0 (ds may be dp).
template <typename T>
void softmax_backward_row(const T* p, const T* dp, T* ds, int64_t n, int64_t t) {
  float dot = 0.0f;
  int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
  __m512 vdot = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) vdot = _mm512_fmadd_ps(load16(p + j), load16(dp + j), vdot);
  if (j < n) {
    __mmask16 k = tail_mask(n - j);
    __m512 z = _mm512_setzero_ps();
    vdot = _mm512_fmadd_ps(load16_masked(p + j, k, z), load16_masked(dp + j, k, z), vdot);
  }
  dot = _mm512_reduce_add_ps(vdot);
  __m512 bdot = _mm512_set1_ps(dot);
  j = 0;
  for (; j + 16 <= n; j += 16)
    store16(_mm512_mul_ps(load16(p + j), _mm512_sub_ps(load16(dp + j), bdot)), ds + j);
#else
  for (j = 0; j < n; ++j) dot += load(p[j]) * load(dp[j]);
  j = 0;
#endif
  for (; j < n; ++j) store(load(p[j]) * (load(dp[j]) - dot), ds + j);
  std::memset(static_cast<void*>(ds + n), 0, static_cast<size_t>(t - n) * sizeof(T));
}

template <typename T>
void causal_softmax(const void* s, void* p, int64_t batch, int64_t t) {
  // each task: whole (T, T) matrices, so every task has the same triangle of work
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> e(static_cast<size_t>(t));
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < t; ++i) {
        int64_t off = (b * t + i) * t;
        softmax_row(static_cast<const T*>(s) + off, static_cast<T*>(p) + off, e.data(), i + 1, t);
      }
  });
}

template <typename T>
void causal_softmax_backward(const void* p, const void* dp, void* ds, int64_t batch, int64_t t) {
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < t; ++i) {
        int64_t off = (b * t + i) * t;
        softmax_backward_row(static_cast<const T*>(p) + off, static_cast<const T*>(dp) + off,
                             static_cast<T*>(ds) + off, i + 1, t);
      }
  });
}

}  // namespace

// dtype: 0 float32, 1 bfloat16 (h, y, g, dz); bias_dtype: 0 float32, 1 bfloat16 (ignored when
// b is null). All tensors contiguous. Returns 0, or 1 for an unknown dtype.
extern "C" int lmlab_bias_gelu_forward(int dtype, int bias_dtype, const void* h, const void* b,
                                       void* y, int64_t rows, int64_t c, int approximate) {
  bool a = approximate != 0;
  if (dtype == 0 && bias_dtype == 0) forward<float, float>(h, b, y, rows, c, a);
  else if (dtype == 1 && bias_dtype == 0) forward<uint16_t, float>(h, b, y, rows, c, a);
  else if (dtype == 1 && bias_dtype == 1) forward<uint16_t, uint16_t>(h, b, y, rows, c, a);
  else return 1;
  return 0;
}

// db: null for no bias gradient, else (C,) float32 (written, not accumulated).
extern "C" int lmlab_bias_gelu_backward(int dtype, int bias_dtype, const void* g, const void* h,
                                        const void* b, void* dz, float* db, int64_t rows, int64_t c,
                                        int approximate) {
  bool a = approximate != 0;
  if (dtype == 0 && bias_dtype == 0) backward<float, float>(g, h, b, dz, db, rows, c, a);
  else if (dtype == 1 && bias_dtype == 0) backward<uint16_t, float>(g, h, b, dz, db, rows, c, a);
  else if (dtype == 1 && bias_dtype == 1) backward<uint16_t, uint16_t>(g, h, b, dz, db, rows, c, a);
  else return 1;
  return 0;
}

// s, p (N, T, T) contiguous, p may be s. dtype 0 float32, 1 bfloat16. Returns 0, or 1.
extern "C" int lmlab_causal_softmax_forward(int dtype, const void* s, void* p, int64_t n, int64_t t) {
  if (dtype == 0) causal_softmax<float>(s, p, n, t);
  else if (dtype == 1) causal_softmax<uint16_t>(s, p, n, t);
  else return 1;
  return 0;
}

// p, dp, ds (N, T, T) contiguous, ds may be dp.
extern "C" int lmlab_causal_softmax_backward(int dtype, const void* p, const void* dp, void* ds,
                                             int64_t n, int64_t t) {
  if (dtype == 0) causal_softmax_backward<float>(p, dp, ds, n, t);
  else if (dtype == 1) causal_softmax_backward<uint16_t>(p, dp, ds, n, t);
  else return 1;
  return 0;
}
