// The planner: selection statistics against brute force (sets per tile, per group-centric CTA and per
// query pair, key pairs counted one by one), decisions among the three schedules on clear-cut
// selections, the cost model's monotonicity, and the CPU plan()/run() path of query_sparse against
// the one-call operator.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/plan.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

sa::ProblemShape shape(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
                       std::int64_t D, bool causal) {
  sa::ProblemShape p;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = causal;
  return p;
}

// Per query: `per` distinct random blocks; a query keeps each block of its predecessor with
// probability `keep` (the rest fresh); -1 in random slots; every 11th query empty.
sa::HostTensor make_lists(const sa::ProblemShape& p, std::int64_t kq, std::int64_t per, double keep,
                          std::uint64_t seed, bool holes = true) {
  sa::HostTensor t(sa::DType::i32, {p.B, p.Hkv, p.Lq, kq});
  auto* d = t.data<std::int32_t>();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const std::int64_t Tk = p.Tk();
  per = std::min(per, std::min(kq, Tk));
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg) {
    std::vector<std::int32_t> prev;
    for (std::int64_t i = 0; i < p.Lq; ++i) {
      std::int32_t* row = d + (bg * p.Lq + i) * kq;
      std::fill(row, row + kq, -1);
      std::vector<std::int32_t> pick;
      for (std::int32_t j : prev)
        if (u(rng) < keep && static_cast<std::int64_t>(pick.size()) < per) pick.push_back(j);
      while (static_cast<std::int64_t>(pick.size()) < per) {
        const auto j = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(Tk));
        if (std::find(pick.begin(), pick.end(), j) == pick.end()) pick.push_back(j);
      }
      prev = pick;
      if (holes && i % 11 == 5) continue;
      std::vector<std::int64_t> slots(static_cast<std::size_t>(kq));
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      for (std::size_t s = 0; s < pick.size(); ++s) row[slots[s]] = pick[s];
    }
  }
  return t;
}

// Straightforward recomputation of every statistic from sets.
sa::SelectionStats brute_force(const sa::HostTensor& idx, const sa::ProblemShape& p) {
  const std::int64_t kq = idx.shape()[3];
  const auto* d = idx.data<std::int32_t>();
  sa::SelectionStats s;
  double overlap = 0.0, util_den = 0.0;
  std::int64_t pairs = 0;
  auto visible_set = [&](std::int64_t bg, std::int64_t i) {
    std::set<std::int32_t> out;
    for (std::int64_t x = 0; x < kq; ++x) {
      const std::int32_t j = d[(bg * p.Lq + i) * kq + x];
      if (j < 0) continue;
      bool any = false;
      for (std::int64_t key = j * sa::kBlockK; key < std::min(p.Lk, (j + 1) * sa::kBlockK); ++key)
        any = any || p.visible(i, key);
      if (any) out.insert(j);
    }
    return out;
  };
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg) {
    for (std::int64_t t = 0; t < p.Tq(); ++t) {
      std::set<std::int32_t> uni;
      const std::int64_t i0 = t * sa::kTileQ, i1 = std::min(p.Lq, i0 + sa::kTileQ);
      for (std::int64_t i = i0; i < i1; ++i) {
        const auto cur = visible_set(bg, i);
        uni.insert(cur.begin(), cur.end());
        s.query_blocks += static_cast<std::int64_t>(cur.size());
        for (int W = 1; W <= 8; ++W) {
          std::set<std::int32_t> windows;
          for (std::int32_t j : cur) windows.insert(j / W);
          s.window_pieces[static_cast<std::size_t>(W)] += static_cast<std::int64_t>(windows.size());
        }
        for (std::int32_t j : cur)
          for (std::int64_t key = j * sa::kBlockK; key < std::min(p.Lk, (j + 1) * sa::kBlockK); ++key)
            s.selected_pairs += p.visible(i, key) ? 1 : 0;
        if (i > i0) {
          const auto prev = visible_set(bg, i - 1);
          std::set<std::int32_t> both = prev, common;
          both.insert(cur.begin(), cur.end());
          for (std::int32_t j : cur)
            if (prev.count(j)) common.insert(j);
          overlap += both.empty() ? 1.0 : double(common.size()) / double(both.size());
          ++pairs;
        }
      }
      s.tile_union += static_cast<std::int64_t>(uni.size());
      s.max_tile_union = std::max<std::int64_t>(s.max_tile_union, static_cast<std::int64_t>(uni.size()));
      util_den += double(uni.size()) * double(i1 - i0);
    }
  }
  s.neighbour_overlap = pairs ? overlap / double(pairs) : 1.0;
  s.union_utilisation = util_den > 0 ? double(s.query_blocks) / util_den : 1.0;
  s.list_slots = p.B * p.Hkv * p.Lq * kq;
  // Group-centric CTAs: runs of 16 / ceil(G / 16) queries of one (b, group).
  const std::int64_t cq = 16 / ((p.group_size() + 15) / 16);
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg)
    for (std::int64_t i0 = 0; i0 < p.Lq; i0 += cq) {
      std::set<std::int32_t> uni;
      for (std::int64_t i = i0; i < std::min(p.Lq, i0 + cq); ++i) {
        const auto cur = visible_set(bg, i);
        uni.insert(cur.begin(), cur.end());
      }
      s.group_cta_union += static_cast<std::int64_t>(uni.size());
      ++s.group_ctas;
    }
  return s;
}

void expect_stats_equal(const sa::SelectionStats& got, const sa::SelectionStats& ref, const sa::ProblemShape& p) {
  EXPECT_EQ(got.tiles, p.B * p.Hkv * p.Tq());
  EXPECT_EQ(got.queries, p.B * p.Hkv * p.Lq);
  EXPECT_EQ(got.list_slots, ref.list_slots);
  EXPECT_EQ(got.query_blocks, ref.query_blocks);
  EXPECT_EQ(got.window_pieces, ref.window_pieces);
  EXPECT_EQ(got.window_pieces[1], got.query_blocks);
  EXPECT_EQ(got.tile_union, ref.tile_union);
  EXPECT_EQ(got.max_tile_union, ref.max_tile_union);
  EXPECT_EQ(got.selected_pairs, ref.selected_pairs);
  EXPECT_NEAR(got.neighbour_overlap, ref.neighbour_overlap, 1e-12);
  EXPECT_NEAR(got.union_utilisation, ref.union_utilisation, 1e-12);
  EXPECT_NEAR(got.blocks_per_query, double(ref.query_blocks) / double(got.queries), 1e-12);
  EXPECT_NEAR(got.union_per_tile, double(ref.tile_union) / double(got.tiles), 1e-12);
  EXPECT_EQ(got.group_ctas, ref.group_ctas);
  EXPECT_EQ(got.group_cta_union, ref.group_cta_union);
  EXPECT_NEAR(got.union_per_group_cta, double(ref.group_cta_union) / double(ref.group_ctas), 1e-12);
}

TEST(Planner, StatsMatchBruteForce) {
  struct C {
    sa::ProblemShape p;
    std::int64_t kq, per;
    double keep;
  };
  const std::vector<C> cases = {
      {shape(2, 1013, 1000, 4, 2, 64, false), 6, 4, 0.5},
      {shape(2, 1013, 1000, 4, 2, 64, true), 6, 4, 0.5},
      {shape(1, 17, 2000, 16, 1, 128, true), 5, 5, 0.0},   // Lq < Lk: causal offset
      {shape(1, 300, 129, 2, 2, 128, true), 3, 2, 0.9},    // Lq > Lk: first queries see nothing
      {shape(3, 1, 640, 1, 1, 128, false), 4, 3, 0.0},     // one query
      {shape(1, 256, 1024, 8, 1, 128, false), 8, 8, 1.0},  // identical lists
      {shape(2, 203, 1500, 32, 1, 64, true), 4, 3, 0.7},   // G = 32: CTAs of 8 queries
      {shape(1, 77, 900, 48, 1, 128, false), 5, 4, 0.3},   // G = 48: CTAs of 5 queries, the last short
  };
  std::uint64_t seed = 11;
  for (const C& c : cases) {
    SCOPED_TRACE(c.p.describe());
    const auto idx = make_lists(c.p, c.kq, c.per, c.keep, ++seed);
    const sa::SelectionStats got = sa::selection_stats(sa::QueryLists{idx.view()}, c.p);
    expect_stats_equal(got, brute_force(idx, c.p), c.p);
    EXPECT_GT(got.query_blocks, 0);
  }
}

// The 128 queries of each Q tile share one list and G = 4: Q-centric visits only the shared blocks
// for its 4 heads and pays the conversion per tile; group-centric computes the same blocks in
// m16 tiles three quarters padding, and KV-centric writes a partial per (query, head, block).
TEST(Planner, IdenticalListsInATileWithSmallGroupsPickQCentric) {
  const auto p = shape(4, 32768, 32768, 8, 2, 128, false);
  sa::HostTensor idx(sa::DType::i32, {p.B, p.Hkv, p.Lq, 8});
  std::mt19937_64 rng(3);
  std::vector<std::int32_t> all(static_cast<std::size_t>(p.Tk()));
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg)
    for (std::int64_t t = 0; t < p.Tq(); ++t) {
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (std::int64_t i = t * 128; i < (t + 1) * 128; ++i)
        std::copy(all.begin(), all.begin() + 8, idx.data<std::int32_t>() + (bg * p.Lq + i) * 8);
    }
  const sa::PlanEstimate e = sa::plan_schedule(sa::QueryLists{idx.view()}, p);
  EXPECT_EQ(e.schedule, sa::Schedule::q_centric) << e.reason;
  EXPECT_DOUBLE_EQ(e.stats.union_per_tile, 8.0);
  EXPECT_GT(e.stats.neighbour_overlap, 0.99);
  EXPECT_NEAR(e.stats.union_utilisation, 1.0, 1e-12);
  EXPECT_EQ(e.stats.list_slots, p.B * p.Hkv * p.Lq * 8);
  EXPECT_GT(e.group_centric_ms, 1.1 * e.q_centric_ms) << e.reason;
  EXPECT_GT(e.kv_centric_ms, 1.4 * e.q_centric_ms) << e.reason;
}

TEST(Planner, IndependentListsOverManyBlocksPickKVCentric) {
  // Hq = Hkv: a group-centric tile would be 15/16 padding, and each CTA streams ~250 blocks for 16
  // queries of 16 blocks each.
  const auto p = shape(1, 4096, 65536, 4, 4, 128, false);
  const auto idx = make_lists(p, 16, 16, 0.0, 5, false);
  const sa::PlanEstimate e = sa::plan_schedule(sa::QueryLists{idx.view()}, p);
  EXPECT_EQ(e.schedule, sa::Schedule::kv_centric) << e.reason;
  EXPECT_GT(e.stats.union_per_tile, 400.0);  // 128 queries x 16 of 512 blocks: nearly all
  EXPECT_GT(e.stats.union_per_group_cta, 150.0);
  EXPECT_LT(e.stats.neighbour_overlap, 0.1);
  EXPECT_GT(e.q_centric_ms, 2.0 * e.kv_centric_ms) << e.reason;
  EXPECT_GT(e.group_centric_ms, 2.0 * e.kv_centric_ms) << e.reason;
}

// G = 16 and the 16 queries of each group-centric CTA share one list, but the 8 CTAs of a Q tile
// differ: the tile's union is 8x a query's list (Q-centric visits all of it for every head) while
// the group-centric kernel computes only each query's own 16 blocks, streamed once per CTA, and
// KV-centric writes and reads back a partial per (query, head, block).
TEST(Planner, ListsSharedWithinACtaPickGroupCentric) {
  const auto p = shape(2, 2048, 65536, 16, 1, 128, false);
  sa::HostTensor idx(sa::DType::i32, {p.B, 1, p.Lq, 16});
  std::mt19937_64 rng(8);
  std::vector<std::int32_t> all(static_cast<std::size_t>(p.Tk()));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t c = 0; c < p.Lq / 16; ++c) {
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (std::int64_t i = c * 16; i < (c + 1) * 16; ++i)
        std::copy(all.begin(), all.begin() + 16, idx.data<std::int32_t>() + (b * p.Lq + i) * 16);
    }
  const sa::PlanEstimate e = sa::plan_schedule(sa::QueryLists{idx.view()}, p);
  EXPECT_EQ(e.schedule, sa::Schedule::group_centric) << e.reason;
  EXPECT_DOUBLE_EQ(e.stats.union_per_group_cta, 16.0);
  EXPECT_GT(e.stats.union_per_tile, 100.0);  // 8 lists of 16 from 512 blocks overlap a little
  EXPECT_GT(e.q_centric_ms, 2.0 * e.group_centric_ms) << e.reason;
  EXPECT_GT(e.kv_centric_ms, 1.5 * e.group_centric_ms) << e.reason;
  EXPECT_NE(e.reason.find("group_centric"), std::string::npos);
}

// query16of32 (16 random blocks of 32 per query, G = 16): the executor merges each query's blocks in
// windows of 8 (about 4 pieces instead of 16 partials), which makes KV-centric the fastest schedule on
// the H200 (1.578-1.589 ms against Q-centric over the dense union, about 1.78); without merging it is
// not (1.858-1.868 ms). docs/notes/planner.md, merged slots.
TEST(Planner, MergedSlotsOnQuery16of32) {
  const auto p = shape(8, 4096, 4096, 16, 1, 128, false);
  const auto idx = make_lists(p, 16, 16, 0.0, 9, false);
  const sa::PlanEstimate e = sa::plan_schedule(sa::QueryLists{idx.view()}, p, sa::PartialPrecision::bf16);
  EXPECT_EQ(e.merge_window, 8);
  EXPECT_EQ(e.schedule, sa::Schedule::kv_centric) << e.reason;
  EXPECT_NEAR(e.kv_centric_ms, 1.50, 0.03) << e.reason;
  EXPECT_NE(e.reason.find("merge window 8"), std::string::npos) << e.reason;
  // About 4 pieces per query of 16 blocks.
  EXPECT_NEAR(double(e.stats.window_pieces[8]) / double(e.stats.queries), 4.0, 0.1);
  const sa::PlanEstimate off =
      sa::estimate_schedules(e.stats, p, sa::PartialPrecision::bf16, sa::CostModel{}, /*merge_window=*/1);
  EXPECT_EQ(off.merge_window, 1);
  EXPECT_NEAR(off.kv_centric_ms, 1.87, 0.03) << off.reason;
  EXPECT_EQ(off.schedule, sa::Schedule::q_centric) << off.reason;
  EXPECT_DOUBLE_EQ(off.q_centric_ms, e.q_centric_ms);
  try {
    sa::estimate_schedules(e.stats, p, sa::PartialPrecision::bf16, sa::CostModel{}, 9);
    ADD_FAILURE() << "merge_window 9 accepted";
  } catch (const sa::Error& err) {
    EXPECT_EQ(err.argument(), "merge_window") << err.what();
  }
}

// The group-centric kernel runs up to 256 query heads per KV head: past that it is never chosen.
TEST(Planner, GroupCentricLimits) {
  EXPECT_EQ(sa::group_centric_cta_queries(1), 16);
  EXPECT_EQ(sa::group_centric_cta_queries(16), 16);
  EXPECT_EQ(sa::group_centric_cta_queries(17), 8);
  EXPECT_EQ(sa::group_centric_cta_queries(48), 5);
  EXPECT_EQ(sa::group_centric_cta_queries(256), 1);
  EXPECT_EQ(sa::group_centric_cta_queries(257), 0);
  const auto p = shape(1, 64, 1024, 272, 1, 64, false);
  const auto idx = make_lists(p, 4, 4, 1.0, 3, false);
  const sa::PlanEstimate e = sa::plan_schedule(sa::QueryLists{idx.view()}, p);
  EXPECT_TRUE(std::isinf(e.group_centric_ms));
  EXPECT_NE(e.schedule, sa::Schedule::group_centric);
  EXPECT_GT(e.stats.group_ctas, 0);
}

TEST(Planner, CostModelMovesTheRightWay) {
  const auto p = shape(1, 1024, 16384, 8, 2, 128, false);
  // More overlap between neighbours shrinks the tile and CTA unions: Q-centric and group-centric get
  // cheaper, KV-centric (same blocks per query) stays put.
  double last_q = 1e300, last_g = 1e300, first_kv = -1.0;
  for (double keep : {0.0, 0.5, 0.9, 1.0}) {
    const auto idx = make_lists(p, 8, 8, keep, 21, false);
    const sa::PlanEstimate e = sa::plan_schedule(sa::QueryLists{idx.view()}, p);
    EXPECT_LT(e.q_centric_ms, last_q) << "keep " << keep << ": " << e.reason;
    last_q = e.q_centric_ms;
    EXPECT_LT(e.group_centric_ms, last_g) << "keep " << keep << ": " << e.reason;
    last_g = e.group_centric_ms;
    if (first_kv < 0) first_kv = e.kv_centric_ms;
    EXPECT_NEAR(e.kv_centric_ms, first_kv, 1e-9);
    // bf16 partials move half the bytes.
    const sa::PlanEstimate h = sa::estimate_schedules(e.stats, p, sa::PartialPrecision::bf16);
    EXPECT_LT(h.kv_centric_ms, e.kv_centric_ms);
    EXPECT_DOUBLE_EQ(h.q_centric_ms, e.q_centric_ms);
    EXPECT_DOUBLE_EQ(h.group_centric_ms, e.group_centric_ms);
    EXPECT_NE(e.reason.find(sa::schedule_name(e.schedule)), std::string::npos);
    // The choice is the smallest of the three estimates.
    const double best = std::min({e.q_centric_ms, e.kv_centric_ms, e.group_centric_ms});
    const double chosen = e.schedule == sa::Schedule::q_centric    ? e.q_centric_ms
                          : e.schedule == sa::Schedule::kv_centric ? e.kv_centric_ms
                                                                   : e.group_centric_ms;
    EXPECT_EQ(chosen, best) << e.reason;
  }
}

// The conversion runs on the device, one CTA per Q tile: Q-centric pays a launch and a cost per tile,
// and no longer a cost per list slot (the host conversion's).
TEST(Planner, QCentricChargesTheDeviceConversionPerTile) {
  const auto p = shape(2, 4096, 16384, 16, 1, 128, false);
  const auto idx = make_lists(p, 16, 16, 0.5, 31, false);
  const sa::SelectionStats st = sa::selection_stats(sa::QueryLists{idx.view()}, p);
  sa::CostModel m;
  m.q_fixed_us = 7.0;
  m.q_tile_ns = 40.0;
  const double base = sa::estimate_schedules(st, p, sa::PartialPrecision::f32, m).q_centric_ms;
  EXPECT_NEAR(base, 7e-3 + double(st.tiles) * 40e-6 + double(st.tile_union) * 16.0 * m.q_visit_ns_d128 * 1e-6, 1e-12);
  sa::SelectionStats more_slots = st;
  more_slots.list_slots *= 8;
  EXPECT_DOUBLE_EQ(sa::estimate_schedules(more_slots, p, sa::PartialPrecision::f32, m).q_centric_ms, base);
  sa::SelectionStats more_tiles = st;
  more_tiles.tiles += 1000;
  EXPECT_NEAR(sa::estimate_schedules(more_tiles, p, sa::PartialPrecision::f32, m).q_centric_ms - base, 1000 * 40e-6, 1e-12);
  // With the default constants the conversion is a small part of tile16's Q-centric time.
  const double conv = sa::CostModel{}.q_fixed_us * 1e-3 + double(st.tiles) * sa::CostModel{}.q_tile_ns * 1e-6;
  EXPECT_LT(conv, 0.2 * sa::estimate_schedules(st, p, sa::PartialPrecision::f32).q_centric_ms);
}

TEST(Planner, RejectsBadLists) {
  const auto p = shape(1, 200, 300, 2, 1, 64, false);
  auto idx = make_lists(p, 4, 2, 0.0, 9, false);
  idx.data<std::int32_t>()[130 * 4 + 2] = 3;  // Tk = 3
  try {
    sa::plan_schedule(sa::QueryLists{idx.view()}, p);
    FAIL() << "out-of-range id accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "lists.idx");
    EXPECT_NE(std::string(e.what()).find("[0, 0, 130, 2]"), std::string::npos) << e.what();
  }
  try {
    sa::selection_stats(sa::QueryLists{idx.view()}, p);
    FAIL() << "out-of-range id accepted";
  } catch (const sa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("3"), std::string::npos) << e.what();
  }
  sa::HostTensor wrong(sa::DType::f32, {1, 1, 200, 4});
  EXPECT_THROW(sa::selection_stats(sa::QueryLists{wrong.view()}, p), sa::Error);
  sa::HostTensor short_lists(sa::DType::i32, {1, 1, 199, 4});
  EXPECT_THROW(sa::selection_stats(sa::QueryLists{short_lists.view()}, p), sa::Error);
}

// plan() + run() on the CPU: the same bits as the one-call operator, reusable for new q, k, v; a run
// that disagrees with its plan is rejected.
TEST(QuerySparsePlan, CpuPlanRunMatchesOneCall) {
  for (bool causal : {false, true}) {
    const auto p = shape(2, 1013, 1000, 4, 1, 64, causal);
    const auto idx = make_lists(p, 5, 4, 0.3, causal ? 41 : 42);
    const sa::QueryLists lists{idx.view()};
    sa::QuerySparseOptions opt;
    opt.causal = causal;
    opt.partials = sa::PartialPrecision::bf16;
    auto k = st::random_tensor(sa::DType::bf16, {p.B, p.Lk, p.Hkv, p.D}, 2);
    auto v = st::random_tensor(sa::DType::bf16, {p.B, p.Lk, p.Hkv, p.D}, 3);
    auto q0 = st::random_tensor(sa::DType::bf16, {p.B, p.Lq, p.Hq, p.D}, 1);
    const sa::QuerySparsePlan plan = sa::query_sparse_plan(q0.view(), k.view(), v.view(), lists, sa::TensorView{}, opt);
    ASSERT_TRUE(plan.planned);
    for (std::uint64_t seed : {101u, 102u}) {
      auto q = st::random_tensor(sa::DType::bf16, {p.B, p.Lq, p.Hq, p.D}, seed);
      sa::HostTensor out1(sa::DType::bf16, {p.B, p.Lq, p.Hq, p.D}), out2 = out1;
      sa::HostTensor lse1(sa::DType::f32, {p.B, p.Hq, p.Lq}), lse2 = lse1;
      st::poison(out1), st::poison(out2), st::poison(lse1), st::poison(lse2);
      sa::query_sparse_run(plan, q.view(), k.view(), v.view(), out1.view(), lse1.view(), opt);
      sa::query_sparse(q.view(), k.view(), v.view(), lists, out2.view(), lse2.view(), opt);
      EXPECT_TRUE(st::all_finite(out1));
      EXPECT_EQ(0, std::memcmp(out1.view().data, out2.view().data, static_cast<std::size_t>(out1.numel()) * 2));
      EXPECT_EQ(0, std::memcmp(lse1.view().data, lse2.view().data, static_cast<std::size_t>(lse1.numel()) * 4));
      if (seed != 101u) continue;  // one float64 reference per case keeps the suite fast
      const st::Reference ref = st::reference_attention(q.view(), k.view(), v.view(), sa::Selection{lists}, p,
                                                        1.0 / std::sqrt(double(p.D)));
      EXPECT_LT(st::rel_err(out1, ref.out), 1e-2);
    }
    // Mismatches with the plan are errors naming the argument.
    sa::HostTensor out(sa::DType::bf16, {p.B, p.Lq, p.Hq, p.D});
    sa::QuerySparseOptions other = opt;
    other.causal = !causal;
    try {
      sa::query_sparse_run(plan, q0.view(), k.view(), v.view(), out.view(), std::nullopt, other);
      FAIL() << "causal mismatch accepted";
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), "options.causal");
    }
    other = opt;
    other.partials = sa::PartialPrecision::f32;
    EXPECT_THROW(sa::query_sparse_run(plan, q0.view(), k.view(), v.view(), out.view(), std::nullopt, other), sa::Error);
    other = opt;
    other.softmax_scale = 0.5f;
    EXPECT_THROW(sa::query_sparse_run(plan, q0.view(), k.view(), v.view(), out.view(), std::nullopt, other), sa::Error);
    auto k2 = st::random_tensor(sa::DType::bf16, {p.B, p.Lk + 1, p.Hkv, p.D}, 7);
    EXPECT_THROW(sa::query_sparse_run(plan, q0.view(), k2.view(), k2.view(), out.view(), std::nullopt, opt), sa::Error);
    EXPECT_THROW(sa::query_sparse_run(sa::QuerySparsePlan{}, q0.view(), k.view(), v.view(), out.view(), std::nullopt, opt),
                 sa::Error);
  }
}

// plan() / run() are the KV-centric schedule; the group-centric one has no plan step.
TEST(QuerySparsePlan, PlanRejectsGroupCentric) {
  const auto p = shape(1, 40, 300, 4, 1, 64, false);
  const auto idx = make_lists(p, 3, 2, 0.0, 4, false);
  const auto q = st::random_tensor(sa::DType::f32, {1, 40, 4, 64}, 1);
  const auto k = st::random_tensor(sa::DType::f32, {1, 300, 1, 64}, 2);
  sa::QuerySparseOptions opt;
  opt.schedule = sa::QuerySchedule::group_centric;
  try {
    sa::query_sparse_plan(q.view(), k.view(), k.view(), sa::QueryLists{idx.view()}, sa::TensorView{}, opt);
    FAIL() << "group_centric plan accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "options.schedule");
    EXPECT_NE(std::string(e.what()).find("group_centric"), std::string::npos) << e.what();
  }
}

TEST(QuerySparsePlan, CpuPlanValidatesLists) {
  const auto p = shape(1, 130, 256, 2, 1, 64, false);
  auto idx = make_lists(p, 3, 2, 0.0, 5, false);
  auto* d = idx.data<std::int32_t>();
  d[129 * 3 + 1] = d[129 * 3 + 0] >= 0 ? d[129 * 3 + 0] : 0;
  d[129 * 3 + 0] = d[129 * 3 + 1];  // a duplicate in the last query's row
  auto q = st::random_tensor(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}, 1);
  auto k = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 2);
  try {
    sa::query_sparse_plan(q.view(), k.view(), k.view(), sa::QueryLists{idx.view()}, sa::TensorView{});
    FAIL() << "duplicate accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "lists.idx");
    EXPECT_NE(std::string(e.what()).find("129"), std::string::npos) << e.what();
  }
  sa::HostTensor wrong(sa::DType::i32, {1, 2, p.Lq, 3});
  EXPECT_THROW(sa::query_sparse_plan(q.view(), k.view(), k.view(), sa::QueryLists{wrong.view()}, sa::TensorView{}),
               sa::Error);
}

}  // namespace
