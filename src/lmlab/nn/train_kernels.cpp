// lmlab's CPU kernels for training: passes that torch's eager graph makes separately, made once.
// The causal softmax and its backward; LayerNorm / RMSNorm straight to bfloat16 and back; the
// global gradient norm and clipping in one call (lmlab.nn.train_kernel).
//
// Causal softmax over attention scores (lmlab.nn.train_kernel.causal_softmax_).
//
// Legend: N batch x heads, T tokens; S (N, T, T) scores. Forward P[n, i, j] = softmax over
// j <= i of S[n, i, :] for j <= i, 0 for j > i (torch: masked_fill of -inf above the diagonal,
// then softmax over the whole row: two passes over all T^2 entries); backward dS = P (dP -
// rowsum(P dP)) over j <= i, 0 above (torch's softmax backward runs over whole rows). Only the
// lower triangle is read, and both run in place (P over S, dS over dP).
//
// Arithmetic is float32 (bfloat16 values widened, each result rounded once, to nearest even);
// e^x by a degree-5 fit after range reduction (relative error 2.4e-7), so P is within a few
// float32 ulps of the float64 formula before its one rounding: not bit-equal to torch's kernel
// (its own exp, another summation order). A NaN score makes its row NaN, as in torch. AVX-512
// (F + BW) builds run sixteen columns at a time with the same formulas; other builds run them
// scalar. Whole (T, T) matrices are split over threads with at::parallel_for.

#include <ATen/Parallel.h>

#include "train_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// ---- causal softmax -------------------------------------------------------------------------

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

#ifdef LMLAB_TRAIN_AVX512
// Lanes j < n of vector v (channels 16 v .. 16 v + 15).
inline __mmask16 lanes_below(int64_t n, int64_t v) {
  const int64_t left = n - 16 * v;
  return left >= 16 ? static_cast<__mmask16>(0xffff) : left <= 0 ? 0 : tail_mask(left);
}

// softmax_row for a row of n <= 16 NV entries, held in NV registers (one read of s, one write of
// p, no scratch row, no scalar tail); the same formulas, so the same values as softmax_row.
template <int NV, typename T>
void softmax_row_regs(const T* s, T* p, int64_t n, int64_t t) {
  __m512 v[NV];
  __m512 vm = _mm512_set1_ps(-INFINITY);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int i = 0; i < NV; ++i) {
    v[i] = load16_masked(s + 16 * i, lanes_below(n, i), ninf);
    vm = _mm512_max_ps(vm, v[i]);
  }
  const __m512 bm = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 vsum = _mm512_setzero_ps();
  for (int i = 0; i < NV; ++i) {
    v[i] = _mm512_maskz_mov_ps(lanes_below(n, i), exp16(_mm512_sub_ps(v[i], bm)));
    vsum = _mm512_add_ps(vsum, v[i]);
  }
  const __m512 vinv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (int i = 0; i < NV; ++i) {
    const __mmask16 m = lanes_below(n, i);
    if (m == 0xffff) store16(_mm512_mul_ps(v[i], vinv), p + 16 * i);
    else if (m) store16_masked(_mm512_mul_ps(v[i], vinv), p + 16 * i, m);
  }
  std::memset(static_cast<void*>(p + n), 0, static_cast<size_t>(t - n) * sizeof(T));
}

// softmax_backward_row for n <= 16 NV entries in registers, the same formulas.
template <int NV, typename T>
void softmax_backward_row_regs(const T* p, const T* dp, T* ds, int64_t n, int64_t t) {
  __m512 vp[NV], vd[NV];
  __m512 vdot = _mm512_setzero_ps();
  const __m512 z = _mm512_setzero_ps();
  for (int i = 0; i < NV; ++i) {
    const __mmask16 m = lanes_below(n, i);
    vp[i] = load16_masked(p + 16 * i, m, z);
    vd[i] = load16_masked(dp + 16 * i, m, z);
    vdot = _mm512_fmadd_ps(vp[i], vd[i], vdot);
  }
  const __m512 bdot = _mm512_set1_ps(_mm512_reduce_add_ps(vdot));
  for (int i = 0; i < NV; ++i) {
    const __mmask16 m = lanes_below(n, i);
    const __m512 r = _mm512_mul_ps(vp[i], _mm512_sub_ps(vd[i], bdot));
    if (m == 0xffff) store16(r, ds + 16 * i);
    else if (m) store16_masked(r, ds + 16 * i, m);
  }
  std::memset(static_cast<void*>(ds + n), 0, static_cast<size_t>(t - n) * sizeof(T));
}

// A row of n entries through the register version holding it (n <= 256), else false.
template <typename T>
bool softmax_row_fast(const T* s, T* p, int64_t n, int64_t t) {
  if (n <= 16) softmax_row_regs<1>(s, p, n, t);
  else if (n <= 32) softmax_row_regs<2>(s, p, n, t);
  else if (n <= 64) softmax_row_regs<4>(s, p, n, t);
  else if (n <= 128) softmax_row_regs<8>(s, p, n, t);
  else if (n <= 256) softmax_row_regs<16>(s, p, n, t);
  else return false;
  return true;
}

template <typename T>
bool softmax_backward_row_fast(const T* p, const T* dp, T* ds, int64_t n, int64_t t) {
  if (n <= 16) softmax_backward_row_regs<1>(p, dp, ds, n, t);
  else if (n <= 32) softmax_backward_row_regs<2>(p, dp, ds, n, t);
  else if (n <= 64) softmax_backward_row_regs<4>(p, dp, ds, n, t);
  else if (n <= 128) softmax_backward_row_regs<8>(p, dp, ds, n, t);
  else if (n <= 256) softmax_backward_row_regs<16>(p, dp, ds, n, t);
  else return false;
  return true;
}
#else
template <typename T>
bool softmax_row_fast(const T*, T*, int64_t, int64_t) { return false; }
template <typename T>
bool softmax_backward_row_fast(const T*, const T*, T*, int64_t, int64_t) { return false; }
#endif

template <typename T>
void causal_softmax(const void* s, void* p, int64_t batch, int64_t t) {
  // each task: whole (T, T) matrices, so every task has the same triangle of work
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> e(static_cast<size_t>(t));
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < t; ++i) {
        int64_t off = (b * t + i) * t;
        const T* si = static_cast<const T*>(s) + off;
        T* pi = static_cast<T*>(p) + off;
        if (!softmax_row_fast(si, pi, i + 1, t)) softmax_row(si, pi, e.data(), i + 1, t);
      }
  });
}

template <typename T>
void causal_softmax_backward(const void* p, const void* dp, void* ds, int64_t batch, int64_t t) {
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < t; ++i) {
        int64_t off = (b * t + i) * t;
        const T* pi = static_cast<const T*>(p) + off;
        const T* dpi = static_cast<const T*>(dp) + off;
        T* dsi = static_cast<T*>(ds) + off;
        if (!softmax_backward_row_fast(pi, dpi, dsi, i + 1, t))
          softmax_backward_row(pi, dpi, dsi, i + 1, t);
      }
  });
}


// ---- LayerNorm / RMSNorm from the float32 residual stream to bfloat16 -----------------------
//
// x (R, D) float32 -> y (R, D) bfloat16: LayerNorm y = (x - mean) rstd w + b (rstd = 1 /
// sqrt(var + eps), the biased variance, two passes over the row), or RMSNorm y = x rstd w (rstd
// = 1 / sqrt(mean(x^2) + eps)); mean and rstd kept per row for the backward. What autocast's
// float32 norm followed by its bfloat16 cast for the next matmul computes, in one pass: the
// float32 output is never written. Backward, from dy (R, D) bfloat16: with xh = (x - mean) rstd
// and g = dy w, dx = rstd (g - mean(g) - xh mean(g xh)) (RMSNorm: without the mean(g) term)
// in float32, dw = sum over rows of dy xh, db = sum of dy, summed over fixed row blocks, then in
// block order (the same bits for any thread count).

template <bool RMS, bool HasB>
void norm_forward(const float* x, const float* w, const float* b, uint16_t* y, float* mean_out,
                  float* rstd_out, int64_t rows, int64_t d, float eps) {
  int64_t grain = d >= 4096 ? 1 : 4096 / d;
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict__ xr = x + r * d;
      uint16_t* __restrict__ yr = y + r * d;
      float mean = 0.0f, v = 0.0f;
      int64_t j0 = 0;
#ifdef LMLAB_TRAIN_AVX512
      const int64_t dv = d - d % 16;
      if (!RMS) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < dv; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xr + j));
        float s = _mm512_reduce_add_ps(acc);
        for (int64_t j = dv; j < d; ++j) s += xr[j];
        mean = s / static_cast<float>(d);
      }
      __m512 vm = _mm512_set1_ps(mean), acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < dv; j += 16) {
        __m512 c = _mm512_sub_ps(_mm512_loadu_ps(xr + j), vm);
        acc = _mm512_fmadd_ps(c, c, acc);
      }
      v = _mm512_reduce_add_ps(acc);
      for (int64_t j = dv; j < d; ++j) v += (xr[j] - mean) * (xr[j] - mean);
      float rstd = 1.0f / std::sqrt(v / static_cast<float>(d) + eps);
      __m512 vr = _mm512_set1_ps(rstd);
      for (int64_t j = 0; j < dv; j += 16) {
        __m512 o = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + j), vm), vr),
                                 _mm512_loadu_ps(w + j));
        if (HasB) o = _mm512_add_ps(o, _mm512_loadu_ps(b + j));
        store16(o, yr + j);
      }
      j0 = dv;
#else
      if (!RMS) {
        float s = 0.0f;
        for (int64_t j = 0; j < d; ++j) s += xr[j];
        mean = s / static_cast<float>(d);
      }
      for (int64_t j = 0; j < d; ++j) v += (xr[j] - mean) * (xr[j] - mean);
      float rstd = 1.0f / std::sqrt(v / static_cast<float>(d) + eps);
#endif
      for (int64_t j = j0; j < d; ++j) {
        float o = (xr[j] - mean) * rstd * w[j];
        if (HasB) o += b[j];
        yr[j] = f32_to_bf16(o);
      }
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  });
}

// out (width) = the sum of the blocks (blocks, width) of sums, added in block order.
inline void add_blocks(const std::vector<float>& sums, int64_t blocks, int64_t width, float* out) {
  for (int64_t j = 0; j < width; ++j) out[j] = 0.0f;
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t j = 0; j < width; ++j) out[j] += sums[k * width + j];
}

template <bool RMS, bool HasB>
void norm_backward(const uint16_t* dy, const float* x, const float* w, const float* mean,
                   const float* rstd, float* dx, float* dw, float* db, int64_t rows, int64_t d) {
  int64_t blocks = (rows + 15) / 16;
  if (blocks > 64) blocks = 64;
  if (blocks < 1) blocks = 1;
  const int64_t per = (rows + blocks - 1) / blocks;
  std::vector<float> sw(static_cast<size_t>(blocks * d), 0.0f);
  std::vector<float> sb(HasB ? static_cast<size_t>(blocks * d) : 0, 0.0f);
  const float inv_d = 1.0f / static_cast<float>(d);
  at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      float* __restrict__ aw = sw.data() + k * d;
      float* __restrict__ ab = HasB ? sb.data() + k * d : nullptr;
      const int64_t r1 = (k + 1) * per < rows ? (k + 1) * per : rows;
      for (int64_t r = k * per; r < r1; ++r) {
        const float* __restrict__ xr = x + r * d;
        const uint16_t* __restrict__ gr = dy + r * d;
        float* __restrict__ dxr = dx + r * d;
        const float m = RMS ? 0.0f : mean[r], rs = rstd[r];
        float sg = 0.0f, sgx = 0.0f;
        int64_t j0 = 0;
#ifdef LMLAB_TRAIN_AVX512
        const int64_t dv = d - d % 16;
        const __m512 vm = _mm512_set1_ps(m), vr = _mm512_set1_ps(rs);
        __m512 vsg = _mm512_setzero_ps(), vsgx = _mm512_setzero_ps();
        for (int64_t j = 0; j < dv; j += 16) {
          __m512 g0 = load16(gr + j);
          __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + j), vm), vr);
          __m512 g = _mm512_mul_ps(g0, _mm512_loadu_ps(w + j));
          vsg = _mm512_add_ps(vsg, g);
          vsgx = _mm512_fmadd_ps(g, xh, vsgx);
          _mm512_storeu_ps(aw + j, _mm512_fmadd_ps(g0, xh, _mm512_loadu_ps(aw + j)));
          if (HasB) _mm512_storeu_ps(ab + j, _mm512_add_ps(_mm512_loadu_ps(ab + j), g0));
        }
        sg = _mm512_reduce_add_ps(vsg);
        sgx = _mm512_reduce_add_ps(vsgx);
        j0 = dv;
#endif
        for (int64_t j = j0; j < d; ++j) {
          float g0 = bf16_to_f32(gr[j]);
          float xh = (xr[j] - m) * rs;
          float g = g0 * w[j];
          sg += g;
          sgx += g * xh;
          aw[j] += g0 * xh;
          if (HasB) ab[j] += g0;
        }
        const float mg = RMS ? 0.0f : sg * inv_d, mgx = sgx * inv_d;
        j0 = 0;
#ifdef LMLAB_TRAIN_AVX512
        const __m512 vmg = _mm512_set1_ps(mg), vmgx = _mm512_set1_ps(mgx);
        for (int64_t j = 0; j < dv; j += 16) {
          __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + j), vm), vr);
          __m512 g = _mm512_mul_ps(load16(gr + j), _mm512_loadu_ps(w + j));
          __m512 t = _mm512_sub_ps(_mm512_sub_ps(g, vmg), _mm512_mul_ps(xh, vmgx));
          _mm512_storeu_ps(dxr + j, _mm512_mul_ps(vr, t));
        }
        j0 = dv;
#endif
        for (int64_t j = j0; j < d; ++j) {
          float xh = (xr[j] - m) * rs;
          dxr[j] = rs * (bf16_to_f32(gr[j]) * w[j] - mg - xh * mgx);
        }
      }
    }
  });
  add_blocks(sw, blocks, d, dw);
  if (HasB) add_blocks(sb, blocks, d, db);
}

// ---- the residual add: a float32 stream plus a bfloat16 branch --------------------------------
//
// out = x + y, x float32, y bfloat16 (widened exactly), one float32 add per element: what
// torch's x + y computes (the same bits), in one pass; torch first writes y widened to a
// float32 temporary, then adds (two passes and a buffer the size of the stream).

constexpr int64_t kAddBlock = 8192;

void add_f32_bf16(const float* x, const uint16_t* y, float* out, int64_t n) {
  at::parallel_for(0, (n + kAddBlock - 1) / kAddBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t i1 = (blk + 1) * kAddBlock < n ? (blk + 1) * kAddBlock : n;
      int64_t i = blk * kAddBlock;
#ifdef LMLAB_TRAIN_AVX512
      for (; i + 16 <= i1; i += 16)
        _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(x + i), load16(y + i)));
#endif
      for (; i < i1; ++i) out[i] = x[i] + bf16_to_f32(y[i]);
    }
  });
}

// ---- the residual add with the branch's bias: x + (y + b) --------------------------------------
//
// Legend: M rows, N columns. x (M, N) float32 (the residual stream), y (M, N) bfloat16 (a
// residual projection's output computed without its bias), b (N,) float32 (that bias). Forward:
// out = x + (y + b) in float32, one pass (torch's path: addmm writes y + b rounded to bfloat16,
// then the add widens it: the bias rounded twice, three passes). Backward from g (M, N) float32:
// x's gradient is g itself; dy = g rounded to bfloat16 (what autograd's cast gives the branch);
// db[j] = the float32 sum over i of g[i, j], four rows in registers within fixed blocks of rows
// (sum_block_rows: the shape alone decides them), then in block order: the same bits for any
// thread count (torch: dy's column sums rounded to bfloat16, then a cast).

inline int64_t sum_block_rows(int64_t m) {
  const int64_t per = (m + 255) / 256;  // at most 256 blocks of partial sums
  return per < 64 ? 64 : per;
}

// A pass over an (m, n) matrix's rows that also sums columns: group(r0, rows, acc) runs rows r0
// .. r0 + rows - 1 (four at a time, the groups fixed by the blocks of sum_block_rows; acc is the
// block's n partial sums, zeroed first, or null when partial is), the blocks split over threads;
// then (db not null) db = the blocks' sums added in block order: the same bits for any thread
// count. Adding a group's rows before acc takes a quarter of the accumulator traffic.
template <typename Group>
void row_group_pass(int64_t m, int64_t n, float* partial, float* db, const Group& group) {
  const int64_t per = sum_block_rows(m), blocks = (m + per - 1) / per;
  at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t blk = k0; blk < k1; ++blk) {
      float* acc = partial ? partial + blk * n : nullptr;
      if (acc) std::memset(acc, 0, n * sizeof(float));
      const int64_t rows_end = (blk + 1) * per < m ? (blk + 1) * per : m;
      for (int64_t r0 = blk * per; r0 < rows_end; r0 += 4)
        group(r0, rows_end - r0 < 4 ? rows_end - r0 : 4, acc);
    }
  });
  if (!db) return;
  std::memset(db, 0, n * sizeof(float));
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t j = 0; j < n; ++j) db[j] += partial[blk * n + j];
}

// A group's column j in scalar code (builds without AVX-512): value(at) computes and stores
// element at = row * n + j and returns the float32 value to sum (the gradient before its
// rounding to the stored dtype); their sum over the group's rows, in row order, is added to
// acc[j] (acc null: nothing summed).
template <typename Value>
inline void group_column(int64_t r0, int64_t rows, int64_t n, int64_t j, float* acc,
                         const Value& value) {
  float sum = 0.0f;
  for (int64_t k = 0; k < rows; ++k) sum += value((r0 + k) * n + j);
  if (acc) acc[j] += sum;
}

// out (m, n) = x + (y + b[j]); out may be x.
void add_bias_f32_bf16(const float* x, const uint16_t* y, const float* b, float* out, int64_t m,
                       int64_t n) {
  const int64_t grain = n >= kAddBlock ? 1 : kAddBlock / n;
  at::parallel_for(0, m, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      const uint16_t* yr = y + r * n;
      float* o = out + r * n;
      int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
      for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(o + j, _mm512_add_ps(_mm512_loadu_ps(xr + j),
                                              _mm512_add_ps(load16(yr + j), load16(b + j))));
      if (j < n) {
        const __mmask16 mk = tail_mask(n - j);
        const __m512 zero = _mm512_setzero_ps();
        const __m512 v = _mm512_add_ps(load16_masked(yr + j, mk, zero), load16_masked(b + j, mk, zero));
        store16_masked(_mm512_add_ps(load16_masked(xr + j, mk, zero), v), o + j, mk);
      }
      j = n;
#endif
      for (; j < n; ++j) o[j] = xr[j] + (bf16_to_f32(yr[j]) + b[j]);
    }
  });
}

#ifdef LMLAB_TRAIN_AVX512
// Rows r0 .. r0 + rows - 1 of the sixteen columns from j (Full: all sixteen, else the lanes of
// mk): dy = g rounded, and g's sum over those rows, added in row order, then to acc.
template <bool Full>
inline void add_bias_backward16(const float* g, uint16_t* dy, float* acc, int64_t r0,
                                int64_t rows, int64_t n, int64_t j, __mmask16 mk) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t at = (r0 + k) * n + j;
    const __m512 v = part_load16<Full>(g + at, mk);
    part_store16<Full>(v, dy + at, mk);
    sum = _mm512_add_ps(sum, v);
  }
  part_store16<Full>(_mm512_add_ps(part_load16<Full>(acc + j, mk), sum), acc + j, mk);
}
#endif

// partial: (blocks, n) float32 scratch (db is its column sums in block order).
void add_bias_backward(const float* g, uint16_t* dy, float* partial, float* db, int64_t m,
                       int64_t n) {
  row_group_pass(m, n, partial, db, [&](int64_t r0, int64_t rows, float* acc) {
    int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
    for (; j + 16 <= n; j += 16) add_bias_backward16<true>(g, dy, acc, r0, rows, n, j, 0);
    if (j < n) add_bias_backward16<false>(g, dy, acc, r0, rows, n, j, tail_mask(n - j));
    j = n;
#endif
    for (; j < n; ++j) {
      group_column(r0, rows, n, j, acc, [&](int64_t at) {
        dy[at] = f32_to_bf16(g[at]);
        return g[at];  // the bias gradient sums g itself, in float32
      });
    }
  });
}

// ---- GELU of a bias-free bfloat16 projection plus its bias ------------------------------------
//
// Legend: M rows, N columns. u (M, N) bfloat16, a projection's output computed without its bias;
// b (N,) float32 or null. Forward: a = gelu(z), z = u + b in float32 (not rounded), gelu(z) = z
// Phi(z) with Phi(z) = (1 + erf(z / sqrt 2)) / 2 (Hendrycks & Gimpel 2016, the exact form, torch's
// F.gelu default), a rounded once to bfloat16. Backward: du = g gelu'(z), gelu'(z) = Phi(z) + z
// phi(z) with phi the standard normal density, rounded to bfloat16; db[j] = the float32 sum over
// i of g gelu'(z) before that rounding (the float32 gradient of z = u + b, which the ATen
// formula's autograd sums too; the residual add's bias gradient likewise sums its float32 g),
// summed four rows at a time within fixed blocks of rows (sum_block_rows: the shape alone
// decides them), then in block order: the same bits for any thread count.
//
// erf by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7; the formula of torch's own
// vectorised erf), its e^(-z^2 / 2) by exp16, which phi shares: one exponential per element each
// way. Against torch's path (addmm with the bias rounded to bfloat16, its output rounded, then
// gelu and gelu_backward each a pass, the bias gradient a separate column sum in bfloat16) this
// is one pass each way, with z and the bias gradient kept in float32. Scalar builds use std::erf.
// The tanh approximation (torch's approximate="tanh", GPT-2's gelu_new) likewise, its tanh from
// one e^(-2 |y|) (relative error a few float32 ulps).

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;


// The tanh form (GPT-2's gelu_new, torch's approximate="tanh"): gelu(z) = z (1 + tanh(y)) / 2,
// y = k (z + c z^3); gelu'(z) = (1 + t) / 2 + z (1 - t^2) k (1 + 3 c z^2) / 2, t = tanh(y).
constexpr float kTanhK = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhC = 0.044715f;

// gelu(z) (Tanh: the tanh form) and gelu'(z), scalar
template <bool Tanh>
inline float gelu_value(float z) {
  if (Tanh) return 0.5f * z * (1.0f + std::tanh(kTanhK * (z + kTanhC * z * z * z)));
  return 0.5f * z * (1.0f + std::erf(z * kInvSqrt2));
}

template <bool Tanh>
inline float gelu_slope(float z) {
  const float zc = z != z ? z : z < -1e4f ? -1e4f : z > 1e4f ? 1e4f : z;  // as gelu_slope16
  if (Tanh) {
    const float t = std::tanh(kTanhK * (z + kTanhC * z * z * z));
    return 0.5f * (1.0f + t) + 0.5f * zc * (1.0f - t * t) * kTanhK * (1.0f + 3.0f * kTanhC * zc * zc);
  }
  return 0.5f * (1.0f + std::erf(z * kInvSqrt2)) + zc * std::exp(-0.5f * z * z) * kInvSqrt2Pi;
}

#ifdef LMLAB_TRAIN_AVX512
inline __m512 abs16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}
inline __m512 sign16(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// Phi(z) and e^(-z^2 / 2), sixteen lanes (a NaN z gives NaN; +-inf give Phi 1 / 0, e 0).
inline void gelu_cdf16(__m512 z, __m512* cdf, __m512* e) {
  // t = 1 / (1 + p |x|), x = z / sqrt 2
  const __m512 t = _mm512_div_ps(
      bcast(1.0f), _mm512_fmadd_ps(bcast(0.3275911f * kInvSqrt2), abs16(z), bcast(1.0f)));
  __m512 poly = bcast(1.061405429f);
  poly = _mm512_fmadd_ps(poly, t, bcast(-1.453152027f));
  poly = _mm512_fmadd_ps(poly, t, bcast(1.421413741f));
  poly = _mm512_fmadd_ps(poly, t, bcast(-0.284496736f));
  poly = _mm512_fmadd_ps(poly, t, bcast(0.254829592f));
  poly = _mm512_mul_ps(poly, t);
  *e = exp16(_mm512_mul_ps(_mm512_mul_ps(z, z), bcast(-0.5f)));
  // erf(|x|) = 1 - poly e; Phi = (1 + sign(z) erf(|x|)) / 2
  const __m512 erf_abs = _mm512_fnmadd_ps(poly, *e, bcast(1.0f));
  *cdf = _mm512_fmadd_ps(_mm512_or_ps(erf_abs, sign16(z)), bcast(0.5f), bcast(0.5f));
}

// tanh(k (z + c z^3)) from e^(-2 |y|) <= 1 (exp16's range): (1 - e) / (1 + e), signed
inline __m512 gelu_tanh16(__m512 z) {
  const __m512 y = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_mul_ps(z, z), bcast(kTanhC), bcast(1.0f)),
                                 _mm512_mul_ps(z, bcast(kTanhK)));
  const __m512 e = exp16(_mm512_mul_ps(abs16(y), bcast(-2.0f)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(bcast(1.0f), e), _mm512_add_ps(bcast(1.0f), e));
  return _mm512_or_ps(t, sign16(y));
}

template <bool Tanh>
inline __m512 gelu_value16(__m512 z) {
  if (Tanh) {
    const __m512 half_z = _mm512_mul_ps(z, bcast(0.5f));
    return _mm512_fmadd_ps(half_z, gelu_tanh16(z), half_z);
  }
  __m512 cdf, e;
  gelu_cdf16(z, &cdf, &e);
  return _mm512_mul_ps(z, cdf);
}

// gelu'(z). The second term's z is clamped to +-1e4, where that term is exactly 0 (its
// exponential underflows), so that +-inf and huge z give the limits 1 and 0 rather than inf x 0
// (torch's CPU kernels give NaN there); a NaN z stays NaN through t or e.
template <bool Tanh>
inline __m512 gelu_slope16(__m512 z) {
  const __m512 zc = _mm512_min_ps(_mm512_max_ps(z, bcast(-1e4f)), bcast(1e4f));
  if (Tanh) {
    const __m512 t = gelu_tanh16(z);
    const __m512 z2 = _mm512_mul_ps(zc, zc);
    const __m512 dy = _mm512_fmadd_ps(z2, bcast(3.0f * kTanhC * kTanhK), bcast(kTanhK));
    const __m512 sech2 = _mm512_fnmadd_ps(t, t, bcast(1.0f));  // 1 - t^2
    const __m512 half = _mm512_fmadd_ps(t, bcast(0.5f), bcast(0.5f));  // (1 + t) / 2
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(zc, bcast(0.5f)), sech2), dy, half);
  }
  __m512 cdf, e;
  gelu_cdf16(z, &cdf, &e);
  return _mm512_fmadd_ps(_mm512_mul_ps(zc, e), bcast(kInvSqrt2Pi), cdf);
}
#endif

#ifdef LMLAB_TRAIN_AVX512
// Sixteen columns from j (Full) or the lanes of mk (the row's last n % 16, masked: rounded as the
// rest): part_load16 / part_store16 (train_simd.h).

// u + b of sixteen columns (u alone without a bias: no +0 added, so a -0 stays -0)
template <bool Full>
inline __m512 gelu_z16(const uint16_t* u, const float* b, __mmask16 mk) {
  const __m512 z = part_load16<Full>(u, mk);
  return b ? _mm512_add_ps(z, part_load16<Full>(b, mk)) : z;
}

template <bool Tanh, bool Full>
inline void gelu_forward16(const uint16_t* u, const float* b, uint16_t* a, __mmask16 mk) {
  part_store16<Full>(gelu_value16<Tanh>(gelu_z16<Full>(u, b, mk)), a, mk);
}

// Rows r0 .. r0 + rows - 1 of the sixteen columns from j: du = g gelu'(u + b), and (acc not
// null) the float32 values' sum before du's rounding, added in row order, then to acc.
template <bool Tanh, bool Full>
inline void gelu_backward16(const uint16_t* g, const uint16_t* u, const float* b, uint16_t* du,
                            float* acc, int64_t r0, int64_t rows, int64_t n, int64_t j,
                            __mmask16 mk) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t at = (r0 + k) * n + j;
    const __m512 z = gelu_z16<Full>(u + at, b ? b + j : b, mk);
    const __m512 d = _mm512_mul_ps(part_load16<Full>(g + at, mk), gelu_slope16<Tanh>(z));
    part_store16<Full>(d, du + at, mk);
    if (acc) sum = _mm512_add_ps(sum, d);
  }
  if (acc) part_store16<Full>(_mm512_add_ps(part_load16<Full>(acc + j, mk), sum), acc + j, mk);
}
#endif

template <bool Tanh>
void gelu_bf16_forward(const uint16_t* u, const float* b, uint16_t* a, int64_t m, int64_t n) {
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* ur = u + r * n;
      uint16_t* ar = a + r * n;
      int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
      for (; j + 16 <= n; j += 16) gelu_forward16<Tanh, true>(ur + j, b ? b + j : b, ar + j, 0);
      if (j < n) gelu_forward16<Tanh, false>(ur + j, b ? b + j : b, ar + j, tail_mask(n - j));
      j = n;
#endif
      for (; j < n; ++j) ar[j] = f32_to_bf16(gelu_value<Tanh>(bf16_to_f32(ur[j]) + (b ? b[j] : 0.0f)));
    }
  });
}

// partial: (blocks, n) float32 scratch when b is not null (db is its column sums in block order).
template <bool Tanh>
void gelu_bf16_backward(const uint16_t* g, const uint16_t* u, const float* b, uint16_t* du,
                        float* partial, float* db, int64_t m, int64_t n) {
  row_group_pass(m, n, db ? partial : nullptr, db, [&](int64_t r0, int64_t rows, float* acc) {
    int64_t j = 0;
#ifdef LMLAB_TRAIN_AVX512
    for (; j + 16 <= n; j += 16) gelu_backward16<Tanh, true>(g, u, b, du, acc, r0, rows, n, j, 0);
    if (j < n) gelu_backward16<Tanh, false>(g, u, b, du, acc, r0, rows, n, j, tail_mask(n - j));
    j = n;
#endif
    for (; j < n; ++j) {
      group_column(r0, rows, n, j, acc, [&](int64_t at) {
        const float z = bf16_to_f32(u[at]) + (b ? b[j] : 0.0f);
        const float d = bf16_to_f32(g[at]) * gelu_slope<Tanh>(z);
        du[at] = f32_to_bf16(d);
        return d;  // summed before its rounding
      });
    }
  });
}

// ---- silu(gate) * up: a SwiGLU FFN's hidden activation ------------------------------------------
//
// gate, up (n,) bfloat16, h (n,) bfloat16 (any shape, contiguous): h = silu(gate) up, computed in
// float32 and rounded once, silu(z) = z s(z) with s the logistic sigmoid (Elfwing et al. 2018;
// Shazeer 2020's SwiGLU). s(z) = 1 / (1 + e) for z >= 0 and e / (1 + e) below, e = e^(-|z|) <= 1
// (exp16's range: no overflow for any z). Backward from g (n,) bfloat16: dup = g silu(gate),
// dgate = g up s (1 + gate (1 - s)), each rounded once. Torch's path rounds silu(gate) to bf16,
// then the product (two passes, and silu(gate) kept for the backward), and its backward takes
// three passes (g up, g silu(gate), silu's backward). Non-finite gates give what torch's formula
// gives (silu'(+-inf) is NaN there too). Elementwise: the same bits for any thread count.

inline float sigmoid_f(float z) {
  const float e = exp_f(-std::fabs(z));
  const float r = 1.0f / (1.0f + e);
  return z >= 0.0f ? r : e * r;
}

#ifdef LMLAB_TRAIN_AVX512
inline __m512 sigmoid16(__m512 z) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), abs16(z)));
  const __m512 r = _mm512_div_ps(bcast(1.0f), _mm512_add_ps(bcast(1.0f), e));
  const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mul_ps(r, neg, e, r);
}

template <bool Full>
inline void silu_mul16(const uint16_t* gate, const uint16_t* up, uint16_t* h, __mmask16 mk) {
  const __m512 z = part_load16<Full>(gate, mk);
  const __m512 prod = _mm512_mul_ps(_mm512_mul_ps(z, sigmoid16(z)), part_load16<Full>(up, mk));
  part_store16<Full>(prod, h, mk);
}

template <bool Full>
inline void silu_mul_backward16(const uint16_t* g, const uint16_t* gate, const uint16_t* up,
                                uint16_t* dgate, uint16_t* dup, __mmask16 mk) {
  const __m512 gv = part_load16<Full>(g, mk), z = part_load16<Full>(gate, mk);
  const __m512 s = sigmoid16(z), one = bcast(1.0f);
  part_store16<Full>(_mm512_mul_ps(gv, _mm512_mul_ps(z, s)), dup, mk);
  const __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(z, _mm512_sub_ps(one, s), one));
  part_store16<Full>(_mm512_mul_ps(_mm512_mul_ps(gv, part_load16<Full>(up, mk)), slope), dgate, mk);
}
#endif

void silu_mul_bf16_forward(const uint16_t* gate, const uint16_t* up, uint16_t* h, int64_t n) {
  at::parallel_for(0, (n + kAddBlock - 1) / kAddBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t i1 = (blk + 1) * kAddBlock < n ? (blk + 1) * kAddBlock : n;
      int64_t i = blk * kAddBlock;
#ifdef LMLAB_TRAIN_AVX512
      for (; i + 16 <= i1; i += 16) silu_mul16<true>(gate + i, up + i, h + i, 0);
      if (i < i1) silu_mul16<false>(gate + i, up + i, h + i, tail_mask(i1 - i));
      i = i1;
#endif
      for (; i < i1; ++i) {
        const float z = bf16_to_f32(gate[i]);
        h[i] = f32_to_bf16(z * sigmoid_f(z) * bf16_to_f32(up[i]));
      }
    }
  });
}

void silu_mul_bf16_backward(const uint16_t* g, const uint16_t* gate, const uint16_t* up,
                            uint16_t* dgate, uint16_t* dup, int64_t n) {
  at::parallel_for(0, (n + kAddBlock - 1) / kAddBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t i1 = (blk + 1) * kAddBlock < n ? (blk + 1) * kAddBlock : n;
      int64_t i = blk * kAddBlock;
#ifdef LMLAB_TRAIN_AVX512
      for (; i + 16 <= i1; i += 16)
        silu_mul_backward16<true>(g + i, gate + i, up + i, dgate + i, dup + i, 0);
      if (i < i1)
        silu_mul_backward16<false>(g + i, gate + i, up + i, dgate + i, dup + i, tail_mask(i1 - i));
      i = i1;
#endif
      for (; i < i1; ++i) {
        const float gv = bf16_to_f32(g[i]), z = bf16_to_f32(gate[i]), s = sigmoid_f(z);
        dup[i] = f32_to_bf16(gv * (z * s));
        dgate[i] = f32_to_bf16(gv * bf16_to_f32(up[i]) * (s * std::fma(z, 1.0f - s, 1.0f)));
      }
    }
  });
}

// ---- gradient clipping: the global L2 norm and the scaling, one call each ---------------------
//
// The gradients are cut into blocks of kGradBlock elements (a tensor's last block shorter);
// each block's sum of squares is accumulated in float64 (eight lanes at a time on AVX-512) and
// the blocks' sums are added in order, so the total does not depend on the thread count.
// torch's clip_grad_norm_ takes each tensor's float32 norm, then the norm of those: the two
// agree to a few float32 roundings (torch's own float32 norm is that far from the exact one),
// so the coefficient may differ by a few ulps; not bit for bit. The scaling g *= coef is float32
// (one rounding per element), the product torch's mul_ by a float32 scalar makes.

constexpr int64_t kGradBlock = 16384;

struct GradBlock {
  const float* p;
  int64_t n;
};

std::vector<GradBlock> grad_blocks(int64_t count, const float* const* ptrs, const int64_t* numels) {
  std::vector<GradBlock> blocks;
  for (int64_t i = 0; i < count; ++i)
    for (int64_t s = 0; s < numels[i]; s += kGradBlock)
      blocks.push_back({ptrs[i] + s, numels[i] - s < kGradBlock ? numels[i] - s : kGradBlock});
  return blocks;
}

double sum_squares(const float* p, int64_t n) {
  int64_t j = 0;
  double total = 0.0;
#ifdef LMLAB_TRAIN_AVX512
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(p + j);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  total = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
  for (; j < n; ++j) total += static_cast<double>(p[j]) * static_cast<double>(p[j]);
  return total;
}

}  // namespace

// Gradient clipping of count float32 tensors (ptrs[i] holding numels[i] elements) in place:
// *norm = the global L2 norm (float64, from the float64 sum of squares; NaN or inf when an
// element is); when it is finite and max_norm > 0, coef = min(max_norm / (norm + 1e-6), 1) is
// computed in float32 as torch's clip_grads_with_norm_ computes it (the norm rounded to float32,
// plus 1e-6, its reciprocal times max_norm, clamped) and, when below 1, every element is
// multiplied by it. *coef_out = the coefficient applied (1 when none). Returns 0.
extern "C" int lmlab_grad_clip(int64_t count, float* const* ptrs, const int64_t* numels,
                               double max_norm, double* norm, float* coef_out) {
  std::vector<GradBlock> blocks = grad_blocks(count, ptrs, numels);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<double> sums(blocks.size(), 0.0);
  at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) sums[b] = sum_squares(blocks[b].p, blocks[b].n);
  });
  double total = 0.0;
  for (double v : sums) total += v;
  *norm = std::sqrt(total);
  *coef_out = 1.0f;
  // a sum of squares past float32's range is an inf norm, as torch's float32 norm is (its sum
  // of squares overflows: norms above about 1.8e19; the coefficient would otherwise zero every
  // gradient, or clip, in a step torch's path skips)
  if (std::isinf(static_cast<float>(total))) *norm = std::numeric_limits<double>::infinity();
  if (!std::isfinite(*norm) || !(max_norm > 0)) return 0;
  volatile float shifted = static_cast<float>(*norm) + static_cast<float>(1e-6);  // no fusing
  volatile float inv = 1.0f / shifted;
  float coef = inv * static_cast<float>(max_norm);
  if (!(coef < 1.0f)) return 0;  // a coefficient of 1 leaves every gradient as it is
  *coef_out = coef;
  at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* p = const_cast<float*>(blocks[b].p);
      for (int64_t j = 0; j < blocks[b].n; ++j) p[j] = p[j] * coef;
    }
  });
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

// kind 0 LayerNorm, 1 RMSNorm; b null for none (RMSNorm: ignored). x, w, b float32; y bfloat16;
// mean, rstd (R,) float32 out. Returns 0.
extern "C" int lmlab_norm_bf16_forward(int kind, const float* x, const float* w, const float* b,
                                       void* y, float* mean, float* rstd, int64_t rows, int64_t d,
                                       float eps) {
  auto yp = static_cast<uint16_t*>(y);
  if (kind == 1) norm_forward<true, false>(x, w, nullptr, yp, mean, rstd, rows, d, eps);
  else if (b) norm_forward<false, true>(x, w, b, yp, mean, rstd, rows, d, eps);
  else norm_forward<false, false>(x, w, nullptr, yp, mean, rstd, rows, d, eps);
  return 0;
}

// dy bfloat16; dx (R, D), dw (D,), db (D,) (null for none) float32, written.
extern "C" int lmlab_norm_bf16_backward(int kind, const void* dy, const float* x, const float* w,
                                        const float* mean, const float* rstd, float* dx, float* dw,
                                        float* db, int64_t rows, int64_t d) {
  auto g = static_cast<const uint16_t*>(dy);
  if (kind == 1) norm_backward<true, false>(g, x, w, mean, rstd, dx, dw, nullptr, rows, d);
  else if (db) norm_backward<false, true>(g, x, w, mean, rstd, dx, dw, db, rows, d);
  else norm_backward<false, false>(g, x, w, mean, rstd, dx, dw, nullptr, rows, d);
  return 0;
}

// x float32, y bfloat16, out float32, each (n,) contiguous (out may be x): out = x + y. Returns 0.
extern "C" int lmlab_add_f32_bf16(const float* x, const void* y, float* out, int64_t n) {
  add_f32_bf16(x, static_cast<const uint16_t*>(y), out, n);
  return 0;
}

// x, out float32, y bfloat16, each (m, n) contiguous (out may be x), b float32 (n,):
// out = x + (y + b). Returns 0.
extern "C" int lmlab_add_bias_f32_bf16(const float* x, const void* y, const float* b, float* out,
                                       int64_t m, int64_t n) {
  add_bias_f32_bf16(x, static_cast<const uint16_t*>(y), b, out, m, n);
  return 0;
}

// g float32 (m, n), dy bfloat16 (m, n), partial float32 (lmlab_sum_blocks(m), n), db float32
// (n,): dy = g rounded, db = g's column sums. Returns 0.
extern "C" int lmlab_add_bias_backward(const float* g, void* dy, float* partial, float* db,
                                       int64_t m, int64_t n) {
  add_bias_backward(g, static_cast<uint16_t*>(dy), partial, db, m, n);
  return 0;
}

// The row blocks of the column sums of an (m, n) gradient (gelu_bf16's, add_bias's backward).
extern "C" int64_t lmlab_sum_blocks(int64_t m) {
  const int64_t per = sum_block_rows(m);
  return (m + per - 1) / per;
}

// gate, up, h bfloat16 (n,) contiguous: h = silu(gate) up. Returns 0.
extern "C" int lmlab_silu_mul_bf16_forward(const void* gate, const void* up, void* h, int64_t n) {
  silu_mul_bf16_forward(static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up),
                        static_cast<uint16_t*>(h), n);
  return 0;
}

// g, gate, up, dgate, dup bfloat16 (n,) contiguous: the gradients of h = silu(gate) up. Returns 0.
extern "C" int lmlab_silu_mul_bf16_backward(const void* g, const void* gate, const void* up,
                                            void* dgate, void* dup, int64_t n) {
  silu_mul_bf16_backward(static_cast<const uint16_t*>(g), static_cast<const uint16_t*>(gate),
                         static_cast<const uint16_t*>(up), static_cast<uint16_t*>(dgate),
                         static_cast<uint16_t*>(dup), n);
  return 0;
}

extern "C" int64_t lmlab_gelu_bf16_blocks(int64_t m) {
  const int64_t per = sum_block_rows(m);
  return (m + per - 1) / per;
}

extern "C" int lmlab_gelu_bf16_forward(int form, const void* u, const float* b, void* a, int64_t m,
                                       int64_t n) {
  auto up = static_cast<const uint16_t*>(u);
  auto ap = static_cast<uint16_t*>(a);
  if (form == 0) gelu_bf16_forward<false>(up, b, ap, m, n);
  else if (form == 1) gelu_bf16_forward<true>(up, b, ap, m, n);
  else return 1;
  return 0;
}

// form 0: the exact (erf) GELU, 1: its tanh approximation. Returns 0, or 1 for another form.
extern "C" int lmlab_gelu_bf16_backward(int form, const void* g, const void* u, const float* b,
                                        void* du, float* partial, float* db, int64_t m, int64_t n) {
  auto gp = static_cast<const uint16_t*>(g);
  auto up = static_cast<const uint16_t*>(u);
  auto dp = static_cast<uint16_t*>(du);
  if (form == 0) gelu_bf16_backward<false>(gp, up, b, dp, partial, db, m, n);
  else if (form == 1) gelu_bf16_backward<true>(gp, up, b, dp, partial, db, m, n);
  else return 1;
  return 0;
}

// ---- AdamW: every parameter's update in one threaded call -------------------------------------
//
// Loshchilov & Hutter 2019 (decoupled weight decay), in the order torch's fused CPU kernel
// computes it, each operation rounded to float32 once (lmlab.training.optim.AdamW):
//   t            = step + 1 (the float32 step count, written back)
//   p            = p * (1 - lr wd)                          (only when wd != 0)
//   m            = m + (1 - beta1) (g - m)                  (torch's lerp, one fused multiply-add;
//                  g - (g - m) beta1 when 1 - beta1 >= 0.5)
//   v            = fma((1 - beta2) g, g, v beta2)
//   denominator  = sqrt(v) / sqrt(1 - beta2^t) + eps
//   p            = p + (-lr / (1 - beta1^t)) m / denominator
// with the bias corrections and step size computed in float64 per tensor, then rounded to
// float32 as torch rounds them. Elementwise, so the thread count changes no bit; the elements
// of all tensors are split evenly over the threads (one parallel region for the whole step,
// where torch's fused kernel opens one per tensor and its step counts are one foreach add).
// opaque() keeps the compiler from fusing a product into the next addition: each product and
// sum above is its own rounding, in the vector and the scalar code alike. The same bits as
// torch 2.13's AdamW(fused=True) on an AVX-512 CPU (its kernel runs sixteen lanes; in each
// tensor's last numel % 8 elements, its scalar remainder, v = fma(v, beta2, ((1 - beta2) g) g),
// which this kernel computes there too: adamw_range); torch's AVX2 build measured the same
// bits, its scalar build (no vector unit) rounds differently anywhere in a tensor.

namespace {

template <typename V>
inline V opaque(V x) {
  __asm__("" : "+x"(x));
  return x;
}

struct AdamwCoef {
  float decay;      // 1 - lr wd
  bool decay_on;    // wd != 0
  float lerp_w;     // 1 - beta1, or (1 - beta1) - 1 when the lerp starts from g
  bool lerp_from_m; // |1 - beta1| < 0.5
  float beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
};

struct AdamwTensor {
  float *p, *m, *v;
  const float* g;
  int64_t n;
  AdamwCoef c;
};

// v's update in the main body, and in torch's scalar remainder (a tensor's last numel % 8
// elements, adamw_range: its compiler fused v beta2 into the addition there instead of the
// product)
template <bool kRemainder>
inline float adamw_v(float v, float g, const AdamwCoef& c) {
  if (kRemainder) return std::fma(v, c.beta2, opaque(opaque(c.one_minus_beta2 * g) * g));
  return std::fma(opaque(c.one_minus_beta2 * g), g, opaque(v * c.beta2));
}

template <bool kRemainder>
inline void adamw_scalar(float* p, const float* g, float* m, float* v, int64_t n,
                         const AdamwCoef& c) {
  for (int64_t j = 0; j < n; ++j) {
    float pj = p[j], gj = g[j], mj = m[j];
    if (c.decay_on) pj = opaque(pj * c.decay);
    mj = std::fma(c.lerp_w, gj - mj, c.lerp_from_m ? mj : gj);
    const float vj = adamw_v<kRemainder>(v[j], gj, c);
    const float den = opaque(std::sqrt(vj) / c.bc2_sqrt) + c.eps;
    p[j] = pj + opaque(c.neg_step * mj) / den;
    m[j] = mj;
    v[j] = vj;
  }
}

#ifdef LMLAB_TRAIN_AVX512
template <bool kRemainder>
inline void adamw16(float* p, const float* g, float* m, float* v, __mmask16 k, const AdamwCoef& c) {
  __m512 pv = _mm512_maskz_loadu_ps(k, p), gv = _mm512_maskz_loadu_ps(k, g);
  __m512 mv = _mm512_maskz_loadu_ps(k, m), vv = _mm512_maskz_loadu_ps(k, v);
  if (c.decay_on) pv = opaque(_mm512_mul_ps(pv, bcast(c.decay)));
  mv = _mm512_fmadd_ps(bcast(c.lerp_w), _mm512_sub_ps(gv, mv), c.lerp_from_m ? mv : gv);
  const __m512 gs = opaque(_mm512_mul_ps(bcast(c.one_minus_beta2), gv));
  if (kRemainder) vv = _mm512_fmadd_ps(vv, bcast(c.beta2), opaque(_mm512_mul_ps(gs, gv)));
  else vv = _mm512_fmadd_ps(gs, gv, opaque(_mm512_mul_ps(vv, bcast(c.beta2))));
  const __m512 den = _mm512_add_ps(opaque(_mm512_div_ps(_mm512_sqrt_ps(vv), bcast(c.bc2_sqrt))),
                                   bcast(c.eps));
  const __m512 upd = _mm512_div_ps(opaque(_mm512_mul_ps(bcast(c.neg_step), mv)), den);
  _mm512_mask_storeu_ps(p, k, _mm512_add_ps(pv, upd));
  _mm512_mask_storeu_ps(m, k, mv);
  _mm512_mask_storeu_ps(v, k, vv);
}
#endif

template <bool kRemainder>
inline void adamw_span(const AdamwTensor& t, int64_t a, int64_t b) {
#ifdef LMLAB_TRAIN_AVX512
  int64_t j = a;
  for (; j + 16 <= b; j += 16) adamw16<kRemainder>(t.p + j, t.g + j, t.m + j, t.v + j, 0xFFFF, t.c);
  if (j < b) adamw16<kRemainder>(t.p + j, t.g + j, t.m + j, t.v + j, tail_mask(b - j), t.c);
#else
  adamw_scalar<kRemainder>(t.p + a, t.g + a, t.m + a, t.v + a, b - a, t.c);
#endif
}

// elements [a, b) of one tensor: the main body, then the remainder's own form. torch's
// remainder loop (numel % 16 elements) was vectorized by its compiler eight lanes wide, in
// the body's form, so the remainder's form starts after the first eight of them when there
// are eight or more.
inline void adamw_range(const AdamwTensor& t, int64_t a, int64_t b) {
  const int64_t rem = t.n - t.n % 16 + (t.n % 16 >= 8 ? 8 : 0);
  if (a < rem) adamw_span<false>(t, a, b < rem ? b : rem);
  if (b > rem) adamw_span<true>(t, a > rem ? a : rem, b);
}

}  // namespace

// One AdamW step over count float32 tensors: params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
// (numels[i] elements each, contiguous, none overlapping another) and steps[i] (one float32,
// incremented), with tensor i's lr, beta1, beta2, weight decay and eps. Returns 0.
extern "C" int lmlab_adamw_step(int64_t count, float* const* params, const float* const* grads,
                                float* const* exp_avgs, float* const* exp_avg_sqs,
                                float* const* steps, const int64_t* numels, const double* lr,
                                const double* beta1, const double* beta2,
                                const double* weight_decay, const double* eps) {
  std::vector<AdamwTensor> ts(static_cast<size_t>(count));
  std::vector<int64_t> start(static_cast<size_t>(count) + 1, 0);
  for (int64_t i = 0; i < count; ++i) {
    *steps[i] = *steps[i] + 1.0f;
    const double t = static_cast<double>(*steps[i]);
    const double bc1 = 1.0 - std::pow(beta1[i], t), bc2 = 1.0 - std::pow(beta2[i], t);
    AdamwCoef c;
    c.decay_on = static_cast<float>(weight_decay[i]) != 0.0f;
    c.decay = static_cast<float>(1.0 - lr[i] * weight_decay[i]);
    const float w = static_cast<float>(1.0 - beta1[i]);
    c.lerp_from_m = std::fabs(w) < 0.5f;
    c.lerp_w = c.lerp_from_m ? w : w - 1.0f;
    c.beta2 = static_cast<float>(beta2[i]);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2[i]);
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.eps = static_cast<float>(eps[i]);
    c.neg_step = static_cast<float>(-(lr[i] / bc1));
    ts[i] = {params[i], exp_avgs[i], exp_avg_sqs[i], grads[i], numels[i], c};
    start[i + 1] = start[i] + numels[i];
  }
  const int64_t total = start[count];
  at::parallel_for(0, total, 16384, [&](int64_t a, int64_t b) {
    // the first tensor holding element a of the concatenation, then each tensor's share
    int64_t i = static_cast<int64_t>(std::upper_bound(start.begin(), start.end(), a) - start.begin()) - 1;
    for (; i < count && start[i] < b; ++i) {
      const int64_t lo = a > start[i] ? a - start[i] : 0;
      const int64_t hi = (b < start[i + 1] ? b : start[i + 1]) - start[i];
      if (lo < hi) adamw_range(ts[i], lo, hi);
    }
  });
  return 0;
}
