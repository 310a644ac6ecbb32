// The KV-centric query_sparse plan / run pair with a caller-owned workspace (plan.hpp): plan once
// per lists and shape, run many times without allocating or synchronising (CUDA-graph capturable).
// The plan object refers to the lists and the workspace without owning them; the Python Plan that
// wraps it keeps both alive.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "binding.hpp"

namespace sparse_attn::python {

using namespace nb::literals;

namespace {

QuerySparseOptions plan_options(const std::string& op, std::optional<float> scale, bool causal, bool trusted,
                                const std::string& partials, int merge_window, std::uintptr_t stream) {
  QuerySparseOptions o;
  o.softmax_scale = scale;
  o.causal = causal;
  o.trusted = trusted;
  o.stream = stream_ptr(stream);
  o.partials = parse_partials(op, partials);
  o.merge_window = merge_window;
  return o;
}

}  // namespace

void bind_plan(nb::module_& m) {
  nb::class_<QuerySparsePlan>(m, "QuerySparsePlan",
                              "A KV-centric query_sparse plan: the reverse index built in a caller's workspace.")
      .def_ro("shape", &QuerySparsePlan::shape)
      .def_ro("Kq", &QuerySparsePlan::Kq)
      .def_ro("merge_window", &QuerySparsePlan::merge_window)
      .def_ro("scale", &QuerySparsePlan::scale)
      .def_prop_ro("partials", [](const QuerySparsePlan& p) {
        return std::string(p.partials == PartialPrecision::bf16 ? "bf16" : "f32");
      });

  m.def(
      "query_sparse_workspace_bytes",
      [](const ProblemShape& p, std::int64_t Kq, const std::string& partials) {
        return query_sparse_workspace_bytes(p, Kq, parse_partials("query_sparse_workspace_bytes", partials));
      },
      "shape"_a, "Kq"_a, "partials"_a = "f32",
      "Device bytes the KV-centric plan needs (0 in a build without the CUDA backend).");

  m.def(
      "query_sparse_plan",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle idx, nb::handle workspace, std::optional<float> scale,
         bool causal, bool trusted, const std::string& partials, int merge_window, std::uintptr_t stream) {
        Imports im("query_sparse_plan");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const QueryLists lists{im.in(idx, "lists.idx")};
        const TensorView ws = im.out(workspace, "workspace");
        const QuerySparseOptions o =
            plan_options("query_sparse_plan", scale, causal, trusted, partials, merge_window, stream);
        nb::gil_scoped_release release;
        return sparse_attn::query_sparse_plan(qv, kv, vv, lists, ws, o);
      },
      "q"_a, "k"_a, "v"_a, "idx"_a, "workspace"_a, "softmax_scale"_a.none() = nb::none(), "causal"_a = false,
      "trusted"_a = false, "partials"_a = "f32", "merge_window"_a = 0, "stream"_a = 0,
      "Validates the lists (unless trusted) and builds the reverse index in workspace (u8 on q's device).");

  m.def(
      "query_sparse_run",
      [](const QuerySparsePlan& plan, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         std::optional<float> scale, bool causal, bool trusted, const std::string& partials, int merge_window,
         std::uintptr_t stream) {
        Imports im("query_sparse_run");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v"), ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        const QuerySparseOptions o =
            plan_options("query_sparse_run", scale, causal, trusted, partials, merge_window, stream);
        nb::gil_scoped_release release;
        sparse_attn::query_sparse_run(plan, qv, kv, vv, ov, lv, o);
      },
      "plan"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none() = nb::none(), "softmax_scale"_a.none() = nb::none(),
      "causal"_a = false, "trusted"_a = false, "partials"_a = "f32", "merge_window"_a = 0, "stream"_a = 0,
      "Attention and combine of a plan; no allocation, no synchronisation.");
}

}  // namespace sparse_attn::python
