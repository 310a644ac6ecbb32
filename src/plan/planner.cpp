// The planner: statistics of a QueryLists selection and a cost model of the three schedules that can
// execute it (docs/design.md §1, §5.2, §5.3). docs/notes/planner.md gives the model and its constants.
//
// Q-centric: query_lists_to_tile_lists on the device (one kernel, one CTA per Q tile), then
// tile_sparse; each query head of a group visits every block of its tile's union, so the time is
// (visits x cost of one 128 x 128 tile visit) plus the conversion (a launch and a cost per tile).
// KV-centric: each (query, head, slot) row is computed once against its block, and its partial
// (D values, f32 or bf16, plus the LSE) is written and read back, so the time is rows x (attention
// of one row against one block + partial bytes / HBM rate) plus the reverse index.
// Group-centric: each (query, 16-head tile) computes its own blocks (padded rows cost as much as
// real ones), and each CTA streams the union of its queries' lists from L2 once, so the time is
// (query blocks x head tiles x cost of one tile-block) + (CTA union blocks x K/V bytes / L2 rate).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "schedule/merge_window.hpp"
#include "sparse_attn/plan.hpp"

namespace sparse_attn {

using detail::require;

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::q_centric: return "q_centric";
    case Schedule::kv_centric: return "kv_centric";
    case Schedule::group_centric: return "group_centric";
  }
  return "unknown";
}

std::int64_t group_centric_cta_queries(std::int64_t group_size) {
  constexpr std::int64_t kWarps = 16;  // qs::kGroupWarps (src/cuda/query_sparse/kernels.cuh)
  if (group_size < 1) return 0;
  const std::int64_t tiles = (group_size + 15) / 16;
  return tiles > kWarps ? 0 : kWarps / tiles;
}

SelectionStats selection_stats(const QueryLists& lists, const ProblemShape& p) {
  const std::string op = "selection_stats";
  const TensorView& idx = lists.idx;
  detail::check_tensor(op, "lists.idx", idx, 4, {DType::i32});
  if (idx.device != Device::cpu) detail::unsupported_device(op, "lists.idx", idx);
  detail::check_shape(op, "lists.idx", idx, {p.B, p.Hkv, p.Lq, -1});
  const std::int64_t Kq = idx.shape[3], Tk = p.Tk();

  SelectionStats st;
  // stamp[j] == tile number marks block j as already in the current tile's union; cta_stamp[j] the
  // same for the current group-centric CTA (a run of cta_q queries, numbered across (b, group)).
  std::vector<std::int64_t> stamp(static_cast<std::size_t>(Tk), -1);
  std::vector<std::int64_t> cta_stamp(static_cast<std::size_t>(Tk), -1);
  const std::int64_t cta_q = std::max<std::int64_t>(1, group_centric_cta_queries(p.group_size()));
  const std::int64_t ctas_per_bg = (p.Lq + cta_q - 1) / cta_q;
  std::vector<std::int32_t> cur, prev;
  double overlap_sum = 0.0, util_den = 0.0;
  std::int64_t overlap_pairs = 0, tile_no = 0;
  for (std::int64_t b = 0; b < p.B; ++b) {
    for (std::int64_t g = 0; g < p.Hkv; ++g) {
      for (std::int64_t t = 0; t < p.Tq(); ++t, ++tile_no) {
        const std::int64_t i0 = t * kTileQ, i1 = std::min(p.Lq, i0 + kTileQ);
        std::int64_t uni = 0;
        for (std::int64_t i = i0; i < i1; ++i) {
          const std::int64_t key_end = p.key_end(i);
          cur.clear();
          const auto* row = static_cast<const std::int32_t*>(idx.at({b, g, i, 0}));
          for (std::int64_t s = 0; s < Kq; ++s) {
            const std::int64_t j = row[s * idx.stride[3]];
            if (j == -1) continue;
            if (j < 0 || j >= Tk)
              throw Error(op, "lists.idx", "block id " + std::to_string(j) + " at " + detail::coord_string({b, g, i, s}) +
                                               " is out of range [0, " + std::to_string(Tk) + ")");
            if (j * kBlockK >= key_end) continue;  // entirely invisible to this query
            cur.push_back(static_cast<std::int32_t>(j));
            st.selected_pairs += std::min(key_end, (j + 1) * kBlockK) - j * kBlockK;
            if (stamp[static_cast<std::size_t>(j)] != tile_no) {
              stamp[static_cast<std::size_t>(j)] = tile_no;
              ++uni;
            }
            const std::int64_t cta = (b * p.Hkv + g) * ctas_per_bg + i / cta_q;
            if (cta_stamp[static_cast<std::size_t>(j)] != cta) {
              cta_stamp[static_cast<std::size_t>(j)] = cta;
              ++st.group_cta_union;
            }
          }
          std::sort(cur.begin(), cur.end());
          st.query_blocks += static_cast<std::int64_t>(cur.size());
          // Pieces: distinct windows j / W of the sorted visible blocks.
          for (int W = 1; W < static_cast<int>(st.window_pieces.size()); ++W)
            for (std::size_t k = 0; k < cur.size(); ++k)
              if (k == 0 || cur[k] / W != cur[k - 1] / W) ++st.window_pieces[static_cast<std::size_t>(W)];
          if (i > i0) {
            std::vector<std::int32_t> common;
            std::set_intersection(cur.begin(), cur.end(), prev.begin(), prev.end(), std::back_inserter(common));
            const std::size_t both = cur.size() + prev.size() - common.size();
            overlap_sum += both == 0 ? 1.0 : double(common.size()) / double(both);
            ++overlap_pairs;
          }
          std::swap(cur, prev);
        }
        st.tile_union += uni;
        st.max_tile_union = std::max(st.max_tile_union, uni);
        util_den += double(uni) * double(i1 - i0);
      }
    }
  }
  st.tiles = p.B * p.Hkv * p.Tq();
  st.queries = p.B * p.Hkv * p.Lq;
  st.list_slots = st.queries * Kq;
  st.blocks_per_query = st.queries ? double(st.query_blocks) / double(st.queries) : 0.0;
  st.union_per_tile = st.tiles ? double(st.tile_union) / double(st.tiles) : 0.0;
  st.neighbour_overlap = overlap_pairs ? overlap_sum / double(overlap_pairs) : 1.0;
  st.union_utilisation = util_den > 0.0 ? double(st.query_blocks) / util_den : 1.0;
  st.group_ctas = p.B * p.Hkv * ctas_per_bg;
  st.union_per_group_cta = st.group_ctas ? double(st.group_cta_union) / double(st.group_ctas) : 0.0;
  return st;
}

PlanEstimate estimate_schedules(const SelectionStats& stats, const ProblemShape& p, PartialPrecision partials,
                                const CostModel& model, int merge_window) {
  const std::string op = "estimate_schedules";
  require(p.D > 0 && p.Hkv > 0 && p.Hq % p.Hkv == 0, op, "p", [&] { return "invalid problem shape " + p.describe(); });
  require(partials == PartialPrecision::f32 || partials == PartialPrecision::bf16, op, "partials",
          [&] { return "unknown partial precision " + std::to_string(static_cast<int>(partials)); });
  const double group = double(p.group_size());
  // Both kernels' work per block is linear in D past the fixed per-visit costs the D = 64
  // measurement already includes; other head dims are scaled from the nearer measured one.
  const double visit_ns = p.D <= 64 ? model.q_visit_ns_d64 * double(p.D) / 64.0
                                    : model.q_visit_ns_d128 * double(p.D) / 128.0;
  const double q_ns = model.q_fixed_us * 1e3 + double(stats.tiles) * model.q_tile_ns +
                      double(stats.tile_union) * group * visit_ns;

  // KV-centric with merge window W: the attention of every (row, block) (slower per block inside a
  // piece), the partials of the pieces written and read back, the reverse index per slot and, with
  // merging, per bin.
  const std::int64_t Kq = stats.queries ? stats.list_slots / stats.queries : 0;
  const int W = cuda_backend::resolve_merge_window(p, Kq, merge_window, op, "merge_window");
  const double rows = double(stats.query_blocks) * group;
  const double piece_rows = double(W > 1 ? stats.window_pieces[static_cast<std::size_t>(W)] : stats.query_blocks) * group;
  const double part_bytes = double(p.D) * (partials == PartialPrecision::f32 ? 4.0 : 2.0);
  const double row_bytes = 2.0 * (part_bytes + 4.0);  // partial and its LSE, written then read back
  const double row_ns = (partials == PartialPrecision::f32 ? model.kv_row_block_ns : model.kv_row_block_bf16_ns) *
                        (W > 1 ? model.kv_piece_row_factor : 1.0);
  const double bins = W > 1 ? double(p.B * p.Hkv * cuda_backend::merge_bins(p.Tk(), W)) : 0.0;
  const double kv_ns = model.kv_fixed_us * 1e3 + bins * model.kv_bin_ns + rows * row_ns * double(p.D) / 128.0 +
                       piece_rows * row_bytes / model.kv_bytes_per_ns + double(stats.query_blocks) * model.kv_slot_ns;

  // Group-centric: padded m16 tiles of each query against its own blocks, plus the K and V bytes
  // every CTA pulls from L2 for its union.
  const std::int64_t head_tiles = (p.group_size() + 15) / 16;
  const double tile_ns = p.D <= 64 ? model.g_tile_block_ns_d64 * double(p.D) / 64.0
                                   : model.g_tile_block_ns_d128 * double(p.D) / 128.0;
  const double block_bytes = 2.0 * double(kBlockK) * double(p.D) * 2.0;  // K and V, 16-bit
  const double g_ns = model.g_fixed_us * 1e3 + double(stats.query_blocks) * double(head_tiles) * tile_ns +
                      double(stats.group_cta_union) * block_bytes / model.g_l2_bytes_per_ns;
  const bool group_runs = group_centric_cta_queries(p.group_size()) > 0;

  PlanEstimate e;
  e.stats = stats;
  e.q_centric_ms = q_ns * 1e-6;
  e.kv_centric_ms = kv_ns * 1e-6;
  e.group_centric_ms = group_runs ? g_ns * 1e-6 : std::numeric_limits<double>::infinity();
  e.merge_window = W;
  e.schedule = Schedule::q_centric;
  double best = e.q_centric_ms;
  if (e.kv_centric_ms < best) e.schedule = Schedule::kv_centric, best = e.kv_centric_ms;
  if (e.group_centric_ms < best) e.schedule = Schedule::group_centric, best = e.group_centric_ms;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "%s: q_centric %.3f ms (union %.1f blocks per tile) vs kv_centric %.3f ms (%.1f blocks per query, "
                "merge window %d, tile union used %.0f%%) vs group_centric %.3f ms (union %.1f blocks per CTA of "
                "%lld queries)",
                schedule_name(e.schedule), e.q_centric_ms, stats.union_per_tile, e.kv_centric_ms,
                stats.blocks_per_query, W, 100.0 * stats.union_utilisation, e.group_centric_ms,
                stats.union_per_group_cta, static_cast<long long>(group_centric_cta_queries(p.group_size())));
  e.reason = buf;
  return e;
}

PlanEstimate plan_schedule(const QueryLists& lists, const ProblemShape& p, PartialPrecision partials,
                           const CostModel& model, int merge_window) {
  validate(lists, p, "plan_schedule");
  return estimate_schedules(selection_stats(lists, p), p, partials, model, merge_window);
}

}  // namespace sparse_attn
