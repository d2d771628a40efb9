// Causal attention for bfloat16 training, one (batch, head) at a time in cache, with AVX512-BF16
// dot products (torch.ops.lmlab.causal_attention_bf16, train_ops.cpp; lmlab.nn.attention_core).
//
// Legend: T tokens, hd the head dim of q and k, hdv of v (multiples of 16), s the softmax scale.
// For each (b, h):
//   forward   S = s q k^T (float32), P = softmax over j <= i of row i (float32, rounded to bf16,
//             0 above the diagonal), out = P v
//   backward  dP = dO v^T, dS = P (dP - rowsum(P dP)), dQ = s dS k, dK = s dS^T q, dV = P^T dO
// The function of the batched-matmul path (lmlab.nn.attention_core._CausalAttentionBmm), with two
// differences: the scores stay float32 until the softmax (that path rounds q s and the scores to
// bf16 first), and only what the causal mask keeps is multiplied. Each product runs over row
// blocks of 6 and 16-column vectors, and a row block i0..i0+5 of S, dP (and of out, dQ over
// their reduction) goes no further than column i0 + 5 rounded up to 16; a block of key rows j of
// dV and dK sums over the query rows i >= j only. That is about half of the full products that
// torch's batched matmuls make (T^2 each, the upper triangle then masked): at T = 256, a row
// block reaches on average 55% of the columns.
//
// Products: C = A B with B's reduction dim in pairs, b32[p][n] = (B[2p][n], B[2p+1][n]) as two
// bf16 in one 32-bit word, and A's pairs broadcast one 32-bit word at a time; _mm512_dpbf16_ps
// adds both products of a pair to a float32 lane (bf16 inputs, float32 sums: the arithmetic of
// torch's bf16 matmuls on this hardware, in another order). The operands are packed per head:
// k and v transposed into pairs along hd (for q k^T and dO v^T), v, k, q and dO in row pairs
// (for P v, dS k, dS^T q and P^T dO). P is saved for the backward pass in row pairs (two rows'
// bf16 in each word), the layout P^T dO reads; the softmax backward reads row i from it by a
// shift or a mask. dS goes the same way through a per-head scratch.
//
// RoPE with the kernel (torch.ops.lmlab.rope_causal_attention_bf16): lmlab_rope_qkv_bf16
// rotates q and k of the fused q/k/v projection's output (B, T, H + 2 K, hd) row by row and
// copies v, into one tensor the forward reads as strided q, k and v (the RoPE split's
// arithmetic, rope_kernels.cpp: each product and the sum rounded to bf16, the same bits); the
// backward writes dQ, dK and dV into the projection's gradient (B, T, H + 2 K, hd) itself, dQ
// and dK rotated back per head while they are in cache (rope_split's backward, the same bits).
// So the split's three tensors each way and its own backward pass are gone. Head dims that are
// multiples of 32 (both halves whole vectors).
//
// Only built where the compiler targets AVX512-BF16 (lmlab.nn.train_kernel builds it with
// -mavx512bf16 on CPUs that list avx512_bf16); elsewhere lmlab_causal_attention_bf16_available
// returns 0 and the batched-matmul path runs.

#include <ATen/Parallel.h>

#include "attention_kernels.h"
#include "train_simd.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#if defined(LMLAB_TRAIN_AVX512) && defined(__AVX512BF16__)
#define LMLAB_ATTENTION_BF16 1
#endif

#ifdef LMLAB_ATTENTION_BF16
namespace {

constexpr int kRows = 6;  // rows of a register tile (6 x 4 vectors: 24 float32 accumulators)
constexpr int64_t kVec = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One (b, h) slice of a (B, H, T, hd) bf16 tensor: row t at p + t * st (hd contiguous elements).
struct Rows {
  const uint16_t* p;
  int64_t st;
  const uint32_t* row32(int64_t t) const { return reinterpret_cast<const uint32_t*>(p + t * st); }
};

// acc[i][v] = sum over p < np of pair a[i * ars + p * aks] times b[p * ldb + 16 v .. + 15].
template <int MR, int NV>
inline void tile(const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b, int64_t ldb,
                 int64_t np, __m512 (&acc)[MR][NV]) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(b + p * ldb + kVec * v));
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * ars + p * aks]));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
    }
  }
}

template <int MR, int NV, class Store>
inline void tile_store(const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b,
                       int64_t ldb, int64_t np, int64_t v0, Store& store) {
  __m512 acc[MR][NV];
  tile<MR, NV>(a, ars, aks, b + kVec * v0, ldb, np, acc);
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) store(i, v0 + v, acc[i][v]);
}

template <int MR, class Store>
void row_block_mr(const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b, int64_t ldb,
                  int64_t np, int64_t nv, Store& store) {
  int64_t v0 = 0;
  for (; v0 + 4 <= nv; v0 += 4) tile_store<MR, 4>(a, ars, aks, b, ldb, np, v0, store);
  switch (nv - v0) {
    case 3: tile_store<MR, 3>(a, ars, aks, b, ldb, np, v0, store); break;
    case 2: tile_store<MR, 2>(a, ars, aks, b, ldb, np, v0, store); break;
    case 1: tile_store<MR, 1>(a, ars, aks, b, ldb, np, v0, store); break;
    default: break;
  }
}

// Rows [0, m) (m <= kRows) and columns [0, 16 nv) of C = A B over np pairs; store(i, v, x) gets
// row i's vector v (columns 16 v .. 16 v + 15).
template <class Store>
void row_block(int64_t m, const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b,
               int64_t ldb, int64_t np, int64_t nv, Store store) {
  switch (m) {
    case 6: row_block_mr<6>(a, ars, aks, b, ldb, np, nv, store); break;
    case 5: row_block_mr<5>(a, ars, aks, b, ldb, np, nv, store); break;
    case 4: row_block_mr<4>(a, ars, aks, b, ldb, np, nv, store); break;
    case 3: row_block_mr<3>(a, ars, aks, b, ldb, np, nv, store); break;
    case 2: row_block_mr<2>(a, ars, aks, b, ldb, np, nv, store); break;
    case 1: row_block_mr<1>(a, ars, aks, b, ldb, np, nv, store); break;
    default: break;
  }
}

struct StoreF32 {  // times scale (rounded: the softmax's max and exponents see the same values)
  float* c;
  int64_t ldc;
  __m512 scale;
  void operator()(int i, int64_t v, __m512 x) const {
    _mm512_storeu_ps(c + i * ldc + kVec * v, _mm512_mul_ps(x, scale));
  }
};

struct StoreBf16 {  // rounded to bf16 after a multiply by scale
  uint16_t* c;
  int64_t ldc;
  __m512 scale;
  void operator()(int i, int64_t v, __m512 x) const {
    store16(_mm512_mul_ps(x, scale), c + i * ldc + kVec * v);
  }
};

// dst[p][c] = (src row 2p, src row 2p + 1) at column c < cols, for p < ceil(t / 2); a row t is 0.
void pack_row_pairs(const Rows& src, int64_t t, int64_t cols, uint32_t* dst) {
  for (int64_t p = 0; 2 * p < t; ++p) {
    const uint16_t* r0 = src.p + 2 * p * src.st;
    const bool has1 = 2 * p + 1 < t;
    const uint16_t* r1 = src.p + (2 * p + 1) * src.st;
    for (int64_t c = 0; c < cols; c += kVec) {
      __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + c)));
      __m512i hi = has1 ? _mm512_cvtepu16_epi32(
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + c)))
                        : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * cols + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// The 16 x 16 block of 32-bit words at rows r[0..15] (columns c .. c + 15 of each) stored
// transposed: dst[i * ld + j] = r[j][c + i].
inline void transpose16(const uint32_t* const* r, int64_t c, uint32_t* dst, int64_t ld) {
  __m512i x[16], y[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_si512(static_cast<const void*>(r[i] + c));
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, 32-bit words interleaved
    y[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
    y[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows, 64-bit pairs interleaved
    x[i] = _mm512_unpacklo_epi64(y[i], y[i + 2]);
    x[i + 1] = _mm512_unpackhi_epi64(y[i], y[i + 2]);
    x[i + 2] = _mm512_unpacklo_epi64(y[i + 1], y[i + 3]);
    x[i + 3] = _mm512_unpackhi_epi64(y[i + 1], y[i + 3]);
  }
  // x[4 q + s]: 128-bit lane L holds column 4 L + s of rows 4 q .. 4 q + 3
  for (int s = 0; s < 4; ++s) {
    const __m512i a = _mm512_shuffle_i32x4(x[s], x[4 + s], 0x88);       // lanes 0, 2 | 0, 2
    const __m512i b = _mm512_shuffle_i32x4(x[8 + s], x[12 + s], 0x88);
    const __m512i c2 = _mm512_shuffle_i32x4(x[s], x[4 + s], 0xdd);      // lanes 1, 3 | 1, 3
    const __m512i d = _mm512_shuffle_i32x4(x[8 + s], x[12 + s], 0xdd);
    // columns s (lane 0), 8 + s (lane 2) / 4 + s (lane 1), 12 + s (lane 3), rows 0 .. 15
    _mm512_storeu_si512(dst + s * ld, _mm512_shuffle_i32x4(a, b, 0x88));
    _mm512_storeu_si512(dst + (8 + s) * ld, _mm512_shuffle_i32x4(a, b, 0xdd));
    _mm512_storeu_si512(dst + (4 + s) * ld, _mm512_shuffle_i32x4(c2, d, 0x88));
    _mm512_storeu_si512(dst + (12 + s) * ld, _mm512_shuffle_i32x4(c2, d, 0xdd));
  }
}

// dst[c][j] = (src[j][2c], src[j][2c + 1]) for c < cols / 2, j < t; 0 for t <= j < tc.
void pack_transposed(const Rows& src, int64_t t, int64_t cols, int64_t tc, uint32_t* dst) {
  const int64_t hp = cols / 2, cfull = hp / 16 * 16;
  int64_t j0 = 0;
  for (; j0 + 16 <= t; j0 += 16) {  // 16 x 16 blocks, then the columns left over one by one
    const uint32_t* r[16];
    for (int i = 0; i < 16; ++i) r[i] = src.row32(j0 + i);
    for (int64_t c = 0; c < cfull; c += 16) transpose16(r, c, dst + c * tc + j0, tc);
    for (int64_t c = cfull; c < hp; ++c)
      for (int i = 0; i < 16; ++i) dst[c * tc + j0 + i] = r[i][c];
  }
  for (int64_t j = j0; j < t; ++j) {
    const uint32_t* r = src.row32(j);
    for (int64_t c = 0; c < hp; ++c) dst[c * tc + j] = r[c];
  }
  for (int64_t c = 0; c < hp; ++c)
    for (int64_t j = t; j < tc; ++j) dst[c * tc + j] = 0;
}

// Two bf16 rows (w columns, a multiple of 16) into one row of pairs: dst[j] = (r0[j], r1[j]).
// kStream: dst 64-byte aligned, written around the caches (P for the backward pass: 8 MB a
// layer at the Mini-GPT shape, not read again before then; the caller fences).
template <bool kStream>
void interleave_rows(const uint16_t* r0, const uint16_t* r1, int64_t w, uint32_t* dst) {
  for (int64_t j = 0; j < w; j += kVec) {
    __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + j)));
    __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + j)));
    const __m512i x = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    if (kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), x);
    else _mm512_storeu_si512(dst + j, x);
  }
}

inline __mmask16 lanes(int64_t n, int64_t j) {  // lanes of columns j .. j + 15 below n
  return n - j >= kVec ? static_cast<__mmask16>(0xffff) : n <= j ? 0 : tail_mask(n - j);
}

// Row i's probabilities from s (float32 scaled scores, n = i + 1 of them) into p (bf16, w >= n
// columns, 0 from n on): softmax of s over [0, n). s is overwritten. The exponents are s - max
// of the same stored values, so the largest is exactly 0 however large the scores (a product
// fused into the subtraction would leave its rounding error there: e^(+-100) at 1e10).
void softmax_row_bf16(float* s, int64_t n, int64_t w, uint16_t* p) {
  const __m512 ninf = bcast(-INFINITY);
  __m512 vm = ninf;
  for (int64_t j = 0; j < n; j += kVec)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, lanes(n, j), s + j));
  const __m512 bm = bcast(_mm512_reduce_max_ps(vm));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kVec) {
    const __mmask16 k = lanes(n, j);
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), bm));
    e = _mm512_maskz_mov_ps(k, e);
    _mm512_storeu_ps(s + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 inv = bcast(1.0f / _mm512_reduce_add_ps(vsum));
  int64_t j = 0;
  for (; j < n; j += kVec) store16(_mm512_mul_ps(_mm512_loadu_ps(s + j), inv), p + j);
  for (; j < w; j += kVec) store16(_mm512_setzero_ps(), p + j);
}

// Row i of P (bf16) read from its row pairs (row i is the low half of word pair i / 2 when i is
// even, the high half when odd), as float32, columns j .. j + 15.
inline __m512 load_pair_row(const uint32_t* pairs, bool odd, int64_t j) {
  __m512i x = _mm512_loadu_si512(static_cast<const void*>(pairs + j));
  x = odd ? _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))
          : _mm512_slli_epi32(x, 16);
  return _mm512_castsi512_ps(x);
}

// dS row i into ds (bf16, w columns, 0 from n = i + 1 on): P (dP - sum_j P dP) over [0, n),
// P from its row pairs, dP float32.
void softmax_backward_row_bf16(const uint32_t* p_pairs, bool odd, const float* dp, int64_t n,
                               int64_t w, uint16_t* ds) {
  __m512 vdot = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kVec) {
    const __m512 pv = _mm512_maskz_mov_ps(lanes(n, j), load_pair_row(p_pairs, odd, j));
    vdot = _mm512_fmadd_ps(pv, _mm512_loadu_ps(dp + j), vdot);
  }
  const __m512 bdot = bcast(_mm512_reduce_add_ps(vdot));
  int64_t j = 0;
  for (; j < n; j += kVec) {
    const __m512 pv = _mm512_maskz_mov_ps(lanes(n, j), load_pair_row(p_pairs, odd, j));
    store16(_mm512_mul_ps(pv, _mm512_sub_ps(_mm512_loadu_ps(dp + j), bdot)), ds + j);
  }
  for (; j < w; j += kVec) store16(_mm512_setzero_ps(), ds + j);
}

struct Shape {
  int64_t t, hd, hdv, tc, tr;  // tokens, q/k and v head dims, T rounded up to 16, ceil(T / 2)
  Shape(int64_t t_, int64_t hd_, int64_t hdv_)
      : t(t_), hd(hd_), hdv(hdv_), tc(round_up(t_, kVec)), tr((t_ + 1) / 2) {}
  // row block [i0, i0 + m): columns its products reach (vectors), and the columns its bf16 rows
  // (and their pairs) are written to: 16 more, zeros, so that every row i has 0 on (i, i + 6]
  int64_t vectors(int64_t i_end) const { return (i_end + kVec - 1) / kVec; }
  int64_t written(int64_t i_end) const { return std::min(tc, kVec * (vectors(i_end) + 1)); }
};

// One (b, h) forward with its kv head packed (kt: k transposed, vp: v in row pairs): out (t
// rows of hdv, row i at out + i ldo), pairs (tr x tc words): P in row pairs.
void forward_head(const Rows& q, const uint32_t* kt, const uint32_t* vp, uint16_t* out,
                  int64_t ldo, uint32_t* pairs, const Shape& sh, float scale,
                  std::vector<float>& sf, std::vector<uint16_t>& pl) {
  const int64_t t = sh.t, hd = sh.hd, hdv = sh.hdv, tc = sh.tc, hp = hd / 2;
  const __m512 one = bcast(1.0f);
  const bool stream = reinterpret_cast<uintptr_t>(pairs) % 64 == 0;  // at::empty's alignment
  for (int64_t i0 = 0; i0 < t; i0 += kRows) {
    const int64_t m = std::min<int64_t>(kRows, t - i0), i_end = i0 + m;
    const int64_t nv = sh.vectors(i_end), w = sh.written(i_end);
    // S rows i0 .. i_end - 1, columns [0, 16 nv), float32
    row_block(m, q.row32(i0), q.st / 2, 1, kt, tc, hp, nv, StoreF32{sf.data(), tc, bcast(scale)});
    for (int64_t r = 0; r < m; ++r)
      softmax_row_bf16(sf.data() + r * tc, i0 + r + 1, w, pl.data() + r * tc);
    if (m % 2) std::fill(pl.data() + m * tc, pl.data() + m * tc + w, uint16_t{0});
    // out rows = P v over the pairs of keys j < i_end
    const uint32_t* p32 = reinterpret_cast<const uint32_t*>(pl.data());
    row_block(m, p32, tc / 2, 1, vp, hdv, (i_end + 1) / 2, hdv / kVec,
              StoreBf16{out + i0 * ldo, ldo, one});
    for (int64_t r = 0; r < m; r += 2) {
      const uint16_t *r0 = pl.data() + r * tc, *r1 = r0 + tc;
      uint32_t* dst = pairs + (i0 / 2 + r / 2) * tc;
      if (stream) interleave_rows<true>(r0, r1, w, dst);
      else interleave_rows<false>(r0, r1, w, dst);
    }
  }
  if (stream) _mm_sfence();  // the streamed P is in memory before anyone reads it
}

// float32 accumulators of dK or dV over the query heads that share a kv head: the first head
// stores, the others add.
struct AccF32 {
  float* c;
  int64_t ldc;
  bool first;
  void operator()(int i, int64_t v, __m512 x) const {
    float* p = c + i * ldc + kVec * v;
    _mm512_storeu_ps(p, first ? x : _mm512_add_ps(x, _mm512_loadu_ps(p)));
  }
};

// Per-thread packs and scratch of the backward pass.
struct BackwardScratch {
  std::vector<uint32_t> vt, kp, gp, qp, ds_pairs;
  std::vector<float> sf;
  std::vector<uint16_t> dsl;
  explicit BackwardScratch(const Shape& sh)
      : vt(sh.hdv / 2 * sh.tc), kp(sh.tr * sh.hd), gp(sh.tr * sh.hdv), qp(sh.tr * sh.hd),
        ds_pairs(sh.tr * sh.tc), sf(kRows * sh.tc), dsl((kRows + 1) * sh.tc) {}
};

// One (b, h) backward with its kv head packed in w.vt (v transposed) and w.kp (k in row pairs):
// dq (t rows of hd, row i at dq + i ldq); dK / s and dV of this head into dk_acc and dv_acc
// (float32, t rows of hd and hdv; stored when first, else added).
void backward_head(const Rows& q, const Rows& g, const uint32_t* pairs, uint16_t* dq,
                   int64_t ldq, float* dk_acc, float* dv_acc, const Shape& sh, float scale,
                   bool first, BackwardScratch& w) {
  const int64_t t = sh.t, hd = sh.hd, hdv = sh.hdv, tc = sh.tc, tr = sh.tr;
  pack_row_pairs(g, t, hdv, w.gp.data());
  pack_row_pairs(q, t, hd, w.qp.data());
  const __m512 vs = bcast(scale);
  for (int64_t i0 = 0; i0 < t; i0 += kRows) {
    const int64_t m = std::min<int64_t>(kRows, t - i0), i_end = i0 + m;
    const int64_t nv = sh.vectors(i_end), wr = sh.written(i_end);
    // the next block's rows of P, from memory while this block's products run
    for (int64_t p = (i0 + kRows) / 2; p < std::min(tr, (i0 + 2 * kRows) / 2); ++p)
      for (int64_t j = 0; j < sh.written(std::min(t, i0 + 2 * kRows)); j += kVec)
        _mm_prefetch(reinterpret_cast<const char*>(pairs + p * tc + j), _MM_HINT_T0);
    // dP rows = dO v^T, columns [0, 16 nv)
    row_block(m, g.row32(i0), g.st / 2, 1, w.vt.data(), tc, hdv / 2, nv,
              StoreF32{w.sf.data(), tc, bcast(1.0f)});
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = i0 + r;
      softmax_backward_row_bf16(pairs + (i / 2) * tc, i % 2 == 1, w.sf.data() + r * tc, i + 1,
                                wr, w.dsl.data() + r * tc);
    }
    if (m % 2) std::fill(w.dsl.data() + m * tc, w.dsl.data() + m * tc + wr, uint16_t{0});
    // dQ rows = scale dS k over the pairs of keys j < i_end
    const uint32_t* d32 = reinterpret_cast<const uint32_t*>(w.dsl.data());
    row_block(m, d32, tc / 2, 1, w.kp.data(), hd, (i_end + 1) / 2, hd / kVec,
              StoreBf16{dq + i0 * ldq, ldq, vs});
    for (int64_t r = 0; r < m; r += 2)
      interleave_rows<false>(w.dsl.data() + r * tc, w.dsl.data() + (r + 1) * tc, wr,
                             w.ds_pairs.data() + (i0 / 2 + r / 2) * tc);
  }
  // key rows j0 .. j0 + 5: dV = P^T dO and dK / s = dS^T q over the query pairs from j0 / 2
  for (int64_t j0 = 0; j0 < t; j0 += kRows) {
    const int64_t m = std::min<int64_t>(kRows, t - j0), p0 = j0 / 2, np = tr - p0;
    row_block(m, pairs + p0 * tc + j0, 1, tc, w.gp.data() + p0 * hdv, hdv, np, hdv / kVec,
              AccF32{dv_acc + j0 * hdv, hdv, first});
    row_block(m, w.ds_pairs.data() + p0 * tc + j0, 1, tc, w.qp.data() + p0 * hd, hd, np,
              hd / kVec, AccF32{dk_acc + j0 * hd, hd, first});
  }
}

// n float32 values times scale, rounded to bf16 (n a multiple of 16).
void store_scaled(const float* x, int64_t n, float scale, uint16_t* y) {
  const __m512 vs = bcast(scale);
  for (int64_t i = 0; i < n; i += kVec) store16(_mm512_mul_ps(_mm512_loadu_ps(x + i), vs), y + i);
}

Rows head(const void* base, const int64_t* strides, int64_t b, int64_t h) {
  return Rows{static_cast<const uint16_t*>(base) + b * strides[0] + h * strides[1], strides[2]};
}

// The first row of head h of batch b in a writable (B, heads, T rows) tensor of those strides.
uint16_t* head_rows(void* base, const int64_t* strides, int64_t b, int64_t h) {
  return static_cast<uint16_t*>(base) + b * strides[0] + h * strides[1];
}

// ---- RoPE with the kernel -------------------------------------------------------------------

// v rounded to bf16 (nearest even) and widened back, lane by lane, in integer arithmetic:
// rope_kernels.cpp's round16 (no subnormal flush, unlike the AVX512-BF16 conversion), so the
// rotation's bits are rope_split's.
inline __m512 round_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(
      _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// v, already bf16-exact, stored as bf16 (its high halves: no second rounding, no flush).
inline void store_exact16(__m512 v, uint16_t* p) {
  const __m256i w = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
}

// One row's tables as float32 (hd each, widened exactly from the bf16 tables): c = cos, and s
// = sgn (the forward: sin with its first half negated) or, inverse, sgn[(i + hd/2) mod hd] (the
// rotation back, rope_split's backward). hd a multiple of 32.
inline void widen_row(const uint16_t* cos, const uint16_t* sgn, int64_t hd, bool inverse,
                      float* c, float* s) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; i += kVec) {
    const int64_t j = !inverse ? i : i < half ? i + half : i - half;
    _mm512_storeu_ps(c + i, load16(cos + i));
    _mm512_storeu_ps(s + i, load16(sgn + j));
  }
}

// One head's row rotated: y[i] = x[i] c[i] + x[j] s[i], j = (i + hd/2) mod hd, each product and
// the sum rounded to bf16 (rope_kernels.cpp's head16: the same operations in the same order).
inline void rotate_row(const uint16_t* x, const float* c, const float* s, uint16_t* y,
                       int64_t hd) {
  const int64_t h = hd / 2;
  for (int64_t i = 0; i < h; i += kVec) {
    const __m512 lo = load16(x + i), hi = load16(x + h + i);
    const __m512 a = round_bf16x16(_mm512_mul_ps(lo, _mm512_loadu_ps(c + i)));
    const __m512 b = round_bf16x16(_mm512_mul_ps(hi, _mm512_loadu_ps(s + i)));
    const __m512 a2 = round_bf16x16(_mm512_mul_ps(hi, _mm512_loadu_ps(c + h + i)));
    const __m512 b2 = round_bf16x16(_mm512_mul_ps(lo, _mm512_loadu_ps(s + h + i)));
    store_exact16(round_bf16x16(_mm512_add_ps(a, b)), y + i);
    store_exact16(round_bf16x16(_mm512_add_ps(a2, b2)), y + h + i);
  }
}

// n bf16 (a multiple of 32) copied, 64 bytes at a time.
inline void copy_bf16(const uint16_t* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; i += 32)
    _mm512_storeu_si512(static_cast<void*>(y + i),
                        _mm512_loadu_si512(static_cast<const void*>(x + i)));
}

// The backward's rotation back: the (T, hd) tables widened for the inverse, once a call.
struct InverseTables {
  int64_t hd;
  std::vector<float> c, s;
  InverseTables(const uint16_t* cos, const uint16_t* sgn, int64_t t, int64_t hd_)
      : hd(hd_), c(t * hd_), s(t * hd_) {
    for (int64_t r = 0; r < t; ++r)
      widen_row(cos + r * hd, sgn + r * hd, hd, true, c.data() + r * hd, s.data() + r * hd);
  }
};

// Rows [0, t) of src (hd contiguous bf16 each) written to dst (row r at dst + r ld): rotated
// back (rope's inverse, row r by token r's tables) when rt is not null, else copied (hd a
// multiple of 32 with rt, of 16 without).
void put_rows(const uint16_t* src, int64_t t, int64_t hd, const InverseTables* rt, uint16_t* dst,
              int64_t ld) {
  for (int64_t r = 0; r < t; ++r) {
    const uint16_t* x = src + r * hd;
    if (rt) rotate_row(x, rt->c.data() + r * hd, rt->s.data() + r * hd, dst + r * ld, hd);
    else std::copy(x, x + hd, dst + r * ld);
  }
}

}  // namespace
#endif

extern "C" int lmlab_causal_attention_bf16_available() {
#ifdef LMLAB_ATTENTION_BF16
  return 1;
#else
  return 0;
#endif
}

// q (B, H, T, hd), k (B, K, T, hd) and v (B, K, T, hdv) bf16, K dividing H (query head h
// reads kv head h / (H / K)), with element strides {B, H or K, T} (rows contiguous, every
// stride even, 4-byte aligned data; hd and hdv multiples of 16); out (B, T, H, hdv) contiguous
// (token-major: its (B, H, T, hdv) view is what the heads' concatenation before the output
// projection reads without a copy);
// probs (B H, ceil(T / 2), T rounded up to 16) 32-bit words: P in row pairs, for the backward.
// One task per (b, h), its kv head packed for it. Returns 0, or -1 where not built.
extern "C" int lmlab_causal_attention_bf16_forward(const void* q, const int64_t* qs, const void* k,
                                                   const int64_t* ks, const void* v,
                                                   const int64_t* vs, void* out, void* probs,
                                                   int64_t b, int64_t h, int64_t kv, int64_t t,
                                                   int64_t hd, int64_t hdv, float scale) {
#ifdef LMLAB_ATTENTION_BF16
  const Shape sh(t, hd, hdv);
  const int64_t rep = h / kv;
  at::parallel_for(0, b * h, 1, [&](int64_t n0, int64_t n1) {
    std::vector<uint32_t> kt(hd / 2 * sh.tc), vp(sh.tr * hdv);
    std::vector<float> sf(kRows * sh.tc);
    std::vector<uint16_t> pl((kRows + 1) * sh.tc);
    int64_t packed = -1;  // the (b, kv head) whose k and v are in kt and vp
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t bi = n / h, hi = n % h, ki = hi / rep, group = bi * kv + ki;
      if (group != packed) {  // consecutive query heads of one kv head share the packs
        pack_transposed(head(k, ks, bi, ki), t, hd, sh.tc, kt.data());
        pack_row_pairs(head(v, vs, bi, ki), t, hdv, vp.data());
        packed = group;
      }
      forward_head(head(q, qs, bi, hi), kt.data(), vp.data(),
                   static_cast<uint16_t*>(out) + (bi * t * h + hi) * hdv, h * hdv,
                   static_cast<uint32_t*>(probs) + n * sh.tr * sh.tc, sh, scale, sf, pl);
    }
  });
  return 0;
#else
  (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)out, (void)probs;
  (void)b, (void)h, (void)kv, (void)t, (void)hd, (void)hdv, (void)scale;
  return -1;
#endif
}

// RoPE of the fused q/k/v projection's output before the forward above: qkv (R = B T rows of
// `heads` heads of hd, contiguous), the first rot_heads heads of each row (q and k) rotated by
// the tables of its token (row % t; cos and sgn (T, hd) bf16), the others (v) copied, into out
// (the same layout): rope_split's arithmetic (each product and the sum rounded to bf16, the
// same bits) row by row, as that kernel runs, with the row's tables widened once for all its
// heads. hd a multiple of 32. Returns 0, or -1 where not built.
extern "C" int lmlab_rope_qkv_bf16(const void* qkv, int64_t rows, int64_t t, int64_t heads,
                                   int64_t rot_heads, int64_t hd, const void* cos,
                                   const void* sgn, void* out) {
#ifdef LMLAB_ATTENTION_BF16
  const auto* x = static_cast<const uint16_t*>(qkv);
  auto* y = static_cast<uint16_t*>(out);
  const auto* c16 = static_cast<const uint16_t*>(cos);
  const auto* s16 = static_cast<const uint16_t*>(sgn);
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> c(hd), s(hd);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t tt = r % t;
      widen_row(c16 + tt * hd, s16 + tt * hd, hd, false, c.data(), s.data());
      const uint16_t* xr = x + r * heads * hd;
      uint16_t* yr = y + r * heads * hd;
      for (int64_t n = 0; n < rot_heads; ++n)
        rotate_row(xr + n * hd, c.data(), s.data(), yr + n * hd, hd);
      copy_bf16(xr + rot_heads * hd, (heads - rot_heads) * hd, yr + rot_heads * hd);
    }
  });
  return 0;
#else
  (void)qkv, (void)rows, (void)t, (void)heads, (void)rot_heads, (void)hd, (void)cos, (void)sgn;
  (void)out;
  return -1;
#endif
}

// The backward of the forward above: g = dL/dout (B, H, T, hdv) with strides gs as q's; probs
// what the forward wrote; dq (B, H, T, hd), dk (B, K, T, hd) and dv (B, K, T, hdv) with element
// strides dqs, dks, dvs ({B, heads, T}, rows contiguous: the q/k/v projection's gradient
// (B, T, H + 2 K, hd) itself under RoPE), dK and dV summed over the query heads of each kv head
// in float32, rounded once. rope_cos / rope_sgn: null, or the (T, hd) bf16 tables by which
// lmlab_rope_qkv_bf16 rotated q and k before the forward (hd a multiple of 32): dQ and dK are
// rotated back as they are written (rope_split's backward, the same bits). Tasks: the query
// heads of each (b, kv head) in `chunks` runs of consecutive heads (one run unless there are
// fewer (b, kv head) pairs than threads: MQA at batch 1), each run summing its heads into its
// own float32 buffer, the runs then summed in order. Returns 0, or -1 where not built.
extern "C" int lmlab_causal_attention_bf16_backward(
    const void* q, const int64_t* qs, const void* k, const int64_t* ks, const void* v,
    const int64_t* vs, const void* g, const int64_t* gs, const void* probs, void* dq,
    const int64_t* dqs, void* dk, const int64_t* dks, void* dv, const int64_t* dvs, int64_t b,
    int64_t h, int64_t kv, int64_t t, int64_t hd, int64_t hdv, float scale, const void* rope_cos,
    const void* rope_sgn) {
#ifdef LMLAB_ATTENTION_BF16
  if (b == 0 || t == 0) return 0;  // nothing to write (and no threads to share out: no groups)
  const Shape sh(t, hd, hdv);
  const int64_t rep = h / kv, groups = b * kv;
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = groups >= threads ? 1 : std::min(rep, (threads + groups - 1) / groups);
  const int64_t per = (rep + chunks - 1) / chunks;  // query heads per run
  std::unique_ptr<InverseTables> rope;
  if (rope_cos)
    rope = std::make_unique<InverseTables>(static_cast<const uint16_t*>(rope_cos),
                                           static_cast<const uint16_t*>(rope_sgn), t, hd);
  const InverseTables* rt = rope.get();
  // dK (times scale) and dV of kv head (bi, ki) from their float32 sums: rounded once to bf16,
  // then dK rotated back when the forward rotated; `tmp` t max(hd, hdv) bf16
  auto finish_kv = [&](const float* acc_k_, const float* acc_v_, int64_t bi, int64_t ki,
                       uint16_t* tmp) {
    uint16_t *dk_rows = head_rows(dk, dks, bi, ki), *dv_rows = head_rows(dv, dvs, bi, ki);
    if (!rt && dks[2] == hd) {  // contiguous rows: rounded in place
      store_scaled(acc_k_, t * hd, scale, dk_rows);
    } else {
      store_scaled(acc_k_, t * hd, scale, tmp);
      put_rows(tmp, t, hd, rt, dk_rows, dks[2]);
    }
    if (dvs[2] == hdv) {
      store_scaled(acc_v_, t * hdv, 1.0f, dv_rows);
    } else {
      store_scaled(acc_v_, t * hdv, 1.0f, tmp);
      put_rows(tmp, t, hdv, nullptr, dv_rows, dvs[2]);
    }
  };
  // one run: each task's own buffers, rounded into dk and dv at its end; several: all of them
  const int64_t shared = chunks > 1 ? groups * chunks : 0;
  std::vector<float> acc_k(shared * t * hd), acc_v(shared * t * hdv);
  at::parallel_for(0, groups * chunks, 1, [&](int64_t n0, int64_t n1) {
    BackwardScratch w(sh);
    std::vector<float> own_k(chunks > 1 ? 0 : t * hd), own_v(chunks > 1 ? 0 : t * hdv);
    std::vector<uint16_t> tmp(t * std::max(hd, hdv));  // dQ before its rotation; dK, dV rounded
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t group = n / chunks, c = n % chunks, bi = group / kv, ki = group % kv;
      const int64_t h0 = ki * rep + c * per, h1 = std::min(ki * rep + rep, h0 + per);
      float* dk_acc = chunks > 1 ? acc_k.data() + n * t * hd : own_k.data();
      float* dv_acc = chunks > 1 ? acc_v.data() + n * t * hdv : own_v.data();
      if (h0 >= h1) {  // an empty run (more runs than heads): adds nothing
        std::fill(dk_acc, dk_acc + t * hd, 0.0f);
        std::fill(dv_acc, dv_acc + t * hdv, 0.0f);
        continue;
      }
      pack_transposed(head(v, vs, bi, ki), t, hdv, sh.tc, w.vt.data());
      pack_row_pairs(head(k, ks, bi, ki), t, hd, w.kp.data());
      for (int64_t hi = h0; hi < h1; ++hi) {
        const int64_t bh = bi * h + hi;
        uint16_t* dq_rows = head_rows(dq, dqs, bi, hi);
        // rotated back from a scratch when the forward rotated, else written in place
        backward_head(head(q, qs, bi, hi), head(g, gs, bi, hi),
                      static_cast<const uint32_t*>(probs) + bh * sh.tr * sh.tc,
                      rope ? tmp.data() : dq_rows, rope ? hd : dqs[2], dk_acc, dv_acc, sh,
                      scale, hi == h0, w);
        if (rope) put_rows(tmp.data(), t, hd, rt, dq_rows, dqs[2]);
      }
      if (chunks == 1) finish_kv(dk_acc, dv_acc, bi, ki, tmp.data());
    }
  });
  if (chunks == 1) return 0;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint16_t> tmp(t * std::max(hd, hdv));
    for (int64_t group = g0; group < g1; ++group) {  // the runs in order, then one rounding
      float* k0 = acc_k.data() + group * chunks * t * hd;
      float* v0 = acc_v.data() + group * chunks * t * hdv;
      for (int64_t c = 1; c < chunks; ++c) {
        for (int64_t i = 0; i < t * hd; ++i) k0[i] += k0[c * t * hd + i];
        for (int64_t i = 0; i < t * hdv; ++i) v0[i] += v0[c * t * hdv + i];
      }
      finish_kv(k0, v0, group / kv, group % kv, tmp.data());
    }
  });
  return 0;
#else
  (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)g, (void)gs, (void)probs;
  (void)dq, (void)dqs, (void)dk, (void)dks, (void)dv, (void)dvs, (void)b, (void)h, (void)kv;
  (void)t, (void)hd, (void)hdv, (void)scale, (void)rope_cos, (void)rope_sgn;
  return -1;
#endif
}
