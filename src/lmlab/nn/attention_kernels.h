// The fused bf16 causal attention's entry points (attention_kernels.cpp), declared once for the
// file that defines them and for train_ops.cpp, which calls them from its torch operator.
#pragma once

#include <cstdint>

// 1 where attention_kernels.cpp was compiled for AVX512-BF16, else 0 (the others return -1).
extern "C" int lmlab_causal_attention_bf16_available();
extern "C" int lmlab_causal_attention_bf16_forward(const void* q, const int64_t* qs, const void* k,
                                                   const int64_t* ks, const void* v,
                                                   const int64_t* vs, void* out, void* probs,
                                                   int64_t b, int64_t h, int64_t kv, int64_t t,
                                                   int64_t hd, int64_t hdv, float scale);
// q and k (the first rot_heads of each row's heads) rotated by RoPE's (T, hd) bf16 tables, v
// copied: the fused projection's output before the forward.
extern "C" int lmlab_rope_qkv_bf16(const void* qkv, int64_t rows, int64_t t, int64_t heads,
                                   int64_t rot_heads, int64_t hd, const void* cos,
                                   const void* sgn, void* out);
// dqs, dks, dvs: the element strides {B, heads, T} of dq, dk and dv (rows contiguous); with
// rope tables dq and dk are rotated back as they are written.
extern "C" int lmlab_causal_attention_bf16_backward(
    const void* q, const int64_t* qs, const void* k, const int64_t* ks, const void* v,
    const int64_t* vs, const void* g, const int64_t* gs, const void* probs, void* dq,
    const int64_t* dqs, void* dk, const int64_t* dks, void* dv, const int64_t* dvs, int64_t b,
    int64_t h, int64_t kv, int64_t t, int64_t hd, int64_t hdv, float scale, const void* rope_cos,
    const void* rope_sgn);
