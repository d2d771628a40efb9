// The RoPE split kernel (rope_kernels.cpp, compiled into the same library) as a torch operator
// with its autograd in C++: torch.ops.lmlab.rope_split(qkv, cos, signed, h, kv, bias) -> (q, k,
// v), what the Python autograd.Function it replaced (rope_kernel.RopeSplitFunction, until the
// fifth session) computed (the same kernel calls, the same bits), entered through the
// dispatcher instead (20-50 us of Python a call each way, comparable to the kernel itself at
// small shapes). A backward that
// records its own graph (create_graph) runs the rotation's gradient as ATen ops, as the Python
// Function does.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

extern "C" int lmlab_rope_split(int dtype, const void* qkv, const void* bias, int bias_dtype,
                                int64_t nb, int64_t nt, int64_t h, int64_t kv, int64_t hd,
                                const void* cos, const void* sgn, void* q, void* k, void* v);
extern "C" int lmlab_rope_split_backward(int dtype, const void* dq, const void* dk, const void* dv,
                                         int64_t nb, int64_t nt, int64_t h, int64_t kv,
                                         int64_t hd, const void* cos, const void* sgn, void* dqkv,
                                         float* dbias);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int dtype_code(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 1 : 0; }

// g * cos + roll(g * signed, -hd / 2): the rotation's gradient as differentiable ATen ops
at::Tensor inverse_ops(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sgn) {
  return g * cos + at::roll(g * sgn, {-(g.size(-1) / 2)}, {-1});
}

struct RopeSplit : public torch::autograd::Function<RopeSplit> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                               const at::Tensor& sgn, int64_t h, int64_t kv,
                               const std::optional<at::Tensor>& bias) {
    const at::Tensor x = qkv.contiguous();
    const int64_t b = x.size(0), t = x.size(1), hd = x.size(3);
    const at::Tensor c = cos.contiguous(), s = sgn.contiguous();
    at::Tensor q = at::empty({b, h, t, hd}, x.options());
    at::Tensor k = at::empty({b, kv, t, hd}, x.options());
    at::Tensor v = at::empty({b, kv, t, hd}, x.options());
    const bool has_bias = bias.has_value() && bias->defined();
    const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
    const int rc = lmlab_rope_split(dtype_code(x), x.data_ptr(),
                                    has_bias ? bc.data_ptr() : nullptr,
                                    has_bias && bc.scalar_type() != at::kFloat ? 1 : 0, b, t, h,
                                    kv, hd, c.data_ptr(), s.data_ptr(), q.data_ptr(), k.data_ptr(),
                                    v.data_ptr());
    TORCH_CHECK(rc == 0, "lmlab.rope_split: the RoPE kernel refused head_dim ", hd,
                " (even, at most 1024) or its dtypes");
    ctx->save_for_backward({c, s});
    ctx->saved_data["h"] = h;
    ctx->saved_data["kv"] = kv;
    ctx->saved_data["bias"] = has_bias && bias->requires_grad();  // its gradient wanted
    ctx->saved_data["bias_float"] = has_bias && bc.scalar_type() == at::kFloat;
    return {q, k, v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &cos = saved[0], &sgn = saved[1];
    const int64_t h = ctx->saved_data["h"].toInt(), kv = ctx->saved_data["kv"].toInt();
    const bool want_bias = ctx->saved_data["bias"].toBool();
    const auto bias_type = ctx->saved_data["bias_float"].toBool() ? at::kFloat : at::kBFloat16;
    const at::Tensor* ref = nullptr;
    for (const auto& g : grads)
      if (g.defined()) {
        ref = &g;
        break;
      }
    const int64_t b = ref->size(0), t = ref->size(2), hd = ref->size(3);
    bool graph = false;
    for (const auto& g : grads) graph = graph || (g.defined() && g.requires_grad());
    if (at::GradMode::is_enabled() && graph) {  // create_graph: ATen ops autograd records
      const int64_t heads[3] = {h, kv, kv};
      std::vector<at::Tensor> parts;
      for (int i = 0; i < 3; ++i) {
        const at::Tensor& g = grads[i];
        if (!g.defined()) parts.push_back(at::zeros({b, heads[i], t, hd}, ref->options()));
        else parts.push_back(i < 2 ? inverse_ops(g, cos, sgn) : g);
      }
      const at::Tensor dqkv = at::cat(parts, 1).transpose(1, 2);  // (B, T, H + 2 K, hd)
      at::Tensor db;
      if (want_bias) db = dqkv.to(at::kFloat).sum({0, 1}).reshape({-1}).to(bias_type);
      return {dqkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), db};
    }
    std::vector<at::Tensor> gs;
    for (const auto& g : grads) gs.push_back(g.defined() ? g.contiguous() : at::Tensor());
    at::Tensor dqkv = at::empty({b, t, h + 2 * kv, hd}, ref->options());
    at::Tensor dbias = want_bias ? at::empty({(h + 2 * kv) * hd}, ref->options().dtype(at::kFloat))
                                 : at::Tensor();
    auto ptr = [](const at::Tensor& g) -> const void* { return g.defined() ? g.data_ptr() : nullptr; };
    lmlab_rope_split_backward(dtype_code(*ref), ptr(gs[0]), ptr(gs[1]), ptr(gs[2]), b, t, h, kv, hd,
                              cos.data_ptr(), sgn.data_ptr(), dqkv.data_ptr(),
                              want_bias ? dbias.data_ptr<float>() : nullptr);
    if (want_bias && bias_type != at::kFloat) dbias = dbias.to(bias_type);
    return {dqkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), dbias};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split(const at::Tensor& qkv,
                                                          const at::Tensor& cos,
                                                          const at::Tensor& sgn, int64_t h,
                                                          int64_t kv,
                                                          const std::optional<at::Tensor>& bias) {
  // reachable by anyone as torch.ops.lmlab.rope_split: the kernel reads and writes through
  // data pointers, so what it cannot read is refused here (a RuntimeError), never read
  // (with data: a fake tensor (FakeTensorMode, torch.compile's tracing) says CPU but its
  // untyped data_ptr() is null, and the kernel would write through it)
  auto dense_cpu = [](const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
           (t.numel() == 0 || (t.has_storage() && t.storage().data() != nullptr));
  };
  const bool fp = qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16;
  TORCH_CHECK(dense_cpu(qkv) && fp && qkv.dim() == 4 && h >= 0 && kv >= 0 &&
                  qkv.size(2) == h + 2 * kv,
              "lmlab.rope_split: qkv must be a float32 or bfloat16 CPU tensor (B, T, h + 2 kv, hd)");
  const int64_t t = qkv.size(1), hd = qkv.size(3);
  for (const auto* table : {&cos, &sgn})
    TORCH_CHECK(dense_cpu(*table) && table->scalar_type() == qkv.scalar_type() &&
                    table->dim() == 2 && table->size(0) == t && table->size(1) == hd,
                "lmlab.rope_split: cos and signed must be (T, hd) CPU tensors of qkv's dtype");
  // the tables get no gradient from the backward: one that records a graph (trainable
  // frequencies) is refused rather than silently left without its gradient
  TORCH_CHECK(!at::GradMode::is_enabled() || !(cos.requires_grad() || sgn.requires_grad()),
              "lmlab.rope_split: cos and signed must not require grad (their gradient is not "
              "computed)");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(dense_cpu(*bias) && bias->dim() == 1 && bias->size(0) == (h + 2 * kv) * hd &&
                    (bias->scalar_type() == at::kFloat || bias->scalar_type() == qkv.scalar_type()),
                "lmlab.rope_split: bias must be ((h + 2 kv) hd,) float32 or qkv's dtype on the CPU");
  auto out = RopeSplit::apply(qkv, cos, sgn, h, kv, bias);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmlab, m) {
  m.def(
      "rope_split(Tensor qkv, Tensor cos, Tensor signed, int h, int kv, Tensor? bias) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lmlab, CompositeImplicitAutograd, m) { m.impl("rope_split", rope_split); }
