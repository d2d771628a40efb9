// lmlab's training kernels as torch operators with their autograd in C++ (torch.ops.lmlab.*).
//
// The kernels of train_kernels.cpp (compiled into the same library) are also reachable through
// ctypes; these operators wrap six of them with their forward and backward written as
// torch::autograd::Function, so that a training step enters them through the dispatcher
// instead of a Python autograd.Function (whose apply and backward cost some 20-50 us of Python
// each, comparable to the kernels themselves at small shapes; lmlab.nn.train_kernel):
//
//   norm_bf16(x, weight, bias, eps, rms) -> y          LayerNorm / RMSNorm, float32 -> bfloat16
//   causal_attention_bmm(q, k, v, scale, kernel) -> y  causal softmax(q k^T scale) v, three
//                                                      batched matmuls, the softmax in the kernel
//   add_f32_bf16(x, y, bias) -> x + (y + bias)         the residual add of a bf16 branch
//                                                      (and of its projection's float32
//                                                      bias, its gradient summed in the
//                                                      backward's pass)
//   gelu_bf16(u, bias, tanh) -> gelu(u + bias)         an MLP's GELU (exact, or its tanh form)
//                                                      of its bias-free bf16 up projection
//                                                      plus the float32 bias, one pass each
//                                                      way (the bias gradient summed in the
//                                                      backward's pass)
//   silu_mul_bf16(gate, up) -> silu(gate) * up         a SwiGLU FFN's hidden activation in
//                                                      one pass each way
//   adamw_step_(params, grads, exp_avgs, exp_avg_sqs,  one AdamW step of every listed
//               steps, lr, beta1, beta2,               parameter in one threaded call (no
//               weight_decay, eps) -> taken            autograd: an optimizer's update),
//                                                      false with nothing written where the
//                                                      kernel cannot take the tensors
//                                                      (lmlab.training.optim.AdamW)
//   clip_grads_(grads, max_norm)                      gradient clipping by the global L2
//     -> (taken, norm, coef)                           norm in one call (no autograd), or
//                                                      (false, 0, 1) with nothing written
//                                                      (lmlab.training.guard)
//   causal_attention_bf16(q, k, v, scale) -> y         causal softmax(q k^T scale) v in bf16,
//                                                      one (batch, head) at a time in cache,
//                                                      the masked blocks skipped, k and v may
//                                                      have fewer heads (GQA); y is a
//                                                      (B, H, T, hdv) view of a (B, T, H,
//                                                      hdv) tensor (attention_kernels.cpp)
//   rope_causal_attention_bf16(qkv, cos, signed,       the same of the fused q/k/v
//                              h, kv, scale) -> y      projection's output (B, T, h + 2 kv,
//                                                      hd), q and k rotated (RoPE) in one
//                                                      pass into one tensor it keeps; its
//                                                      backward writes that output's
//                                                      gradient itself (rope_split's bits,
//                                                      without its tensors and passes)
//
// Each computes what its Python twin computed (lmlab.nn.train_kernel.NormBf16Function until
// the fifth session; lmlab.nn.attention_core._CausalAttentionBmm, still the fallback where the
// library is not built, with torch's softmax; torch's x + y), the same kernels and ATen calls
// in the same order, so the same bits. A backward that records its own graph (create_graph)
// runs differentiable ATen ops instead of the kernels (norm_bf16, add_f32_bf16 with a bias,
// gelu_bf16, silu_mul_bf16; add_f32_bf16's backward without one is ATen ops anyway);
// causal_attention_bmm refuses it (its saved tensors carry no graph back to
// q, k and v). Each refuses, before any pointer is read, what its kernel cannot read.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_kernels.h"

extern "C" int lmlab_causal_softmax_forward(int dtype, const void* s, void* p, int64_t n, int64_t t);
extern "C" int lmlab_causal_softmax_backward(int dtype, const void* p, const void* dp, void* ds,
                                             int64_t n, int64_t t);
extern "C" int lmlab_norm_bf16_forward(int kind, const float* x, const float* w, const float* b,
                                       void* y, float* mean, float* rstd, int64_t rows, int64_t d,
                                       float eps);
extern "C" int lmlab_norm_bf16_backward(int kind, const void* dy, const float* x, const float* w,
                                        const float* mean, const float* rstd, float* dx, float* dw,
                                        float* db, int64_t rows, int64_t d);
extern "C" int lmlab_add_f32_bf16(const float* x, const void* y, float* out, int64_t n);
extern "C" int lmlab_add_bias_f32_bf16(const float* x, const void* y, const float* b, float* out,
                                       int64_t m, int64_t n);
extern "C" int lmlab_add_bias_backward(const float* g, void* dy, float* partial, float* db,
                                       int64_t m, int64_t n);
extern "C" int64_t lmlab_sum_blocks(int64_t m);
extern "C" int64_t lmlab_gelu_bf16_blocks(int64_t m);
extern "C" int lmlab_silu_mul_bf16_forward(const void* gate, const void* up, void* h, int64_t n);
extern "C" int lmlab_silu_mul_bf16_backward(const void* g, const void* gate, const void* up,
                                            void* dgate, void* dup, int64_t n);
extern "C" int lmlab_gelu_bf16_forward(int form, const void* u, const float* b, void* a, int64_t m,
                                       int64_t n);
extern "C" int lmlab_gelu_bf16_backward(int form, const void* g, const void* u, const float* b,
                                        void* du, float* partial, float* db, int64_t m, int64_t n);
extern "C" int lmlab_grad_clip(int64_t count, float* const* ptrs, const int64_t* numels,
                               double max_norm, double* norm, float* coef_out);
extern "C" int lmlab_adamw_step(int64_t count, float* const* params, const float* const* grads,
                                float* const* exp_avgs, float* const* exp_avg_sqs,
                                float* const* steps, const int64_t* numels, const double* lr,
                                const double* beta1, const double* beta2,
                                const double* weight_decay, const double* eps);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int softmax_dtype(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 1 : 0; }

// Whether the elements of t (a CPU tensor) are allocated: none to read, or real storage that
// holds every element its sizes and strides reach (a storage shrunk after the tensor was made,
// as resize_ on untyped_storage() does, would be read and written past its end).
bool has_data(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  if (!t.has_storage() || t.storage().data() == nullptr) return false;
  int64_t last = t.storage_offset();  // the farthest element's index
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return false;
    last += (t.size(d) - 1) * t.stride(d);
  }
  const auto need = static_cast<uint64_t>(last + 1) * static_cast<uint64_t>(t.element_size());
  return t.storage_offset() >= 0 && need <= static_cast<uint64_t>(t.storage().nbytes());
}

// The operators are reachable by anyone as torch.ops.lmlab.*: every kernel reads and writes
// through data pointers, so what it cannot read is refused here (a RuntimeError), never read.
void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided, "lmlab.", op,
              ": ", name, " must be a dense CPU tensor");
  // a fake tensor (FakeTensorMode, torch.compile's tracing) says CPU but has no data: its
  // untyped data_ptr() is null, and the kernels would write through it
  TORCH_CHECK(has_data(t), "lmlab.", op, ": ", name,
              " has no data (a fake tensor, a ZeroTensor, or a torch.func transform's wrapper)");
}

void check_param(const std::optional<at::Tensor>& p, int64_t d, const char* name) {
  if (!p.has_value() || !p->defined()) return;
  check_cpu(*p, "norm_bf16", name);
  TORCH_CHECK(p->scalar_type() == at::kFloat && p->dim() == 1 && p->size(0) == d &&
                  p->is_contiguous(),
              "lmlab.norm_bf16: ", name, " must be float32 (", d, ",) contiguous");
}

// A backward that records its graph (create_graph): the gradients of y (the operator's ATen
// formula, recomputed with a graph) for g, with respect to those of `ins` that require grad,
// at their positions in a list of `n` outputs (undefined for the others; zeros where y does not
// depend on one).
variable_list graph_grads(const at::Tensor& y, const at::Tensor& g,
                          std::initializer_list<const at::Tensor*> ins, size_t n) {
  variable_list wanted;
  std::vector<size_t> index;
  size_t i = 0;
  for (const at::Tensor* in : ins) {
    if (in->defined() && in->requires_grad()) {
      wanted.push_back(*in);
      index.push_back(i);
    }
    ++i;
  }
  variable_list out(n);
  if (!wanted.empty()) {
    const variable_list got = torch::autograd::grad({y}, wanted, {g.to(y.scalar_type())},
                                                    /*retain_graph=*/true,
                                                    /*create_graph=*/true,
                                                    /*allow_unused=*/true);
    for (size_t j = 0; j < index.size(); ++j)
      out[index[j]] = got[j].defined() ? got[j] : at::zeros_like(wanted[j]);
  }
  return out;
}

// ---- norm_bf16 ------------------------------------------------------------------------------

struct NormBf16 : public torch::autograd::Function<NormBf16> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, double eps, bool rms) {
    const at::Tensor xc = x.contiguous();
    const int64_t d = x.size(-1), rows = x.numel() / d;
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
    at::Tensor stats = at::empty({2, rows}, x.options().dtype(at::kFloat));  // mean, rstd
    float* st = stats.data_ptr<float>();
    const bool has_bias = bias.has_value() && bias->defined();
    lmlab_norm_bf16_forward(rms ? 1 : 0, xc.data_ptr<float>(), weight.data_ptr<float>(),
                            has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr(), st,
                            st + rows, rows, d, static_cast<float>(eps));
    ctx->save_for_backward({x, weight, has_bias ? *bias : at::Tensor(), stats});
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &stats = saved[3];
    const bool rms = ctx->saved_data["rms"].toBool();
    const at::Tensor& g = grads[0];
    const bool graph = at::GradMode::is_enabled() &&
                       (g.requires_grad() || x.requires_grad() || weight.requires_grad() ||
                        (bias.defined() && bias.requires_grad()));
    if (graph) {  // create_graph: the norm's ATen ops, differentiated (gradients with a graph)
      const double eps = ctx->saved_data["eps"].toDouble();
      const int64_t d = x.size(-1);
      const at::Tensor y = rms ? x * at::rsqrt(x.pow(2).mean(-1, true) + eps) * weight
                               : at::layer_norm(x, {d}, weight, bias, eps);
      return graph_grads(y, g, {&x, &weight, &bias}, 5);
    }
    const at::Tensor gb = g.to(at::kBFloat16).contiguous();
    const at::Tensor xc = x.contiguous();
    const int64_t d = x.size(-1), rows = x.numel() / d;
    at::Tensor dx = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    at::Tensor dw = at::empty({d}, x.options().dtype(at::kFloat));
    at::Tensor db = bias.defined() ? at::empty({d}, x.options().dtype(at::kFloat)) : at::Tensor();
    const float* st = stats.data_ptr<float>();
    lmlab_norm_bf16_backward(rms ? 1 : 0, gb.data_ptr(), xc.data_ptr<float>(),
                             weight.data_ptr<float>(), st, st + rows, dx.data_ptr<float>(),
                             dw.data_ptr<float>(), bias.defined() ? db.data_ptr<float>() : nullptr,
                             rows, d);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

at::Tensor norm_bf16(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, double eps, bool rms) {
  check_cpu(x, "norm_bf16", "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) >= 1,
              "lmlab.norm_bf16: x must be float32 (..., D >= 1)");
  check_param(weight, x.size(-1), "weight");
  check_param(bias, x.size(-1), "bias");
  TORCH_CHECK(!(rms && bias.has_value() && bias->defined()), "lmlab.norm_bf16: RMSNorm has no bias");
  return NormBf16::apply(x, weight, bias, eps, rms);
}

// ---- causal_attention_bmm -------------------------------------------------------------------

at::Tensor causal_above(int64_t t, const at::Device& device) {
  return at::ones({t, t}, at::TensorOptions().dtype(at::kBool).device(device)).triu(1);
}

constexpr const char* kNoDoubleBackward =
    "lmlab's batched-matmul causal attention (bf16 CPU training, the sdpa backend) has no "
    "second-order gradients (create_graph=True, e.g. a gradient penalty); use "
    "model.attention.backend: math for them (torch's fused CPU attention has none either)";

struct CausalAttentionBmm : public torch::autograd::Function<CausalAttentionBmm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, bool kernel) {
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), hd = q.size(3), hdv = v.size(3);
    at::Tensor qs = at::empty({b, h, t, hd}, q.options());
    at::mul_out(qs, q, scale);  // scaled, contiguous: one pass
    qs = qs.view({b * h, t, hd});
    const at::Tensor k3 = k.reshape({b * h, t, hd});
    const at::Tensor v3 = v.reshape({b * h, t, hdv});
    at::Tensor scores = at::bmm(qs, k3.transpose(1, 2));  // (B H, T, T)
    at::Tensor probs;
    if (kernel) {
      lmlab_causal_softmax_forward(softmax_dtype(scores), scores.data_ptr(), scores.data_ptr(),
                                   b * h, t);
      probs = scores;  // in place: P over the scores
    } else {
      scores.masked_fill_(causal_above(t, q.device()), -std::numeric_limits<double>::infinity());
      probs = at::softmax(scores, -1);
    }
    ctx->save_for_backward({qs, k3, v3, probs});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["shape"] = std::vector<int64_t>{b, h, t, hd, hdv};
    return at::bmm(probs, v3).view({b, h, t, hdv});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // its saved tensors were made without a graph back to q, k and v: a backward that records
    // its own (create_graph) would give second-order gradients without those terms, silently
    TORCH_CHECK(!at::GradMode::is_enabled(), kNoDoubleBackward);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &qs = saved[0], &k3 = saved[1], &v3 = saved[2], &probs = saved[3];
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t b = shape[0], h = shape[1], t = shape[2], hd = shape[3], hdv = shape[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor g = grads[0].reshape({b * h, t, hdv});
    const at::Tensor dv = at::bmm(probs.transpose(1, 2), g);
    at::Tensor dp = at::bmm(g, v3.transpose(1, 2));
    at::Tensor ds;
    // (no create_graph reaches here: the check above; dP records no gradients)
    if (ctx->saved_data["kernel"].toBool() && dp.is_contiguous() &&
        dp.scalar_type() == probs.scalar_type()) {
      lmlab_causal_softmax_backward(softmax_dtype(probs), probs.data_ptr(), dp.data_ptr(),
                                    dp.data_ptr(), b * h, t);
      ds = dp;  // in place: dS over dP
    } else {
      ds = at::_softmax_backward_data(dp, probs, -1, probs.scalar_type());
    }
    const at::Tensor dq = at::bmm(ds, k3).mul_(scale);
    const at::Tensor dk = at::bmm(ds.transpose(1, 2), qs);
    return {dq.view({b, h, t, hd}), dk.view({b, h, t, hd}), dv.view({b, h, t, hdv}), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor causal_attention_bmm(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool kernel) {
  for (const auto* t : {&q, &k, &v}) check_cpu(*t, "causal_attention_bmm", "q, k and v");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 &&
                  v.sizes().slice(0, 3) == q.sizes().slice(0, 3) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "lmlab.causal_attention_bmm: q and k (B, H, T, hd), v (B, H, T, hdv), one dtype");
  const bool readable = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16;
  return CausalAttentionBmm::apply(q, k, v, scale, kernel && readable);
}

// ---- causal_attention_bf16 ------------------------------------------------------------------

// t as the kernel reads it: its values in memory (a negated view's sign applied), rows of hd
// contiguous elements, every stride even and the data 4-byte aligned (pairs of bf16 are read as
// 32-bit words); otherwise a contiguous copy.
at::Tensor pair_readable(const at::Tensor& t_in) {
  const at::Tensor t = t_in.resolve_neg();  // the kernel reads memory: a neg bit would be lost
  const bool ok = t.stride(3) == 1 && t.stride(0) % 2 == 0 && t.stride(1) % 2 == 0 &&
                  t.stride(2) % 2 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  return ok ? t : t.contiguous();
}

constexpr const char* kFusedNoDoubleBackward =
    "lmlab.causal_attention_bf16: no second-order gradients (create_graph=True, e.g. a gradient "
    "penalty): its saved tensors carry no graph back to q, k and v; use model.attention.backend: "
    "math for them";

struct CausalAttentionBf16 : public torch::autograd::Function<CausalAttentionBf16> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, double scale) {
    const at::Tensor q = pair_readable(q_in), k = pair_readable(k_in), v = pair_readable(v_in);
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), hd = q.size(3), hdv = v.size(3);
    const int64_t kv = k.size(1), tr = (t + 1) / 2, tc = (t + 15) / 16 * 16;
    // written token-major (B, T, H, hdv) and returned as its (B, H, T, hdv) view: the heads'
    // concatenation (B, T, H hdv) before the output projection is then a view, not a copy
    at::Tensor out = at::empty({b, t, h, hdv}, q.options());
    at::Tensor probs = at::empty({b * h, tr, tc}, q.options().dtype(at::kInt));  // P, row pairs
    const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)};
    const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
    const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
    lmlab_causal_attention_bf16_forward(q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs,
                                        out.data_ptr(), probs.data_ptr(), b, h, kv, t, hd, hdv,
                                        static_cast<float>(scale));
    ctx->save_for_backward({q, k, v, probs});
    ctx->saved_data["scale"] = scale;
    return out.permute({0, 2, 1, 3});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kFusedNoDoubleBackward);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &probs = saved[3];
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), hd = q.size(3), hdv = v.size(3);
    const int64_t kv = k.size(1);
    const auto opts = q.options();
    if (grads[0]._is_zerotensor())  // a gradient known to be 0 (it has no data to read)
      return {at::zeros({b, h, t, hd}, opts), at::zeros({b, kv, t, hd}, opts),
              at::zeros({b, kv, t, hdv}, opts), at::Tensor()};
    check_cpu(grads[0], "causal_attention_bf16", "the output's gradient");
    const at::Tensor g = pair_readable(grads[0].to(at::kBFloat16));
    at::Tensor dq = at::empty({b, h, t, hd}, opts), dk = at::empty({b, kv, t, hd}, opts);
    at::Tensor dv = at::empty({b, kv, t, hdv}, opts);
    const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)};
    const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
    const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
    const int64_t gs[3] = {g.stride(0), g.stride(1), g.stride(2)};
    const int64_t dqs[3] = {h * t * hd, t * hd, hd}, dks[3] = {kv * t * hd, t * hd, hd};
    const int64_t dvs[3] = {kv * t * hdv, t * hdv, hdv};
    lmlab_causal_attention_bf16_backward(
        q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, g.data_ptr(), gs, probs.data_ptr(),
        dq.data_ptr(), dqs, dk.data_ptr(), dks, dv.data_ptr(), dvs, b, h, kv, t, hd, hdv,
        static_cast<float>(ctx->saved_data["scale"].toDouble()), nullptr, nullptr);
    return {dq, dk, dv, at::Tensor()};
  }
};

at::Tensor causal_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale) {
  for (const auto* t : {&q, &k, &v}) check_cpu(*t, "causal_attention_bf16", "q, k and v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(3) == q.size(3) &&
                  v.sizes().slice(0, 3) == k.sizes().slice(0, 3) && k.size(1) >= 1 &&
                  q.size(1) >= 1 && q.size(1) % k.size(1) == 0 && q.scalar_type() == at::kBFloat16 &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "lmlab.causal_attention_bf16: q (B, H, T, hd), k (B, K, T, hd) and v (B, K, T, hdv) "
              "bfloat16, K dividing H");
  TORCH_CHECK(q.size(2) >= 1 && q.size(3) >= 16 && q.size(3) % 16 == 0 && v.size(3) >= 16 &&
                  v.size(3) % 16 == 0,
              "lmlab.causal_attention_bf16: T >= 1 and head dims that are multiples of 16");
  TORCH_CHECK(lmlab_causal_attention_bf16_available() == 1,
              "lmlab.causal_attention_bf16: not built here (it needs a CPU with AVX512-BF16)");
  return CausalAttentionBf16::apply(q, k, v, scale);
}

// ---- rope_causal_attention_bf16 -------------------------------------------------------------

// A (B, T, H + 2 K, hd) bf16 tensor (the rotated q/k/v projection, or its gradient) as the
// kernel's q, k and v: its head ranges, element strides {B, heads, T} = {T W, hd, W}, W = (H +
// 2 K) hd.
struct QkvViews {
  const uint16_t* base;
  int64_t st[3];
  const void* q() const { return base; }
  const void* k(int64_t h) const { return base + h * st[1]; }
  const void* v(int64_t h, int64_t kv) const { return base + (h + kv) * st[1]; }
  QkvViews(const void* p, int64_t t, int64_t heads, int64_t hd)
      : base(static_cast<const uint16_t*>(p)), st{t * heads * hd, hd, heads * hd} {}
};

constexpr const char* kRopeNoDoubleBackward =
    "lmlab.rope_causal_attention_bf16: no second-order gradients (create_graph=True, e.g. a "
    "gradient penalty): its saved tensors carry no graph back to qkv; use "
    "model.attention.backend: math for them";

struct RopeCausalAttentionBf16 : public torch::autograd::Function<RopeCausalAttentionBf16> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qkv_in,
                            const at::Tensor& cos_in, const at::Tensor& sgn_in, int64_t h,
                            int64_t kv, double scale) {
    const at::Tensor qkv = qkv_in.resolve_neg().contiguous();  // read row by row, not kept
    const at::Tensor cos = cos_in.resolve_neg().contiguous();
    const at::Tensor sgn = sgn_in.resolve_neg().contiguous();
    const int64_t b = qkv.size(0), t = qkv.size(1), heads = qkv.size(2), hd = qkv.size(3);
    const int64_t tr = (t + 1) / 2, tc = (t + 15) / 16 * 16;
    at::Tensor out = at::empty({b, t, h, hd}, qkv.options());  // token-major, as above
    at::Tensor probs = at::empty({b * h, tr, tc}, qkv.options().dtype(at::kInt));
    // q and k rotated, v copied: what the attention and its backward read (the split's q, k
    // and v in one tensor; qkv itself is not kept)
    at::Tensor rotated = at::empty({b, t, heads, hd}, qkv.options());
    lmlab_rope_qkv_bf16(qkv.data_ptr(), b * t, t, heads, h + kv, hd, cos.data_ptr(),
                        sgn.data_ptr(), rotated.data_ptr());
    const QkvViews r(rotated.data_ptr(), t, heads, hd);
    lmlab_causal_attention_bf16_forward(r.q(), r.st, r.k(h), r.st, r.v(h, kv), r.st,
                                        out.data_ptr(), probs.data_ptr(), b, h, kv, t, hd, hd,
                                        static_cast<float>(scale));
    ctx->save_for_backward({rotated, cos, sgn, probs});
    ctx->saved_data["h"] = h;
    ctx->saved_data["kv"] = kv;
    ctx->saved_data["scale"] = scale;
    return out.permute({0, 2, 1, 3});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kRopeNoDoubleBackward);
    const auto saved = ctx->get_saved_variables();
    // the forward's rotated q and k and its copy of v, (B, T, h + 2 kv, hd)
    const at::Tensor &rotated = saved[0], &cos = saved[1], &sgn = saved[2], &probs = saved[3];
    const int64_t h = ctx->saved_data["h"].toInt(), kv = ctx->saved_data["kv"].toInt();
    const int64_t b = rotated.size(0), t = rotated.size(1), heads = rotated.size(2);
    const int64_t hd = rotated.size(3);
    variable_list result(6);  // dqkv; the tables, h, kv and scale have none
    if (grads[0]._is_zerotensor()) {  // a gradient known to be 0 (it has no data to read)
      result[0] = at::zeros_like(rotated);
      return result;
    }
    check_cpu(grads[0], "rope_causal_attention_bf16", "the output's gradient");
    const at::Tensor g = pair_readable(grads[0].to(at::kBFloat16));
    at::Tensor dqkv = at::empty({b, t, heads, hd}, rotated.options());
    const QkvViews x(rotated.data_ptr(), t, heads, hd);
    const QkvViews dx(dqkv.data_ptr(), t, heads, hd);  // its strides; written through d
    auto* d = static_cast<uint16_t*>(dqkv.data_ptr());
    const int64_t gs[3] = {g.stride(0), g.stride(1), g.stride(2)};
    lmlab_causal_attention_bf16_backward(
        x.q(), x.st, x.k(h), x.st, x.v(h, kv), x.st, g.data_ptr(), gs, probs.data_ptr(), d,
        dx.st, d + h * hd, dx.st, d + (h + kv) * hd, dx.st, b, h, kv, t, hd, hd,
        static_cast<float>(ctx->saved_data["scale"].toDouble()), cos.data_ptr(), sgn.data_ptr());
    result[0] = dqkv;
    return result;
  }
};

at::Tensor rope_causal_attention_bf16(const at::Tensor& qkv, const at::Tensor& cos,
                                      const at::Tensor& sgn, int64_t h, int64_t kv, double scale) {
  check_cpu(qkv, "rope_causal_attention_bf16", "qkv");
  TORCH_CHECK(qkv.dim() == 4 && qkv.scalar_type() == at::kBFloat16 && h >= 1 && kv >= 1 &&
                  h % kv == 0 && qkv.size(2) == h + 2 * kv && qkv.size(1) >= 1,
              "lmlab.rope_causal_attention_bf16: qkv must be bfloat16 (B, T, h + 2 kv, hd), T >= "
              "1, kv dividing h");
  const int64_t t = qkv.size(1), hd = qkv.size(3);
  TORCH_CHECK(hd >= 32 && hd % 32 == 0,
              "lmlab.rope_causal_attention_bf16: head_dim must be a multiple of 32, not ", hd);
  for (const auto* table : {&cos, &sgn}) {
    check_cpu(*table, "rope_causal_attention_bf16", "cos and signed");
    TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->dim() == 2 &&
                    table->size(0) == t && table->size(1) == hd,
                "lmlab.rope_causal_attention_bf16: cos and signed must be (T, hd) bfloat16");
  }
  TORCH_CHECK(!at::GradMode::is_enabled() || !(cos.requires_grad() || sgn.requires_grad()),
              "lmlab.rope_causal_attention_bf16: cos and signed must not require grad (their "
              "gradient is not computed)");
  TORCH_CHECK(lmlab_causal_attention_bf16_available() == 1,
              "lmlab.rope_causal_attention_bf16: not built here (it needs a CPU with AVX512-BF16)");
  return RopeCausalAttentionBf16::apply(qkv, cos, sgn, h, kv, scale);
}

// ---- add_f32_bf16 ---------------------------------------------------------------------------

struct AddF32Bf16 : public torch::autograd::Function<AddF32Bf16> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& y,
                            const std::optional<at::Tensor>& bias) {
    at::Tensor out = at::empty(x.sizes(), x.options());
    const bool has_bias = bias.has_value() && bias->defined();
    if (has_bias) {
      const at::Tensor bc = bias->resolve_neg().contiguous();
      const int64_t n = x.size(-1);
      lmlab_add_bias_f32_bf16(x.data_ptr<float>(), y.data_ptr(), bc.data_ptr<float>(),
                              out.data_ptr<float>(), x.numel() / n, n);
    } else {
      lmlab_add_f32_bf16(x.data_ptr<float>(), y.data_ptr(), out.data_ptr<float>(), x.numel());
    }
    ctx->saved_data["bias"] = has_bias;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // add's gradient: g to both; the branch's cast to its dtype (autograd casts it so after
    // torch's AddBackward); with create_graph these are recorded as the ATen ops they are
    const at::Tensor& g = grads[0];
    // no bias, or a frozen one: add's gradients alone
    if (!ctx->saved_data["bias"].toBool() || !ctx->needs_input_grad(2)) {
      return {g, g.to(at::kBFloat16), at::Tensor()};
    }
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const int64_t n = g.size(-1), m = g.numel() / n;
    if (g._is_zerotensor() || (at::GradMode::is_enabled() && g.requires_grad()) ||
        g.scalar_type() != at::kFloat || m == 0) {
      // create_graph (or a gradient the kernel does not read): the same values as ATen ops
      return {g, g.to(at::kBFloat16), g.reshape({m, n}).sum(0).to(at::kFloat)};
    }
    const at::Tensor gc = g.resolve_neg().contiguous();
    at::Tensor dy = at::empty(g.sizes(), g.options().dtype(at::kBFloat16));
    at::Tensor db = at::empty({n}, g.options());
    at::Tensor partial = at::empty({lmlab_sum_blocks(m), n}, g.options());
    lmlab_add_bias_backward(gc.data_ptr<float>(), dy.data_ptr(), partial.data_ptr<float>(),
                            db.data_ptr<float>(), m, n);
    return {g, dy, db};
  }
};

at::Tensor add_f32_bf16(const at::Tensor& x, const at::Tensor& y,
                        const std::optional<at::Tensor>& bias) {
  check_cpu(x, "add_f32_bf16", "x");
  check_cpu(y, "add_f32_bf16", "y");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kBFloat16 &&
                  x.sizes() == y.sizes() && x.is_contiguous() && y.is_contiguous(),
              "lmlab.add_f32_bf16: x float32 and y bfloat16 of one shape, both contiguous");
  if (bias.has_value() && bias->defined()) {
    check_cpu(*bias, "add_f32_bf16", "bias");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1 && bias->scalar_type() == at::kFloat &&
                    bias->dim() == 1 && bias->size(0) == x.size(-1),
                "lmlab.add_f32_bf16: bias must be float32 (N,) for x and y (..., N >= 1)");
  }
  return AddF32Bf16::apply(x, y, bias);
}

// ---- gelu_bf16 ------------------------------------------------------------------------------

// The ATen formula gelu_bf16 computes (float32 z = u + bias, torch's exact GELU, rounded to
// bfloat16): what a backward that records its graph differentiates.
at::Tensor gelu_bf16_aten(const at::Tensor& u, const at::Tensor& bias, bool tanh) {
  const at::Tensor z = bias.defined() ? u.to(at::kFloat) + bias : u.to(at::kFloat);
  return at::gelu(z, tanh ? "tanh" : "none").to(at::kBFloat16);
}

struct GeluBf16 : public torch::autograd::Function<GeluBf16> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& u,
                            const std::optional<at::Tensor>& bias, bool tanh) {
    // the kernels read raw storage: a negated view (torch._neg_view) is resolved to its values
    const at::Tensor uc = u.resolve_neg().contiguous();
    const bool has_bias = bias.has_value() && bias->defined();
    const at::Tensor bc = has_bias ? bias->resolve_neg().contiguous() : at::Tensor();
    const int64_t n = u.size(-1), m = u.numel() / n;
    at::Tensor a = at::empty(u.sizes(), u.options().memory_format(at::MemoryFormat::Contiguous));
    lmlab_gelu_bf16_forward(tanh ? 1 : 0, uc.data_ptr(), has_bias ? bc.data_ptr<float>() : nullptr,
                            a.data_ptr(), m, n);
    ctx->save_for_backward({u, has_bias ? *bias : at::Tensor()});  // as given: create_graph
    ctx->saved_data["tanh"] = tanh;
    return a;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &u = saved[0], &bias = saved[1];
    const at::Tensor& g = grads[0];
    const bool tanh = ctx->saved_data["tanh"].toBool();
    if (!g.defined() || g._is_zerotensor()) {  // no gradient, or one known to be 0: zeros
      return {at::zeros_like(u), bias.defined() ? at::zeros_like(bias) : at::Tensor(), at::Tensor()};
    }
    const bool graph = at::GradMode::is_enabled() &&
                       (g.requires_grad() || u.requires_grad() ||
                        (bias.defined() && bias.requires_grad()));
    if (graph) {  // create_graph: the ATen formula, differentiated (gradients with a graph)
      return graph_grads(gelu_bf16_aten(u, bias, tanh), g, {&u, &bias}, 3);
    }
    const at::Tensor gb = g.to(at::kBFloat16).resolve_neg().contiguous();
    const at::Tensor uc = u.resolve_neg().contiguous();
    const at::Tensor bc = bias.defined() ? bias.resolve_neg().contiguous() : at::Tensor();
    const int64_t n = u.size(-1), m = u.numel() / n;
    at::Tensor du = at::empty(u.sizes(), uc.options());
    at::Tensor db, partial;
    if (bias.defined()) {
      db = at::empty({n}, bias.options());
      partial = at::empty({lmlab_gelu_bf16_blocks(m), n}, bias.options());
    }
    lmlab_gelu_bf16_backward(tanh ? 1 : 0, gb.data_ptr(), uc.data_ptr(),
                             bias.defined() ? bc.data_ptr<float>() : nullptr, du.data_ptr(),
                             bias.defined() ? partial.data_ptr<float>() : nullptr,
                             bias.defined() ? db.data_ptr<float>() : nullptr, m, n);
    return {du, db, at::Tensor()};
  }
};

at::Tensor gelu_bf16(const at::Tensor& u, const std::optional<at::Tensor>& bias, bool tanh) {
  check_cpu(u, "gelu_bf16", "u");
  TORCH_CHECK(u.scalar_type() == at::kBFloat16 && u.dim() >= 1 && u.size(-1) >= 1,
              "lmlab.gelu_bf16: u must be bfloat16 (..., N >= 1)");
  if (bias.has_value() && bias->defined()) {
    check_cpu(*bias, "gelu_bf16", "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == u.size(-1),
                "lmlab.gelu_bf16: bias must be float32 (", u.size(-1), ",)");
  }
  return GeluBf16::apply(u, bias, tanh);
}

// ---- silu_mul_bf16 ---------------------------------------------------------------------------

// The ATen formula silu_mul_bf16 computes (float32 silu(gate) up, rounded to bfloat16): what a
// backward that records its graph differentiates.
at::Tensor silu_mul_bf16_aten(const at::Tensor& gate, const at::Tensor& up) {
  return (at::silu(gate.to(at::kFloat)) * up.to(at::kFloat)).to(at::kBFloat16);
}

struct SiluMulBf16 : public torch::autograd::Function<SiluMulBf16> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    // the kernels read raw storage: a negated view (torch._neg_view) is resolved to its values
    const at::Tensor gc = gate.resolve_neg().contiguous(), uc = up.resolve_neg().contiguous();
    at::Tensor h = at::empty(gate.sizes(), gc.options());
    lmlab_silu_mul_bf16_forward(gc.data_ptr(), uc.data_ptr(), h.data_ptr(), gate.numel());
    ctx->save_for_backward({gate, up});  // as given: create_graph differentiates them
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const at::Tensor& g = grads[0];
    if (!g.defined() || g._is_zerotensor()) return {at::zeros_like(gate), at::zeros_like(up)};
    const bool graph = at::GradMode::is_enabled() &&
                       (g.requires_grad() || gate.requires_grad() || up.requires_grad());
    if (graph) {  // create_graph: the ATen formula, differentiated (gradients with a graph)
      return graph_grads(silu_mul_bf16_aten(gate, up), g, {&gate, &up}, 2);
    }
    const at::Tensor gb = g.to(at::kBFloat16).resolve_neg().contiguous();
    const at::Tensor gc = gate.resolve_neg().contiguous(), uc = up.resolve_neg().contiguous();
    at::Tensor dgate = at::empty(gate.sizes(), gc.options());
    at::Tensor dup = at::empty(up.sizes(), uc.options());
    lmlab_silu_mul_bf16_backward(gb.data_ptr(), gc.data_ptr(), uc.data_ptr(), dgate.data_ptr(),
                                 dup.data_ptr(), gate.numel());
    return {dgate, dup};
  }
};

at::Tensor silu_mul_bf16(const at::Tensor& gate, const at::Tensor& up) {
  check_cpu(gate, "silu_mul_bf16", "gate");
  check_cpu(up, "silu_mul_bf16", "up");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 &&
                  gate.sizes() == up.sizes(),
              "lmlab.silu_mul_bf16: gate and up must be bfloat16 of one shape");
  return SiluMulBf16::apply(gate, up);
}

// Whether t is a dense float32 CPU tensor whose contiguous elements the kernel may read or write
// through its data pointer (no negated view, storage allocated, not a tensor subclass with its
// own dispatch: a __torch_dispatch__ wrapper, a FakeTensor, whose storage is not its values).
bool plain_f32(const at::Tensor& t) {
  return t.defined() && !t.is_nested() && t.device().is_cpu() && t.layout() == at::kStrided &&
         t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_neg() &&
         !t.key_set().has(c10::DispatchKey::Python) && has_data(t);
}

// The byte spans [start, end) of the tensors a kernel call reads and writes: disjoint() is
// false when any two share memory (a tensor listed twice, or two views of one storage, would
// be read after it was written, or counted twice).
class Spans {
 public:
  explicit Spans(size_t n) { spans_.reserve(n); }
  void add(const at::Tensor& t) {
    if (t.numel() == 0) return;
    const auto a = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans_.emplace_back(a, a + static_cast<uintptr_t>(t.numel()) * t.element_size());
  }
  bool disjoint() {
    std::sort(spans_.begin(), spans_.end());
    for (size_t i = 1; i < spans_.size(); ++i)
      if (spans_[i].first < spans_[i - 1].second) return false;
    return true;
  }

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> spans_;
};

// Whether an optimizer-side kernel (no autograd) may read t: plain_f32, and not recording
// gradients while grad mode is on (an optimizer's work runs under no_grad).
bool readable_f32(const at::Tensor& t, bool grad_mode) {
  return plain_f32(t) && !(grad_mode && t.requires_grad());
}

// ... and write it in place: also not an inference tensor (its writes could not be counted in
// a version).
bool writable_f32(const at::Tensor& t, bool grad_mode) {
  return readable_f32(t, grad_mode) && !t.is_inference();
}

// One AdamW step over the listed tensors (lmlab_adamw_step, train_kernels.cpp), or false
// with nothing written when the kernel cannot take them: not all plain contiguous float32 CPU
// tensors, a step count that is not one float32, a gradient or state of another size than its
// parameter, any two of them sharing memory, or a tensor that records gradients while grad
// mode is on (an optimizer steps under no_grad).
bool adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList steps, at::ArrayRef<double> lr,
                 at::ArrayRef<double> beta1, at::ArrayRef<double> beta2,
                 at::ArrayRef<double> weight_decay, at::ArrayRef<double> eps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  steps.size() == n && lr.size() == n && beta1.size() == n && beta2.size() == n &&
                  weight_decay.size() == n && eps.size() == n,
              "lmlab.adamw_step_: every list must hold one entry per parameter");
  const bool grad_mode = at::GradMode::is_enabled();
  Spans spans(5 * n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor* ts[5] = {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i], &steps[i]};
    for (const at::Tensor* t : ts) {
      // the gradient is only read (an inference tensor may be); the others are written
      if (!(t == &grads[i] ? readable_f32(*t, grad_mode) : writable_f32(*t, grad_mode)))
        return false;
      spans.add(*t);
    }
    const int64_t numel = params[i].numel();
    if (grads[i].sizes() != params[i].sizes() || exp_avgs[i].numel() != numel ||
        exp_avg_sqs[i].numel() != numel || steps[i].numel() != 1)
      return false;
  }
  if (!spans.disjoint()) return false;
  std::vector<float*> p(n), m(n), v(n), s(n);
  std::vector<const float*> g(n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = params[i].data_ptr<float>();
    g[i] = grads[i].data_ptr<float>();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
    s[i] = steps[i].data_ptr<float>();
    numels[i] = params[i].numel();
  }
  lmlab_adamw_step(static_cast<int64_t>(n), p.data(), g.data(), m.data(), v.data(), s.data(),
                   numels.data(), lr.data(), beta1.data(), beta2.data(), weight_decay.data(),
                   eps.data());
  // every tensor written counted in its version, as torch's in-place step counts it (a graph
  // that saved a parameter then refuses a backward through its old value)
  for (size_t i = 0; i < n; ++i)
    for (const at::Tensor* t : {&params[i], &exp_avgs[i], &exp_avg_sqs[i], &steps[i]})
      torch::autograd::impl::bump_version(*t);
  return true;
}

// Gradient clipping by the global L2 norm of the listed gradients in place (lmlab_grad_clip,
// train_kernels.cpp): (true, the norm, the coefficient applied: 1 for none), each tensor it
// scaled counted as written in its version, as torch's mul_ counts it. (false, 0, 1) with
// nothing read or written where the kernel cannot take them: a tensor that is not writable_f32,
// or two sharing memory (counted, and scaled, twice). One call from Python instead of a Python
// pass over the tensors (lmlab.training.guard.clip_gradients).
std::tuple<bool, double, double> clip_grads_(at::TensorList grads, double max_norm) {
  const size_t n = grads.size();
  const bool grad_mode = at::GradMode::is_enabled();
  Spans spans(n);
  for (const at::Tensor& t : grads) {
    if (!writable_f32(t, grad_mode)) return {false, 0.0, 1.0};
    spans.add(t);
  }
  if (!spans.disjoint()) return {false, 0.0, 1.0};
  std::vector<float*> p(n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = grads[i].data_ptr<float>();
    numels[i] = grads[i].numel();
  }
  double norm = 0.0;
  float coef = 1.0f;
  lmlab_grad_clip(static_cast<int64_t>(n), p.data(), numels.data(), max_norm, &norm, &coef);
  if (coef != 1.0f)
    for (const at::Tensor& t : grads) torch::autograd::impl::bump_version(t);
  return {true, norm, static_cast<double>(coef)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmlab, m) {
  m.def("norm_bf16(Tensor x, Tensor weight, Tensor? bias, float eps, bool rms) -> Tensor");
  m.def("causal_attention_bmm(Tensor q, Tensor k, Tensor v, float scale, bool kernel) -> Tensor");
  m.def("add_f32_bf16(Tensor x, Tensor y, Tensor? bias=None) -> Tensor");
  m.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def(
      "rope_causal_attention_bf16(Tensor qkv, Tensor cos, Tensor signed, int h, int kv, "
      "float scale) -> Tensor");
  m.def("gelu_bf16(Tensor u, Tensor? bias, bool tanh=False) -> Tensor");
  m.def("silu_mul_bf16(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] steps, float[] lr, float[] beta1, float[] beta2, "
      "float[] weight_decay, float[] eps) -> bool");
  m.def("clip_grads_(Tensor(a!)[] grads, float max_norm) -> (bool, float, float)");
}

TORCH_LIBRARY_IMPL(lmlab, CompositeImplicitAutograd, m) {
  m.impl("norm_bf16", norm_bf16);
  m.impl("causal_attention_bmm", causal_attention_bmm);
  m.impl("add_f32_bf16", add_f32_bf16);
  m.impl("causal_attention_bf16", causal_attention_bf16);
  m.impl("rope_causal_attention_bf16", rope_causal_attention_bf16);
  m.impl("gelu_bf16", gelu_bf16);
  m.impl("silu_mul_bf16", silu_mul_bf16);
  m.impl("adamw_step_", adamw_step_);
  m.impl("clip_grads_", clip_grads_);
}
