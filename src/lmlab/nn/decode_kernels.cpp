// lmlab's one-call decode step: every layer of a pre-norm decoder for B (1..8) new tokens, one
// per row, all rows at the same position S, in one C++ call (lmlab.nn.decode_kernel builds the
// plan; lmlab.generation.lean_step calls it).
//
// Legend: B rows, D d_model, H query heads, KV key/value heads, hd head_dim, S cached tokens
// before this step, F the FFN's hidden width, V vocab, N / K a linear layer's out / in features.
// Per layer: h = norm1(x); q, k, v = h @ Wqkv.T (+ b); q, k rotated (RoPE, half-split layout,
// cos / sin given for position S); k, v written to slot S of the layer's reserved cache buffers;
// per query head softmax(q . k_t * scale over t = 0..S) . v_t with head h reading kv head
// h / (H / KV) (GQA), max-subtracted; x += attn @ Wo.T (+ b); h = norm2(x); x += down(act(gate)
// * up) or down(act(up)); then logits = final_norm(x) @ Whead.T (+ b).
//
// Linear layers: float32 (N, K) weights through gemv() below (rows over threads), or lmlab's
// quantized kernels (quant_kernels.cpp, compiled into the same library; called through their
// extern "C" entry points only). The float product sums in another order than torch's matmul:
// results agree to float32 rounding, not bit for bit.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LMLAB_D_AVX2 1
#else
#define LMLAB_D_AVX2 0
#endif
#if LMLAB_D_AVX2 && defined(__AVX512F__)
#define LMLAB_D_AVX512 1
#else
#define LMLAB_D_AVX512 0
#endif

extern "C" {
// quant_kernels.cpp (the same library)
int lmlab_int4_mm(const float* x, int64_t M, int64_t K, const uint8_t* p, const float* s,
                  const float* z, int64_t N, int64_t G, float* y);
int lmlab_int8_mm(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s,
                  int64_t N, int64_t G, float* y);
int lmlab_a8_mm(int bits, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* s,
                const float* z, int64_t N, int64_t G, float* y);
}

namespace {

constexpr int64_t kMaxRows = 8;

// ---- the plan (mirrored field by field by ctypes Structures in lmlab/nn/decode_kernel.py) ----
enum LinKind : int64_t { kFloat = 0, kInt8 = 1, kInt4 = 2, kInt8A8 = 3, kInt4A8 = 4 };
enum NormKind : int64_t { kNoNorm = 0, kRMS = 1, kLayer = 2 };
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kRelu2 = 4 };

struct Lin {
  int64_t kind, n, k, g;  // g: the quantized layers' group size
  const void* w;          // float (N, K) / int8 (N, K) / packed int4 (N, K/2)
  const float* s;         // (N, K/G) scales (quantized)
  const float* z;         // (N, K/G) zeros (int4)
  const float* bias;      // (N,) or null
};

struct Norm {
  int64_t kind;
  const float* w;  // (D,) or null
  const float* b;  // (D,) or null (LayerNorm)
  double eps;
};

struct Layer {
  Norm n1;
  Lin qkv[3];  // one fused (H + 2 KV) hd output, or q, k, v
  int64_t n_qkv;
  Lin o;
  Norm n2;
  Lin gu[2];  // gated: one fused [gate; up] (2F) or gate, up; plain MLP: up
  int64_t n_gu, gated, act;
  Lin down;
  int64_t heads, kv_heads, head_dim;
  double scale;
  float* kbuf;  // (B, KV, capacity, hd) with the strides below (elements)
  float* vbuf;
  int64_t ks[3], vs[3];
  int64_t capacity;
};

struct Model {
  int64_t n_layers, d_model, vocab, rope, split_quant;
  Layer* layers;
  Norm final_norm;
  Lin head;
};

// ---- float32 matrix-vector product: y (M, N) = x (M, K) @ w.T, w (N, K) row-major ----

#if LMLAB_D_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Output rows per step for M rows of x: enough independent accumulator chains to hide the FMA
// latency (M R chains), few enough to stay in registers. Measured on SmolLM2's shapes (2
// threads, AVX-512): 8 rows at M = 1 beat 4 by 11%; a software prefetch of the next rows and
// 4x smaller tasks did not help (benchmarks/decode_gemv.py).
template <int M>
constexpr int kRowsAtOnce = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;

#if LMLAB_D_AVX512
template <int M, int R>
inline void dot_rows(const float* x, int64_t K, const float* w, float* out /* [M][R] */) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#elif LMLAB_D_AVX2

template <int M, int R>
inline void dot_rows(const float* x, int64_t K, const float* w, float* out) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float t = hsum8(acc[m][r]);
      for (int64_t j = k; j < K; ++j) t += x[m * K + j] * w[r * K + j];
      out[m * R + r] = t;
    }
}
#else
template <int M, int R>
inline void dot_rows(const float* x, int64_t K, const float* w, float* out) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float part[8] = {};
      for (int64_t j = 0; j < K; ++j) part[j & 7] += x[m * K + j] * w[r * K + j];
      out[m * R + r] = ((part[0] + part[1]) + (part[2] + part[3])) +
                       ((part[4] + part[5]) + (part[6] + part[7]));
    }
}
#endif

// Rows [n0, n1) of the product.
template <int M>
void gemv_range(const float* x, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1,
                float* y) {
  constexpr int R = kRowsAtOnce<M>;
  float out[M * R];
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    dot_rows<M, R>(x, K, w + n * K, out);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = out[m * R + r];
  }
  for (; n < n1; ++n) {
    dot_rows<M, 1>(x, K, w + n * K, out);
    for (int m = 0; m < M; ++m) y[m * N + n] = out[m];
  }
}

// Weights per parallel task: below this a layer runs on one thread (a parallel region's
// start and barrier cost more than the work). 2^16 float32 weights = 256 KiB.
constexpr int64_t kGrainWeights = int64_t{1} << 16;

template <int M>
void gemv_m(const float* x, int64_t K, const float* w, int64_t N, float* y) {
  constexpr int R = kRowsAtOnce<M>;
  const int64_t blocks = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(R * K, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    gemv_range<M>(x, K, w, N, b0 * R, std::min(N, b1 * R), y);
  });
}

void gemv(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  switch (M) {
    case 1: gemv_m<1>(x, K, w, N, y); break;
    case 2: gemv_m<2>(x, K, w, N, y); break;
    case 3: gemv_m<3>(x, K, w, N, y); break;
    case 4: gemv_m<4>(x, K, w, N, y); break;
    case 5: gemv_m<5>(x, K, w, N, y); break;
    case 6: gemv_m<6>(x, K, w, N, y); break;
    case 7: gemv_m<7>(x, K, w, N, y); break;
    default: gemv_m<8>(x, K, w, N, y); break;
  }
}

// sum a[i] b[i], vectorised (the attention scores, the norms' sums)
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float t = 0.0f;
#if LMLAB_D_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
  }
  if (i + 16 <= n) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    i += 16;
  }
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1u);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i),
                         a1);
    i = n;
  }
  t = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif LMLAB_D_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  if (i + 8 <= n) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    i += 8;
  }
  t = hsum8(_mm256_add_ps(a0, a1));
#else
  float p[4] = {};
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) p[j] += a[i + j] * b[i + j];
  t = (p[0] + p[1]) + (p[2] + p[3]);
#endif
  for (; i < n; ++i) t += a[i] * b[i];
  return t;
}

// y[i] += a x[i]
inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y (B, N) = x (B, K) through one linear layer; returns nonzero if a kernel refused it.
// Rows [n0, n1) of a quantized layer's product into y (B, n1 - n0), through quant_kernels.cpp.
int quant_rows(const Lin& l, const float* x, int64_t B, int64_t n0, int64_t n1, float* y) {
  const int64_t ng = l.k / l.g, n = n1 - n0;
  const float* s = l.s + n0 * ng;
  const float* z = l.z + n0 * ng;
  switch (l.kind) {
    case kInt8:
      return lmlab_int8_mm(x, B, l.k, static_cast<const int8_t*>(l.w) + n0 * l.k, s, n, l.g, y);
    case kInt4:
      return lmlab_int4_mm(x, B, l.k, static_cast<const uint8_t*>(l.w) + n0 * (l.k / 2), s, z,
                           n, l.g, y);
    case kInt8A8:
      return lmlab_a8_mm(8, x, B, l.k, static_cast<const uint8_t*>(l.w) + n0 * l.k, s, s, n,
                         l.g, y);
    case kInt4A8:
      return lmlab_a8_mm(4, x, B, l.k, static_cast<const uint8_t*>(l.w) + n0 * (l.k / 2), s, z,
                         n, l.g, y);
    default: return 1;
  }
}

// Codes per part at which a quantized layer is split into parts over the threads: the kernels'
// own tasks keep decode's small layers on one thread (quant_kernels.cpp, run_rows: a guard for
// loaded machines); here a layer of >= 128 KiB of codes runs as max(2, threads) calls on row
// ranges (each the kernel's own product on its rows: the same numbers; with +a8 each call
// rounds x again, the same way), in parallel where there are threads (Model::split_quant; off:
// the kernels' own split only). Measured once, at load ~1.8: SmolLM2 int4+a8 step 6.7 ms on 2
// threads with it vs ~9.6 ms on 1; on an oversubscribed machine its extra parallel regions
// cost more (each waits for a descheduled thread).
constexpr int64_t kQuantSplitBytes = int64_t{1} << 17;

int quant_linear(const Lin& l, const float* x, int64_t B, float* y, bool split) {
  const int64_t row_bytes = (l.kind == kInt4 || l.kind == kInt4A8) ? l.k / 2 : l.k;
  if (!split || row_bytes * l.n < kQuantSplitBytes || l.n < 2)
    return quant_rows(l, x, B, 0, l.n, y);
  const int64_t parts = std::min<int64_t>(l.n, std::max<int64_t>(2, at::get_num_threads()));
  std::vector<int> bad(static_cast<size_t>(parts), 0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> part;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = l.n * p / parts, n1 = l.n * (p + 1) / parts;
      if (B == 1) {  // (1, N): the rows' outputs are contiguous
        bad[p] = quant_rows(l, x, B, n0, n1, y + n0);
        continue;
      }
      part.resize(static_cast<size_t>(B * (n1 - n0)));
      bad[p] = quant_rows(l, x, B, n0, n1, part.data());
      for (int64_t b = 0; b < B; ++b)
        std::memcpy(y + b * l.n + n0, part.data() + b * (n1 - n0), sizeof(float) * (n1 - n0));
    }
  });
  for (int v : bad)
    if (v) return v;
  return 0;
}

// y (B, N) = x (B, K) through one linear layer; returns nonzero if a kernel refused it.
int linear(const Lin& l, const float* x, int64_t B, float* y, bool split) {
  if (l.kind == kFloat) {
    gemv(x, B, l.k, static_cast<const float*>(l.w), l.n, y);
  } else if (int bad = quant_linear(l, x, B, y, split)) {
    return bad;
  }
  if (l.bias)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < l.n; ++n) y[b * l.n + n] += l.bias[n];
  return 0;
}

// Several linears reading the same x, their outputs side by side: y (B, sum N).
int linears(const Lin* ls, int64_t count, const float* x, int64_t B, float* y,
            std::vector<float>& tmp, bool split) {
  if (count == 1) return linear(ls[0], x, B, y, split);
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += ls[i].n;
  tmp.resize(static_cast<size_t>(B * total));
  int64_t col = 0;
  for (int64_t i = 0; i < count; ++i) {
    float* part = tmp.data() + B * col;  // (B, n_i)
    if (int bad = linear(ls[i], x, B, part, split)) return bad;
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(y + b * total + col, part + b * ls[i].n, sizeof(float) * ls[i].n);
    col += ls[i].n;
  }
  return 0;
}

void norm(const Norm& nm, const float* x, int64_t B, int64_t D, float* y) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * D;
    float* yr = y + b * D;
    if (nm.kind == kRMS) {
      const float ss = dot(xr, xr, D);
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(nm.eps));
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r * (nm.w ? nm.w[i] : 1.0f);
    } else if (nm.kind == kLayer) {
      float mean = 0.0f;
      for (int64_t i = 0; i < D; ++i) mean += xr[i];
      mean /= static_cast<float>(D);
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] - mean;  // centred first: a stable variance
      const float var = dot(yr, yr, D) / static_cast<float>(D);
      const float r = 1.0f / std::sqrt(var + static_cast<float>(nm.eps));
      for (int64_t i = 0; i < D; ++i) {
        float v = yr[i] * r;
        if (nm.w) v *= nm.w[i];
        if (nm.b) v += nm.b[i];
        yr[i] = v;
      }
    } else {
      std::memcpy(yr, xr, sizeof(float) * D);
    }
  }
}

inline float activate(int64_t act, float v) {
  switch (act) {
    case kSilu: return v / (1.0f + std::exp(-v));
    case kGelu: return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    case kGeluTanh: {
      const float c = 0.79788456080286536f;  // sqrt(2 / pi)
      return 0.5f * v * (1.0f + std::tanh(c * (v + 0.044715f * v * v * v)));
    }
    case kRelu: return v > 0.0f || v != v ? v : 0.0f;  // NaN stays NaN, as torch's relu
    default: {
      const float r = v > 0.0f || v != v ? v : 0.0f;
      return r * r;
    }
  }
}

// out[i] = silu(g[i]) (* u[i] when u is given) = g / (1 + exp(-g)), exp vectorised (Cephes'
// expf polynomial on the range-reduced argument, ~2 ulp), the scalar formula for the tail.
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#if LMLAB_D_AVX2
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), c1 = _mm256_set1_ps(0.693359375f),
               c2 = _mm256_set1_ps(-2.12194440e-4f), one = _mm256_set1_ps(1.0f),
               lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(87.0f);
  const float pc[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                       4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 z = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_sub_ps(_mm256_setzero_ps(), x)));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(z, log2e),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(k, c2, _mm256_fnmadd_ps(k, c1, z));
    __m256 p = _mm256_set1_ps(pc[0]);
    for (int j = 1; j < 6; ++j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(pc[j]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 ex = _mm256_mul_ps(p, _mm256_castsi256_ps(e));  // exp(-x)
    __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, ex));
    // x = -inf: torch (and the scalar tail) give -inf / inf = NaN; the clamped exp gives -inf
    y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                         _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                       _CMP_EQ_OQ));
    if (u) y = _mm256_mul_ps(y, _mm256_loadu_ps(u + i));
    _mm256_storeu_ps(out + i, y);
  }
#endif
  for (; i < n; ++i) {
    const float y = g[i] / (1.0f + std::exp(-g[i]));
    out[i] = u ? y * u[i] : y;
  }
}

// rotate one head vector (hd) in place: x * cos + rotate_half(x) * sin
inline void rope_head(float* v, int64_t hd, const float* cos, const float* sin) {
  const int64_t h = hd / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    v[i] = a * cos[i] - b * sin[i];
    v[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

struct Scratch {
  std::vector<float> h, qkv, attn, proj, hidden, act, tmp;
};

// One attention head of one row: out (hd) = softmax(q . k_t * scale) v over t = 0..T-1.
void attend(const float* q, const float* kb, int64_t kstride, const float* vb, int64_t vstride,
            int64_t T, int64_t hd, float scale, float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < T; ++t) {
    const float d = dot(q, kb + t * kstride, hd) * scale;
    scores[t] = d;
    mx = std::max(mx, d);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    const float e = std::exp(scores[t] - mx);
    scores[t] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.0f;
  for (int64_t t = 0; t < T; ++t) axpy(scores[t] * inv, vb + t * vstride, out, hd);
}

int layer_step(const Layer& L, float* x, int64_t B, int64_t D, int64_t S, const float* cos,
               const float* sin, Scratch& sc, bool split) {
  const int64_t H = L.heads, KV = L.kv_heads, hd = L.head_dim, W = (H + 2 * KV) * hd;
  sc.h.resize(B * D);
  sc.qkv.resize(B * W);
  sc.attn.resize(B * H * hd);
  sc.proj.resize(B * D);
  norm(L.n1, x, B, D, sc.h.data());
  if (int bad = linears(L.qkv, L.n_qkv, sc.h.data(), B, sc.qkv.data(), sc.tmp, split))
    return bad;
  // rotate q and k, write k and v to slot S
  for (int64_t b = 0; b < B; ++b) {
    float* row = sc.qkv.data() + b * W;
    if (cos)
      for (int64_t j = 0; j < H + KV; ++j) rope_head(row + j * hd, hd, cos, sin);
    for (int64_t j = 0; j < KV; ++j) {
      std::memcpy(L.kbuf + b * L.ks[0] + j * L.ks[1] + S * L.ks[2], row + (H + j) * hd,
                  sizeof(float) * hd);
      std::memcpy(L.vbuf + b * L.vs[0] + j * L.vs[1] + S * L.vs[2], row + (H + KV + j) * hd,
                  sizeof(float) * hd);
    }
  }
  // attention, one (row, head) per task; the work grows with S, so long caches use the threads
  const int64_t T = S + 1, rep = H / KV;
  const float scale = static_cast<float>(L.scale);
  // at least 2^18 multiply-adds of q . k per task (SmolLM2: one thread below ~450 tokens)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(T * hd, 1));
  at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(T));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, hh = i % H, j = hh / rep;
      attend(sc.qkv.data() + b * W + hh * hd, L.kbuf + b * L.ks[0] + j * L.ks[1], L.ks[2],
             L.vbuf + b * L.vs[0] + j * L.vs[1], L.vs[2], T, hd, scale, scores.data(),
             sc.attn.data() + (b * H + hh) * hd);
    }
  });
  if (int bad = linear(L.o, sc.attn.data(), B, sc.proj.data(), split)) return bad;
  for (int64_t i = 0; i < B * D; ++i) x[i] += sc.proj[i];
  // FFN
  norm(L.n2, x, B, D, sc.h.data());
  int64_t total = 0;
  for (int64_t i = 0; i < L.n_gu; ++i) total += L.gu[i].n;
  sc.hidden.resize(B * total);
  if (int bad = linears(L.gu, L.n_gu, sc.h.data(), B, sc.hidden.data(), sc.tmp, split))
    return bad;
  const int64_t F = L.gated ? total / 2 : total;
  sc.act.resize(B * F);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = sc.hidden.data() + b * total;
    float* out = sc.act.data() + b * F;
    if (L.act == kSilu)
      silu_mul(row, L.gated ? row + F : nullptr, out, F);
    else if (L.gated)
      for (int64_t i = 0; i < F; ++i) out[i] = activate(L.act, row[i]) * row[F + i];
    else
      for (int64_t i = 0; i < F; ++i) out[i] = activate(L.act, row[i]);
  }
  if (int bad = linear(L.down, sc.act.data(), B, sc.proj.data(), split)) return bad;
  for (int64_t i = 0; i < B * D; ++i) x[i] += sc.proj[i];
  return 0;
}

}  // namespace

extern "C" {

// x (B, D) float32, the rows' embedded tokens, is overwritten with the last layer's residual
// stream; logits (B, V) written; cos, sin (hd,) the rotation for position S (null: no RoPE).
// Returns 0; 2 (a full cache, bad heads) or 3 (B out of range) before anything is written; 1
// when a quantized kernel refused a shape (the plan's builder checks the shapes, so a bug: x and
// the cache are then partly written).
int lmlab_decode_step(const Model* model, float* x, int64_t B, int64_t S, const float* cos,
                      const float* sin, float* logits) {
  if (B < 1 || B > kMaxRows) return 3;
  for (int64_t i = 0; i < model->n_layers; ++i) {  // refuse before anything is written
    const Layer& L = model->layers[i];
    if (S < 0 || S >= L.capacity || L.kv_heads < 1 || L.heads % L.kv_heads) return 2;
  }
  thread_local Scratch sc;
  const int64_t D = model->d_model;
  for (int64_t i = 0; i < model->n_layers; ++i)
    if (int bad = layer_step(model->layers[i], x, B, D, S, model->rope ? cos : nullptr,
                             model->rope ? sin : nullptr, sc, model->split_quant != 0))
      return bad;
  sc.h.resize(B * D);
  norm(model->final_norm, x, B, D, sc.h.data());
  return linear(model->head, sc.h.data(), B, logits, model->split_quant != 0);
}

// y (M, N) = x (M, K) @ w.T for float32 row-major operands, 1 <= M <= 8 (benchmarks, tests).
int lmlab_gemv(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  if (M < 1 || M > kMaxRows || K < 1 || N < 1) return 1;
  gemv(x, M, K, w, N, y);
  return 0;
}

// out (n,) = silu(g) * u (u null: silu(g)), the step's SwiGLU activation (tests).
void lmlab_silu_mul(const float* g, const float* u, float* out, int64_t n) { silu_mul(g, u, out, n); }

int lmlab_decode_simd() { return LMLAB_D_AVX512 ? 512 : LMLAB_D_AVX2 ? 256 : 0; }

int lmlab_decode_max_rows() { return static_cast<int>(kMaxRows); }

}  // extern "C"
