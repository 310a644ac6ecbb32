// sparse-attn plan: builds per-query block lists with a chosen overlap between neighbouring queries,
// computes the planner's statistics (union per Q tile and per group-centric CTA, blocks per query,
// neighbour overlap) and prints the three schedules' estimated times and the choice, one line per
// overlap value, so a sweep shows where the crossovers lie.
#include "plan.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "sparse_attn/plan.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::cli {
namespace {

struct PlanConfig {
  std::int64_t batch = 8, heads = 16, kv_heads = 1, lq = 4096, lk = 4096, dim = 128, blocks = 16;
  std::vector<double> overlap{0.0};
  bool causal = false;
  std::string partials = "f32";
  int merge_window = 0;
  std::uint64_t seed = 1;
  std::string json;
};

// Query i keeps each block of query i - 1 with probability `keep` and draws the rest uniformly from
// the blocks not yet taken; keep = 1 gives every query of the sequence the same list.
HostTensor make_lists(const PlanConfig& c, const ProblemShape& p, double keep) {
  const std::int64_t per = std::min(c.blocks, p.Tk());
  HostTensor t(DType::i32, {p.B, p.Hkv, p.Lq, per});
  auto* d = t.data<std::int32_t>();
  Rng rng(c.seed);
  std::vector<std::int32_t> prev, pick;
  std::vector<char> taken(static_cast<std::size_t>(p.Tk()));
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg) {
    prev.clear();
    for (std::int64_t i = 0; i < p.Lq; ++i) {
      pick.clear();
      std::fill(taken.begin(), taken.end(), 0);
      for (std::int32_t j : prev)
        if (rng.uniform() < keep) pick.push_back(j), taken[static_cast<std::size_t>(j)] = 1;
      while (static_cast<std::int64_t>(pick.size()) < per) {
        const auto j = static_cast<std::int32_t>(rng.below(p.Tk()));
        if (!taken[static_cast<std::size_t>(j)]) pick.push_back(j), taken[static_cast<std::size_t>(j)] = 1;
      }
      std::copy(pick.begin(), pick.end(), d + (bg * p.Lq + i) * per);
      prev = pick;
    }
  }
  return t;
}

int run_plan(const PlanConfig& c) {
  if (c.heads % c.kv_heads != 0)
    throw CLI::ValidationError("--heads", fmt::format("--heads ({}) must be a multiple of --kv-heads ({})", c.heads, c.kv_heads));
  ProblemShape p;
  p.B = c.batch, p.Lq = c.lq, p.Lk = c.lk, p.Hq = c.heads, p.Hkv = c.kv_heads, p.D = c.dim, p.causal = c.causal;
  check_memory(4.0 * double(p.B * p.Hkv) * double(p.Lq) * double(std::min(c.blocks, p.Tk())),
               fmt::format("--batch {} x --kv-heads {} x --lq {} x --blocks {}", c.batch, c.kv_heads, c.lq, c.blocks));
  const PartialPrecision prec = c.partials == "bf16" ? PartialPrecision::bf16 : PartialPrecision::f32;
  fmt::print("plan {} blocks/query={} partials={} (cost model and the data behind its constants: docs/notes/planner.md)\n",
             p.describe(), c.blocks, c.partials);
  nlohmann::json rows = nlohmann::json::array();
  for (double keep : c.overlap) {
    const HostTensor idx = make_lists(c, p, keep);
    const PlanEstimate e = plan_schedule(QueryLists{idx.view()}, p, prec, CostModel{}, c.merge_window);
    const SelectionStats& s = e.stats;
    fmt::print("overlap {:.2f}: neighbour jaccard {:.3f}  union/tile {:7.1f}  union/CTA {:6.1f}  blocks/query {:5.1f}  "
               "q_centric {:8.3f} ms  kv_centric {:8.3f} ms (merge window {})  group_centric {:8.3f} ms  -> {}\n",
               keep, s.neighbour_overlap, s.union_per_tile, s.union_per_group_cta, s.blocks_per_query, e.q_centric_ms,
               e.kv_centric_ms, e.merge_window, e.group_centric_ms, schedule_name(e.schedule));
    rows.push_back({{"keep", keep},
                    {"neighbour_overlap", s.neighbour_overlap},
                    {"union_per_tile", s.union_per_tile},
                    {"max_tile_union", s.max_tile_union},
                    {"blocks_per_query", s.blocks_per_query},
                    {"union_utilisation", s.union_utilisation},
                    {"selected_pairs", s.selected_pairs},
                    {"q_centric_ms", e.q_centric_ms},
                    {"kv_centric_ms", e.kv_centric_ms},
                    {"merge_window", e.merge_window},
                    {"union_per_group_cta", s.union_per_group_cta},
                    {"group_centric_ms", std::isinf(e.group_centric_ms) ? nlohmann::json(nullptr)
                                                                        : nlohmann::json(e.group_centric_ms)},
                    {"schedule", schedule_name(e.schedule)}});
  }
  if (!c.json.empty()) {
    nlohmann::json j;
    j["shape"] = {{"B", p.B}, {"Lq", p.Lq}, {"Lk", p.Lk}, {"Hq", p.Hq}, {"Hkv", p.Hkv}, {"D", p.D}, {"causal", p.causal}};
    j["blocks_per_query"] = c.blocks;
    j["partials"] = c.partials;
    j["rows"] = rows;
    write_json(c.json, j);
  }
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto cfg = std::make_shared<PlanConfig>();
  auto* cmd = app.add_subcommand("plan", "Planner: Q-centric, KV-centric or group-centric for per-query lists, with its estimates");
  cmd->add_option("--batch", cfg->batch, "Batch size")->capture_default_str()->check(CLI::Range(1, 64));
  cmd->add_option("--heads", cfg->heads, "Query heads")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--kv-heads", cfg->kv_heads, "KV heads (divides --heads)")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--lq", cfg->lq, "Queries")->capture_default_str()->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_option("--lk", cfg->lk, "Keys")->capture_default_str()->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 22));
  cmd->add_option("--dim", cfg->dim, "Head dim")->capture_default_str()->check(CLI::IsMember({64, 128}));
  cmd->add_option("--blocks", cfg->blocks, "KV blocks per query")->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--overlap", cfg->overlap,
                  "Probability that a query keeps each block of its predecessor (one estimate per value)")
      ->capture_default_str()->check(finite_range(0.0, 1.0));
  cmd->add_flag("--causal", cfg->causal, "Causal mask (bottom-right aligned)");
  cmd->add_option("--partials", cfg->partials, "Partial output precision of the KV-centric schedule")
      ->capture_default_str()->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--merge-window", cfg->merge_window,
                  "KV-centric merge window in blocks (0: the executor's automatic choice, 1: off)")
      ->capture_default_str()
      ->check(CLI::Range(0, 8));
  cmd->add_option("--seed", cfg->seed, "Seed of the synthetic lists")->capture_default_str()->check(unsigned_integer());
  cmd->add_option("--json", cfg->json, "Write the estimates as JSON to this file");
  cmd->callback([cfg]() {
    try {
      if (!cfg->json.empty()) check_writable(cfg->json);
      run_plan(*cfg);
    } catch (const CLI::Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      fmt::print(stderr, "error: out of memory: the sizes the options ask for do not fit in this machine (std::bad_alloc)\n");
      throw CLI::RuntimeError(2);
    } catch (const std::exception& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace sparse_attn::cli
