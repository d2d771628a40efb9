// SIMD helpers shared by lmlab's training kernels (train_kernels.cpp, attention_kernels.cpp):
// bfloat16 <-> float32 conversion (round to nearest even, NaN kept quiet), e^x by a degree-5 fit
// (relative error 2.4e-7), scalar and sixteen lanes at a time (AVX-512 F + BW builds).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LMLAB_TRAIN_AVX512 1
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

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

// e^r's degree-5 fit on |r| <= ln2 / 2 (relative error 2.4e-7)
constexpr float kExpP[6] = {1.0000001f, 0.99999964f, 0.499989f, 0.16667663f, 0.04191505f,
                            0.00829172f};
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpLo = -87.0f;  // e^x is 0 below -87 (e^-87 = 1.6e-38, float32's smallest normal)
// e^x for x <= 1 (NaN for NaN): x = n ln2 + r, |r| <= ln2 / 2, e^r by kExpP, times 2^n.
inline float exp_f(float x) {
  if (x != x) return x;                  // NaN (and no NaN reaches the int conversion below)
  if (x < kExpLo) return 0.0f;           // -inf included: a masked score weighs exactly 0
  float n = std::nearbyint(x * kLog2e);
  float xc = x;
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpP[5];
  for (int i = 4; i >= 0; --i) p = p * r + kExpP[i];
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef LMLAB_TRAIN_AVX512
// The same formulas sixteen lanes at a time; max(lo, x) keeps a NaN x (the second operand wins).
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
  // 0 below -87 (-inf included: a masked score weighs exactly 0); a NaN compares false, stays
  __mmask16 under = _mm512_cmp_ps_mask(x, bcast(kExpLo), _CMP_LT_OQ);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// v rounded to bfloat16, sixteen lanes (with AVX512-BF16 its conversion, which also flushes
// subnormal inputs and results to zero).
inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // nearest even, NaN quiet
#else
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// Stores v rounded to T (store16_masked: the lanes selected by m only, rounded alike).
inline void store16(__m512 v, float* p) { _mm512_storeu_ps(p, v); }
inline void store16(__m512 v, uint16_t* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v));
}
inline void store16_masked(__m512 v, float* p, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16_masked(__m512 v, uint16_t* p, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, to_bf16x16(v));
}
#endif

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

// Sixteen lanes (Full) or the lanes of mk (a row's masked tail, the others read as 0 and left
// unwritten), widened from / rounded to T: one body serves a row's full vectors and its tail.
template <bool Full, typename T>
inline __m512 part_load16(const T* p, __mmask16 mk) {
  return Full ? load16(p) : load16_masked(p, mk, _mm512_setzero_ps());
}
template <bool Full, typename T>
inline void part_store16(__m512 v, T* p, __mmask16 mk) {
  if (Full) store16(v, p);
  else store16_masked(v, p, mk);
}
#endif

}  // namespace
