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
extern "C" int lmlab_causal_attention_bf16_backward(const void* q, const int64_t* qs,
                                                    const void* k, const int64_t* ks,
                                                    const void* v, const int64_t* vs,
                                                    const void* g, const int64_t* gs,
                                                    const void* probs, void* dq, void* dk, void* dv,
                                                    int64_t b, int64_t h, int64_t kv, int64_t t,
                                                    int64_t hd, int64_t hdv, float scale);
