#include <cmath>

#include "core/call.hpp"
#include "core/check.hpp"
#include "sparse_attn/ops.hpp"

namespace sparse_attn {

using detail::require;

float resolve_scale(const std::string& op, const std::optional<float>& scale, std::int64_t D) {
  if (!scale) return 1.0f / std::sqrt(static_cast<float>(D));
  require(std::isfinite(*scale) && *scale > 0.0f, op, "softmax_scale",
          [&] { return "must be finite and > 0, got " + std::to_string(*scale); });
  return *scale;
}

namespace detail {

ProblemShape check_qkv(const std::string& op, const TensorView& q, const TensorView& k, const TensorView& v,
                       std::initializer_list<DType> dtypes, bool causal, const std::optional<float>& scale,
                       float* resolved_scale) {
  check_tensor(op, "q", q, 4, dtypes);
  check_tensor(op, "k", k, 4, dtypes);
  check_tensor(op, "v", v, 4, dtypes);
  check_same_device(op, "k", k, "q", q);
  check_same_device(op, "v", v, "q", q);

  ProblemShape p;
  p.B = q.shape[0];
  p.Lq = q.shape[1];
  p.Hq = q.shape[2];
  p.D = q.shape[3];
  p.Lk = k.shape[1];
  p.Hkv = k.shape[2];
  p.causal = causal;
  require(p.B > 0 && p.Lq > 0 && p.Hq > 0 && p.D > 0, op, "q",
          [&] { return "every extent must be > 0, got " + shape_string(q); });
  require(p.Lk > 0 && p.Hkv > 0, op, "k", [&] { return "every extent must be > 0, got " + shape_string(k); });
  check_shape(op, "k", k, {p.B, -1, -1, p.D});
  check_shape(op, "v", v, {p.B, p.Lk, p.Hkv, p.D});
  check_head_ratio(op, "k", p.Hq, p.Hkv);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}})
    check_last_contiguous(op, name, *t);
  const float s = resolve_scale(op, scale, p.D);
  if (resolved_scale != nullptr) *resolved_scale = s;
  return p;
}

AttentionCall resolve_call(const std::string& op, const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const std::optional<TensorView>& lse,
                           const AttentionOptions& options, bool check_outputs) {
  // float32 is a CPU-only input dtype; the device kernels take 16-bit inputs.
  const bool cpu = q.device == Device::cpu;
  AttentionCall a;
  a.q = q, a.k = k, a.v = v, a.out = out, a.lse = lse;
  a.p = cpu ? check_qkv(op, q, k, v, {DType::bf16, DType::f16, DType::f32}, options.causal, options.softmax_scale,
                        &a.scale)
            : check_qkv(op, q, k, v, {DType::bf16, DType::f16}, options.causal, options.softmax_scale, &a.scale);
  const ProblemShape& p = a.p;
  if (cpu)
    detail::check_tensor(op, "out", out, 4, {DType::bf16, DType::f16, DType::f32});
  else
    detail::check_tensor(op, "out", out, 4, {DType::bf16, DType::f16});
  require(k.dtype == q.dtype, op, "k",
          [&] { return std::string("dtype ") + dtype_name(k.dtype) + " differs from q's " + dtype_name(q.dtype); });
  require(v.dtype == q.dtype, op, "v",
          [&] { return std::string("dtype ") + dtype_name(v.dtype) + " differs from q's " + dtype_name(q.dtype); });
  require(out.dtype == q.dtype, op, "out",
          [&] { return std::string("dtype ") + dtype_name(out.dtype) + " differs from q's " + dtype_name(q.dtype); });
  detail::check_same_device(op, "out", out, "q", q);
  detail::check_shape(op, "out", out, {p.B, p.Lq, p.Hq, p.D});
  if (!cpu) require(p.D == 64 || p.D == 128, op, "q",
                    [&] { return "head dim must be 64 or 128 on the GPU, got " + std::to_string(p.D); });
  detail::check_last_contiguous(op, "out", out);
  if (lse) {
    detail::check_tensor(op, "lse", *lse, 3, {DType::f32});
    detail::check_shape(op, "lse", *lse, {p.B, p.Hq, p.Lq});
    detail::check_same_device(op, "lse", *lse, "q", q);
  }
  if (check_outputs) {
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}})
      detail::check_outputs_apart(op, out, lse, name, *t);
    if (lse) detail::check_no_overlap(op, "lse", *lse, "out", out);
  }
  a.scale_log2 = a.scale * 1.4426950408889634f;  // log2(e)
  a.device = q.device_index;
  a.stream = options.stream;
  a.trusted = options.trusted;
  return a;
}

}  // namespace detail

ProblemShape check_attention_args(const std::string& op, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out,
                                  const std::optional<TensorView>& lse, const AttentionOptions& options) {
  return detail::resolve_call(op, q, k, v, out, lse, options).p;
}

}  // namespace sparse_attn
