// Public plan() / run() of the KV-centric query_sparse (include/sparse_attn/plan.hpp): argument
// checks, then the CPU reference or the CUDA backend.
#include <cmath>
#include <string>

#include "attention/cpu_backend.hpp"
#include "core/call.hpp"
#include "core/check.hpp"
#include "schedule/merge_window.hpp"
#include "sparse_attn/plan.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/query_sparse/backend.hpp"
#endif

namespace sparse_attn {
namespace {

using detail::require;

void check_partials(const std::string& op, PartialPrecision prec) {
  require(prec == PartialPrecision::f32 || prec == PartialPrecision::bf16, op, "options.partials",
          [&] { return "unknown partial precision " + std::to_string(static_cast<int>(prec)); });
}

// plan.hpp says why the group-centric schedule has no plan step.
void check_schedule(const std::string& op, QuerySchedule s) {
  require(s == QuerySchedule::kv_centric, op, "options.schedule",
          [&] { return std::string("plan() and run() are the KV-centric schedule; ") + query_schedule_name(s) +
              " has no plan step (call query_sparse with that schedule)"; });
}

void check_lists(const std::string& op, const QueryLists& lists, const ProblemShape& p, const TensorView& q) {
  detail::check_tensor(op, "lists.idx", lists.idx, 4, {DType::i32});
  detail::check_shape(op, "lists.idx", lists.idx, {p.B, p.Hkv, p.Lq, -1});
  detail::check_same_device(op, "lists.idx", lists.idx, "q", q);
}

// The merge window in effect: resolved the same way on every device (the CPU reference ignores it).
int merge_window_of(const std::string& op, const ProblemShape& p, std::int64_t Kq, const QuerySparseOptions& options) {
  return cuda_backend::resolve_merge_window(p, Kq, options.merge_window, op,
                                            "options.merge_window");
}

std::string shape_mismatch(const ProblemShape& got, const ProblemShape& planned) {
  return "problem " + got.describe() + " differs from the planned " + planned.describe();
}

}  // namespace

std::size_t query_sparse_workspace_bytes(const ProblemShape& p, std::int64_t Kq, PartialPrecision partials) {
  check_partials("query_sparse_workspace_bytes", partials);
  require(Kq >= 0, "query_sparse_workspace_bytes", "Kq", [&] { return "must be >= 0, got " + std::to_string(Kq); });
#if defined(SPARSE_ATTN_WITH_CUDA)
  return cuda_backend::query_sparse_workspace_bytes(p, Kq, partials);
#else
  (void)p;
  return 0;  // the CPU path keeps its scratch to itself
#endif
}

int query_sparse_merge_window(const ProblemShape& p, std::int64_t Kq, const QuerySparseOptions& options) {
  require(Kq >= 0, "query_sparse_merge_window", "Kq", [&] { return "must be >= 0, got " + std::to_string(Kq); });
  return merge_window_of("query_sparse_merge_window", p, Kq, options);
}

QuerySparsePlan query_sparse_plan(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const QueryLists& lists, const TensorView& workspace,
                                  const QuerySparseOptions& options) {
  const std::string op = "query_sparse_plan";
  // The plan has no output yet; q stands in for it (same shape and dtype by definition).
  const detail::AttentionCall a = detail::resolve_call(op, q, k, v, q, std::nullopt, options, /*check_outputs=*/false);
  const ProblemShape& p = a.p;
  check_partials(op, options.partials);
  check_schedule(op, options.schedule);
  check_lists(op, lists, p, q);

  QuerySparsePlan plan;
  plan.shape = p;
  plan.Kq = lists.idx.shape[3];
  plan.partials = options.partials;
  plan.merge_window = merge_window_of(op, p, plan.Kq, options);
  plan.lists = lists;
  plan.scale = a.scale;
  plan.device = q.device;
  plan.device_index = q.device_index;
  if (q.device == Device::cpu) {
    if (!options.trusted) validate(lists, p, op);
    plan.planned = true;
    return plan;
  }
#if defined(SPARSE_ATTN_WITH_CUDA)
  detail::check_tensor(op, "workspace", workspace, 1, {DType::u8});
  detail::check_same_device(op, "workspace", workspace, "q", q);
  require(workspace.stride[0] == 1, op, "workspace", [&] { return "must be contiguous, got " + workspace.describe(); });
  const cuda_backend::QuerySparseBins bins = cuda_backend::query_sparse_bins(p, plan.Kq, plan.merge_window);
  const std::size_t need = cuda_backend::query_sparse_workspace_bytes(p, plan.Kq, options.partials);
  require(static_cast<std::size_t>(workspace.shape[0]) >= need, op, "workspace",
          [&] { return
              "holds " + std::to_string(workspace.shape[0]) + " bytes; this problem needs " + std::to_string(need) +
              " (query_sparse_workspace_bytes)"; });
  const detail::QueryCall c{lists, plan.Kq, plan.partials, options.schedule, plan.merge_window};
  cuda_backend::query_sparse_plan(a, c, bins, workspace.data, static_cast<std::size_t>(workspace.shape[0]));
  plan.query_bands = bins.bands;
  plan.workspace = workspace;
  plan.planned = true;
  return plan;
#else
  (void)workspace;
  detail::unsupported_device(op, "q", q);
#endif
}

void query_sparse_run(const QuerySparsePlan& plan, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const std::optional<TensorView>& lse, const QuerySparseOptions& options) {
  const std::string op = "query_sparse_run";
  require(plan.planned, op, "plan", "was not made by query_sparse_plan");
  const detail::AttentionCall a = detail::resolve_call(op, q, k, v, out, lse, options);
  const ProblemShape& p = a.p;
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"plan.lists.idx", &plan.lists.idx},
                                {"plan.workspace", &plan.workspace}})
    detail::check_outputs_apart(op, out, lse, name, *t);
  const ProblemShape& s = plan.shape;
  require(p.B == s.B && p.Lq == s.Lq && p.Hq == s.Hq && p.D == s.D, op, "q", [&] { return shape_mismatch(p, s); });
  require(p.Lk == s.Lk && p.Hkv == s.Hkv, op, "k", [&] { return shape_mismatch(p, s); });
  require(p.causal == s.causal, op, "options.causal",
          [&] { return
              std::string("is ") + (p.causal ? "true" : "false") + " but the plan was made with " +
              (s.causal ? "true" : "false"); });
  require(options.partials == plan.partials, op, "options.partials", "differs from the plan's");
  const int window = merge_window_of(op, p, plan.Kq, options);
  require(window == plan.merge_window, op, "options.merge_window", [&] {
    return "resolves to " + std::to_string(window) + " but the plan was made with " +
           std::to_string(plan.merge_window);
  });
  check_schedule(op, options.schedule);
  require(a.scale == plan.scale, op, "softmax_scale",
          [&] { return std::to_string(a.scale) + " differs from the plan's " + std::to_string(plan.scale); });
  require(q.device == plan.device && q.device_index == plan.device_index, op, "q",
          [&] { return "is on " + q.describe() + ", not on the plan's device"; });
  const detail::QueryCall c{plan.lists, plan.Kq, plan.partials, options.schedule, plan.merge_window};
  if (q.device == Device::cpu) {
    detail::cpu::query_sparse(a, c);
    return;
  }
#if defined(SPARSE_ATTN_WITH_CUDA)
  const auto bytes = static_cast<std::size_t>(plan.workspace.shape[0]);
  const cuda_backend::QuerySparseBins bins{plan.merge_window, plan.query_bands};
  cuda_backend::query_sparse_attend(a, c, bins, plan.workspace.data, bytes);
  cuda_backend::query_sparse_combine(a, c, bins, plan.workspace.data, bytes);
#else
  detail::unsupported_device(op, "q", q);
#endif
}

}  // namespace sparse_attn
