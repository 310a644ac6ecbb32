// Problem shapes, selection validation, conversions, explicit masks and selection quality.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <variant>
#include <limits>
#include <utility>

#include "binding.hpp"

namespace sparse_attn::python {

using namespace nb::literals;

namespace {

nb::dict quality_dict(const QualityReport& r) {
  nb::dict d;
  d["kept_mass_mean"] = r.kept_mass_mean;
  d["kept_mass_min"] = r.kept_mass_min;
  d["kept_mass_mean_per_head"] = r.kept_mass_mean_per_head;
  d["kept_mass_min_per_head"] = r.kept_mass_min_per_head;
  d["out_rel_err"] = r.out_rel_err;
  d["out_rel_err_per_head"] = r.out_rel_err_per_head;
  d["token_sparsity"] = r.token_sparsity;
  d["block_sparsity"] = r.block_sparsity;
  d["selected_pairs"] = r.selected_pairs;
  d["visible_pairs"] = r.visible_pairs;
  return d;
}

nb::dict plan_dict(const PlanEstimate& e) {
  const SelectionStats& st = e.stats;
  nb::dict stats;
  stats["tiles"] = st.tiles;
  stats["queries"] = st.queries;
  stats["list_slots"] = st.list_slots;
  stats["query_blocks"] = st.query_blocks;
  stats["tile_union"] = st.tile_union;
  stats["max_tile_union"] = st.max_tile_union;
  stats["selected_pairs"] = st.selected_pairs;
  stats["blocks_per_query"] = st.blocks_per_query;
  stats["union_per_tile"] = st.union_per_tile;
  stats["neighbour_overlap"] = st.neighbour_overlap;
  stats["union_utilisation"] = st.union_utilisation;
  stats["group_ctas"] = st.group_ctas;
  stats["group_cta_union"] = st.group_cta_union;
  stats["union_per_group_cta"] = st.union_per_group_cta;
  stats["window_pieces"] = std::vector<std::int64_t>(st.window_pieces.begin(), st.window_pieces.end());
  nb::dict d;
  d["schedule"] = schedule_name(e.schedule);
  d["q_centric_ms"] = e.q_centric_ms;
  d["kv_centric_ms"] = e.kv_centric_ms;
  d["group_centric_ms"] = e.group_centric_ms;
  d["merge_window"] = e.merge_window;
  d["reason"] = e.reason;
  d["stats"] = stats;
  return d;
}

/// validate() reads the contents of host tensors only (executors check device selections on the device).
/// sparse_attn.validate copies torch tensors to the host before it gets here; any other device array
/// is refused rather than passed on unchecked.
void require_host(const Selection& s, const std::string& op) {
  auto host = [&](const TensorView& t, const char* name) {
    if (t.device != Device::cpu)
      throw Error(op, name, "is a device array; validate checks host arrays (copy it to the host first)");
  };
  std::visit(
      [&](const auto& sel) {
        using T = std::decay_t<decltype(sel)>;
        if constexpr (std::is_same_v<T, TileLists>) {
          host(sel.idx, "tiles.idx");
          host(sel.cnt, "tiles.cnt");
        } else if constexpr (std::is_same_v<T, BlockBits>) {
          host(sel.bits, "bits.bits");
        } else if constexpr (std::is_same_v<T, QueryLists>) {
          host(sel.idx, "lists.idx");
        } else if constexpr (std::is_same_v<T, TokenLists>) {
          host(sel.idx, "tokens.idx");
        }
      },
      s);
}

constexpr std::int64_t kMaxExtent = std::numeric_limits<std::int32_t>::max();

/// Every extent in [1, 2^31 - 1] (selections hold positions and block ids in int32) and Hq a multiple
/// of Hkv, so that the derived quantities neither divide by zero nor overflow.
ProblemShape checked_shape(const ProblemShape& p) {
  const std::pair<const char*, std::int64_t> extents[] = {{"B", p.B},   {"Lq", p.Lq},   {"Lk", p.Lk},
                                                          {"Hq", p.Hq}, {"Hkv", p.Hkv}, {"D", p.D}};
  for (const auto& [name, v] : extents)
    if (v < 1 || v > kMaxExtent)
      throw Error("ProblemShape", name, "must be in [1, " + std::to_string(kMaxExtent) + "], got " + std::to_string(v));
  if (p.Hq % p.Hkv != 0)
    throw Error("ProblemShape", "Hq",
                std::to_string(p.Hq) + " query heads are not a multiple of the " + std::to_string(p.Hkv) + " KV heads");
  return p;
}

void check_position(const char* name, std::int64_t i, std::int64_t n) {
  if (i < 0 || i >= n)
    throw Error("ProblemShape", name, std::to_string(i) + " is out of range [0, " + std::to_string(n) + ")");
}

/// A read-write extent whose setter checks the shape it makes.
template <std::int64_t ProblemShape::*Member>
void extent_property(nb::class_<ProblemShape>& c, const char* name) {
  c.def_prop_rw(
      name, [](const ProblemShape& p) { return p.*Member; },
      [](ProblemShape& p, std::int64_t v) {
        ProblemShape next = p;
        next.*Member = v;
        p = checked_shape(next);
      });
}

}  // namespace

void bind_formats(nb::module_& m) {
  m.attr("TILE_Q") = kTileQ;
  m.attr("BLOCK_K") = kBlockK;
  m.attr("GATE_ROWS") = kGateRows;

  nb::class_<ProblemShape> shape(m, "ProblemShape", "Problem extents and the causal flag (docs/design.md §2).");
  shape.def(
      "__init__",
      [](ProblemShape* p, std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
         std::int64_t D, bool causal) { new (p) ProblemShape(checked_shape({B, Lq, Lk, Hq, Hkv, D, causal})); },
      "B"_a, "Lq"_a, "Lk"_a, "Hq"_a, "Hkv"_a, "D"_a = 128, "causal"_a = false);
  shape.def("__init__", constructor_type_error<ProblemShape>("ProblemShape"));
  extent_property<&ProblemShape::B>(shape, "B");
  extent_property<&ProblemShape::Lq>(shape, "Lq");
  extent_property<&ProblemShape::Lk>(shape, "Lk");
  extent_property<&ProblemShape::Hq>(shape, "Hq");
  extent_property<&ProblemShape::Hkv>(shape, "Hkv");
  extent_property<&ProblemShape::D>(shape, "D");
  shape.def_rw("causal", &ProblemShape::causal)
      .def_prop_ro("Tq", &ProblemShape::Tq)
      .def_prop_ro("Tk", &ProblemShape::Tk)
      .def_prop_ro("group_size", &ProblemShape::group_size)
      .def_prop_ro("offset", &ProblemShape::offset)
      .def(
          "visible",
          [](const ProblemShape& p, std::int64_t i, std::int64_t j) {
            check_position("i", i, p.Lq);
            check_position("j", j, p.Lk);
            return p.visible(i, j);
          },
          "i"_a, "j"_a)
      .def(
          "key_end",
          [](const ProblemShape& p, std::int64_t i) {
            check_position("i", i, p.Lq);
            return p.key_end(i);
          },
          "i"_a)
      .def("visible_pairs", &ProblemShape::visible_pairs)
      .def("describe", &ProblemShape::describe)
      .def("__repr__", [](const ProblemShape& p) { return "ProblemShape(" + p.describe() + ")"; });

  m.def(
      "validate",
      [](const std::string& kind, nb::handle a, nb::handle b, const ProblemShape& p, const std::string& op) {
        Imports im(op);
        const Selection sel = make_selection(im, kind, a, b);
        require_host(sel, op);
        nb::gil_scoped_release release;
        sparse_attn::validate(sel, p, op);
      },
      "kind"_a, "a"_a.none(), "b"_a.none(), "shape"_a, "op"_a = "validate",
      "Checks a selection against a problem shape; raises Error naming the first offending coordinate.");

  m.def(
      "selection_groups",
      [](const std::string& kind, nb::handle a, nb::handle b, const ProblemShape& p) {
        Imports im("selection_groups");
        const Selection sel = make_selection(im, kind, a, b);
        return sparse_attn::selection_groups(sel, p, "selection_groups");
      },
      "kind"_a, "a"_a.none(), "b"_a.none(), "shape"_a);

  m.def(
      "tile_lists_to_block_bits",
      [](nb::handle idx, nb::handle cnt, nb::handle bits, const ProblemShape& p, bool trusted, std::uintptr_t stream) {
        Imports im("tile_lists_to_block_bits");
        const TileLists in{im.in(idx, "in.idx"), im.in(cnt, "in.cnt")};
        const BlockBits out{im.out(bits, "out.bits")};
        ConvertOptions o;
        o.trusted = trusted;
        o.stream = stream_ptr(stream);
        nb::gil_scoped_release release;
        sparse_attn::tile_lists_to_block_bits(in, out, p, o);
      },
      "idx"_a, "cnt"_a, "bits"_a, "shape"_a, "trusted"_a = false, "stream"_a = 0);

  m.def(
      "block_bits_to_tile_lists",
      [](nb::handle bits, nb::handle idx, nb::handle cnt, const ProblemShape& p, bool trusted, std::uintptr_t stream) {
        Imports im("block_bits_to_tile_lists");
        const BlockBits in{im.in(bits, "in.bits")};
        const TileLists out{im.out(idx, "out.idx"), im.out(cnt, "out.cnt")};
        ConvertOptions o;
        o.trusted = trusted;
        o.stream = stream_ptr(stream);
        nb::gil_scoped_release release;
        sparse_attn::block_bits_to_tile_lists(in, out, p, o);
      },
      "bits"_a, "idx"_a, "cnt"_a, "shape"_a, "trusted"_a = false, "stream"_a = 0);

  m.def(
      "query_lists_to_tile_lists",
      [](nb::handle lists, nb::handle idx, nb::handle cnt, const ProblemShape& p, bool trusted, std::uintptr_t stream) {
        Imports im("query_lists_to_tile_lists");
        const QueryLists in{im.in(lists, "in.idx")};
        const TileLists out{im.out(idx, "out.idx"), im.out(cnt, "out.cnt")};
        ConvertOptions o;
        o.trusted = trusted;
        o.stream = stream_ptr(stream);
        nb::gil_scoped_release release;
        sparse_attn::query_lists_to_tile_lists(in, out, p, o);
      },
      "lists"_a, "idx"_a, "cnt"_a, "shape"_a, "trusted"_a = false, "stream"_a = 0);

  m.def(
      "expand_mask",
      [](const std::string& kind, nb::handle a, nb::handle b, const ProblemShape& p) {
        Imports im("expand_mask");
        const Selection sel = make_selection(im, kind, a, b);
        HostTensor mask;
        {
          nb::gil_scoped_release release;
          mask = sparse_attn::expand_mask(sel, p);
        }
        std::vector<std::uint8_t> bytes(static_cast<std::size_t>(mask.numel()));
        if (!bytes.empty()) std::memcpy(bytes.data(), mask.data<std::uint8_t>(), bytes.size());
        std::vector<std::size_t> shape;
        for (auto s : mask.shape()) shape.push_back(static_cast<std::size_t>(s));
        return numpy_array(std::move(bytes), shape);
      },
      "kind"_a, "a"_a.none(), "b"_a.none(), "shape"_a,
      "The explicit mask u8 [B, Hq, Lq, Lk] of a selection (selected and visible).");

  m.def(
      "evaluate_selection",
      [](nb::handle q, nb::handle k, nb::handle v, const std::string& kind, nb::handle a, nb::handle b,
         std::optional<float> scale, bool causal) {
        Imports im("evaluate_selection");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const Selection sel = make_selection(im, kind, a, b);
        QualityOptions o;
        o.softmax_scale = scale;
        o.causal = causal;
        QualityReport r;
        {
          nb::gil_scoped_release release;
          r = sparse_attn::evaluate_selection(qv, kv, vv, sel, o);
        }
        return quality_dict(r);
      },
      "q"_a, "k"_a, "v"_a, "kind"_a, "a"_a.none() = nb::none(), "b"_a.none() = nb::none(),
      "softmax_scale"_a.none() = nb::none(), "causal"_a = false,
      "Selection quality against dense attention, computed in float64 on the CPU.");

  m.def(
      "plan_schedule",
      [](nb::handle lists, const ProblemShape& p, const std::string& partials, int merge_window) {
        Imports im("plan_schedule");
        const QueryLists in{im.in(lists, "lists")};
        const PartialPrecision pp = parse_partials("plan_schedule", partials);
        PlanEstimate e;
        {
          nb::gil_scoped_release release;
          e = sparse_attn::plan_schedule(in, p, pp, CostModel{}, merge_window);
        }
        return plan_dict(e);
      },
      "lists"_a, "shape"_a, "partials"_a = "f32", "merge_window"_a = 0,
      "The planner on QueryLists (CPU): the chosen schedule, the three estimates (ms), the merge window, "
      "the reason and the selection statistics.");
}

}  // namespace sparse_attn::python
