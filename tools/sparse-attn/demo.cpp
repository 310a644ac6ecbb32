// The demo runs every selector in front of the executor its format suits, on the structured
// synthetic workload of workload.hpp (sinks, local bands, planted needles), and measures quality
// against dense attention on a tail of the queries.
#include "demo.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "common.hpp"
#include "workload.hpp"

namespace sparse_attn::cli {

namespace {

constexpr std::int64_t kDim = kSyntheticDim;

/// First query of the evaluated tail: a Q tile boundary, so tile-indexed selections slice cleanly.
std::int64_t eval_start(const DemoConfig& c) { return tail_start(c.len, c.eval_queries); }

SyntheticWorkload make_workload(const DemoConfig& c) {
  // Needles go into the Q tiles whose quality is evaluated (the tail), so that a missed needle
  // shows in the kept mass as well as in the needle recall.
  return make_synthetic_workload({c.seed, c.batch, c.len, c.heads, c.kv_heads, c.needles, eval_start(c)});
}

struct Outcome {
  std::string method, format, executor;
  std::string selector_on, executor_on;
  double select_ms = 0.0, exec_ms = 0.0;
  QualityReport quality;
  double out_err = 0.0;   // executor output vs the dense executor's output
  double needles = NAN;
  bool finite = true;
  // The executor's error against the dense executor must match the float64 error of the selection
  // itself (evaluate_selection) up to bf16 rounding; otherwise the executor is wrong.
  bool consistent = true;
  // A selector that ran on the device is run again on the CPU (the float64 oracle): the mean kept mass
  // of the oracle's selection, and whether the device selection keeps the same within kMassGap.
  double oracle_mass = NAN;
  bool mass_matches_oracle = true;
};

// bf16 outputs carry a relative rounding error near 2^-9 on both sides of the comparison.
constexpr double kConsistencyAbs = 1e-2, kConsistencyRel = 0.05;
// The device selectors' contract (docs/design.md §5.7): a top-k of the exact scores up to a bound ε, so
// their selection may differ from the CPU's float64 one at near-ties, which hold almost no mass: the
// mean kept mass must agree within 0.1 % (absolute).
constexpr double kMassGap = 1e-3;

/// Runs `op(on_device)` on the device when asked, falling back to the CPU only for operators that
/// have no CUDA implementation; `before_cpu` moves inputs to the host first. Returns the time of
/// the measured call and where it ran. On the device a first, untimed call absorbs one-off costs.
struct Ran {
  double ms;
  bool on_device;
  std::string label;
};

Ran run_placed(bool want_device, const std::function<void(bool)>& op, const std::function<void()>& before_cpu) {
  if (want_device) {
    try {
      op(true);
      return {time_ms(true, [&] { op(true); }), true, "cuda"};
    } catch (const Error& e) {
      if (!is_missing_implementation(e)) throw;
    }
    before_cpu();
    return {time_ms(false, [&] { op(false); }), false, kCpuFallbackNote};
  }
  return {time_ms(false, [&] { op(false); }), false, "cpu"};
}

std::string pct(double x) { return std::isnan(x) ? "-" : fmt::format("{:.1f}%", 100.0 * x); }

}  // namespace

int run_demo(const DemoConfig& c) {
  if (c.heads % c.kv_heads != 0)
    throw std::runtime_error(fmt::format("--heads ({}) must be a multiple of --kv-heads ({})", c.heads, c.kv_heads));
  if (!c.json.empty()) check_writable(c.json);
  const Placement where = Placement::choose(c.device);
  const bool dev = where.cuda;
  fmt::print("{}\n", where.banner());

  progress("building the workload (B={}, Hq={}, Hkv={}, L={}, D={}, causal, bf16, seed {})", c.batch, c.heads,
           c.kv_heads, c.len, kDim, c.seed);
  SyntheticWorkload w = make_workload(c);
  const auto& p = w.p;
  fmt::print("workload: {} with {} attention sinks, local bands and {} planted needles; budget {} blocks per tile\n",
             p.describe(), kSyntheticSinkKeys, w.needles.size(), c.budget);

  Mirrored q(w.q, where), k(w.k, where), v(w.v, where);
  const std::vector<std::int64_t> out_shape{p.B, p.Lq, p.Hq, p.D};
  AttentionOptions attn;
  attn.causal = true;
  QualityOptions qopt;
  qopt.causal = true;
  const std::int64_t Tq = p.Tq();
  const std::int64_t start = eval_start(c);
  if (start > 0)
    fmt::print("quality is measured on the last {} queries (the longest contexts; --eval-queries 0 for all)\n",
               p.Lq - start);

  std::vector<Outcome> results;
  auto no_op = [] {};

  // ---- dense baseline
  progress("dense attention (baseline)");
  Mirrored dense_out(DType::bf16, out_shape, where);
  dense_out.poison();
  const Ran dense_ran = run_placed(
      dev, [&](bool d) { dense(q.view(d), k.view(d), v.view(d), dense_out.view(d), std::nullopt, attn); }, no_op);
  if (dense_ran.on_device) dense_out.download();
  {
    Outcome o{"dense", "all blocks", "dense", "-", dense_ran.label, 0.0, dense_ran.ms, {}, 0.0, 1.0, true};
    o.quality.kept_mass_mean = o.quality.kept_mass_min = 1.0;
    o.finite = all_finite(dense_out.host().view());
    if (w.needles.empty()) o.needles = NAN;
    results.push_back(o);
  }

  // ---- sparse methods: each is a selector writing some buffers and an executor reading them
  struct Method {
    std::string name, format, executor;
    std::vector<Mirrored*> selection_buffers;
    std::function<void(bool)> select;
    std::function<Selection(bool)> selection;
    std::function<void(bool, const TensorView&)> execute;
  };

  const std::int64_t gs = p.group_size();
  // Index vectors of token_max: q and k of the first query head of each group (a strided view of q).
  auto index_q = [&](bool d) {
    TensorView t = q.view(d);
    t.shape[2] = p.Hkv;
    t.stride[2] *= gs;
    return t;
  };

  Mirrored r1_idx(DType::i32, {p.B, p.Hkv, Tq, c.budget}, where), r1_cnt(DType::i32, {p.B, p.Hkv, Tq}, where);
  Mirrored r4_idx(DType::i32, {p.B, p.Hkv, Tq, c.budget}, where), r4_cnt(DType::i32, {p.B, p.Hkv, Tq}, where);
  const IndexPrecision precisions[] = {IndexPrecision::bf16, IndexPrecision::fp8_e4m3, IndexPrecision::fp4_e2m1};
  std::vector<Mirrored> tm_lists, tm_tidx, tm_tcnt;
  for (int i = 0; i < 3; ++i) {
    tm_lists.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Lq, c.budget}, where);
    tm_tidx.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, Tq, c.budget}, where);
    tm_tcnt.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, Tq}, where);
  }
  const std::int64_t top_tokens = std::min<std::int64_t>(std::int64_t(c.budget) * kBlockK, p.Lk);
  Mirrored tokens(DType::i32, {p.B, p.Hkv, p.Lq, top_tokens}, where);
  // Lightning scores every query head against one index key per position: the mean of the KV
  // heads, with equal head weights.
  Mirrored light_w(DType::f32, {p.B, p.Lq, p.Hq}, where), light_k(mean_kv_heads(w.k.view()), where);
  std::fill_n(light_w.host().data<float>(), light_w.host().numel(), 1.0f / float(p.Hq));

  // The closures below hold buffers by pointer: they outlive the helper calls that create them.
  auto tile_exec = [&](Mirrored* idx, Mirrored* cnt) {
    return [&, idx, cnt](bool d, const TensorView& out) {
      tile_sparse(q.view(d), k.view(d), v.view(d), TileLists{idx->view(d), cnt->view(d)}, out, std::nullopt, attn);
    };
  };
  auto tile_sel = [](Mirrored* idx, Mirrored* cnt) {
    return [idx, cnt](bool d) -> Selection { return TileLists{idx->view(d), cnt->view(d)}; };
  };
  auto pooled = [&](int r, Mirrored* idx, Mirrored* cnt) {
    PooledOptions o;
    o.representatives = r;
    o.top_k = c.budget;
    o.force_local = true;
    o.force_block0 = true;
    o.causal = true;
    return [&, o, idx, cnt](bool d) { pooled_select(q.view(d), k.view(d), TileLists{idx->view(d), cnt->view(d)}, o); };
  };

  std::vector<Method> methods;
  methods.push_back({"pooled R1", "TileLists", "tile_sparse", {&r1_idx, &r1_cnt}, pooled(1, &r1_idx, &r1_cnt),
                     tile_sel(&r1_idx, &r1_cnt), tile_exec(&r1_idx, &r1_cnt)});
  methods.push_back({"pooled R4", "TileLists", "tile_sparse", {&r4_idx, &r4_cnt}, pooled(4, &r4_idx, &r4_cnt),
                     tile_sel(&r4_idx, &r4_cnt), tile_exec(&r4_idx, &r4_cnt)});
  for (int i = 0; i < 3; ++i) {
    TokenMaxOptions o;
    o.top_k = c.budget;
    o.precision = precisions[i];
    o.causal = true;
    o.reserve_local = true;
    Mirrored* lists = &tm_lists[static_cast<std::size_t>(i)];
    methods.push_back({fmt::format("token_max {}", precision_name(precisions[i])), "QueryLists", "query_sparse",
                       {lists},
                       [&, o, lists](bool d) { token_max_select(index_q(d), k.view(d), QueryLists{lists->view(d)}, o); },
                       [lists](bool d) -> Selection { return QueryLists{lists->view(d)}; },
                       [&, lists](bool d, const TensorView& out) {
                         query_sparse(q.view(d), k.view(d), v.view(d), QueryLists{lists->view(d)}, out, std::nullopt,
                                      QuerySparseOptions{attn});
                       }});
  }
  for (int i = 0; i < 3; ++i) {
    TokenMaxOptions o;
    o.top_k = c.budget;
    o.precision = precisions[i];
    o.causal = true;
    o.reserve_local = true;
    Mirrored* idx = &tm_tidx[static_cast<std::size_t>(i)];
    Mirrored* cnt = &tm_tcnt[static_cast<std::size_t>(i)];
    methods.push_back({fmt::format("token_max {}", precision_name(precisions[i])), "TileLists", "tile_sparse",
                       {idx, cnt},
                       [&, o, idx, cnt](bool d) {
                         token_max_select(index_q(d), k.view(d), TileLists{idx->view(d), cnt->view(d)}, o);
                       },
                       tile_sel(idx, cnt), tile_exec(idx, cnt)});
  }
  {
    LightningOptions o;
    o.top_k = static_cast<int>(top_tokens);
    o.causal = true;
    o.precision = IndexPrecision::fp8_e4m3;
    methods.push_back({"lightning fp8", "TokenLists", "token_sparse", {&tokens},
                       [&, o](bool d) { lightning_select(q.view(d), light_w.view(d), light_k.view(d), TokenLists{tokens.view(d)}, o); },
                       [&](bool d) -> Selection { return TokenLists{tokens.view(d)}; },
                       [&](bool d, const TensorView& out) {
                         token_sparse(q.view(d), k.view(d), v.view(d), TokenLists{tokens.view(d)}, out, std::nullopt, attn);
                       }});
  }

  Mirrored out(DType::bf16, out_shape, where);
  int step = 0;
  for (auto& m : methods) {
    ++step;
    const std::string title = fmt::format("[{}/{}] {} -> {} -> {}", step, methods.size(), m.name, m.format, m.executor);
    progress("{}: selecting", title);
    for (auto* b : m.selection_buffers) b->poison();
    const Ran sel = run_placed(dev, m.select, no_op);
    if (sel.on_device)
      for (auto* b : m.selection_buffers) b->download();
    else if (dev)
      for (auto* b : m.selection_buffers) b->upload();

    progress("{}: executing", title);
    out.poison();
    const Ran ex = run_placed(dev, [&](bool d) { m.execute(d, out.view(d)); }, no_op);
    if (ex.on_device) out.download();

    progress("{}: evaluating against dense attention (float64)", title);
    Outcome o;
    o.method = m.name;
    o.format = m.format;
    o.executor = m.executor;
    o.selector_on = sel.label;
    o.executor_on = ex.label;
    o.select_ms = sel.ms;
    o.exec_ms = ex.ms;
    const Selection host_sel = m.selection(false);
    // Queries [start, Lq) with all keys keep their causal alignment: Lk - Lq' = start.
    const auto quality = [&](const Selection& s) {
      return evaluate_selection(drop_front(q.view(false), 1, start), k.view(false), v.view(false),
                                drop_queries(s, start), qopt);
    };
    o.quality = quality(host_sel);
    o.finite = all_finite(out.host().view());
    o.out_err = relative_error(drop_front(out.host().view(), 1, start), drop_front(dense_out.host().view(), 1, start));
    o.needles = needle_recall(host_sel, p, w.needles);
    o.consistent = std::abs(o.out_err - o.quality.out_rel_err) <= kConsistencyAbs + kConsistencyRel * o.quality.out_rel_err;
    if (sel.on_device) {
      progress("{}: the same selector on the CPU (float64 oracle)", title);
      m.select(false);  // overwrites the host copies of the device's lists, which are no longer needed
      o.oracle_mass = quality(m.selection(false)).kept_mass_mean;
      o.mass_matches_oracle = std::abs(o.quality.kept_mass_mean - o.oracle_mass) <= kMassGap;
    }
    results.push_back(std::move(o));
  }

  // ---- report
  fmt::print("\n{:<18} {:<10} {:<12} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10}  {}\n", "method", "selection",
             "executor", "mass mean", "mass min", "out err", "tok sp", "blk sp", "needles", "select ms", "exec ms",
             "ran on (selector / executor)");
  bool all_ok = true, masses_ok = true;
  for (const auto& o : results) {
    all_ok = all_ok && o.finite && o.consistent;
    masses_ok = masses_ok && o.mass_matches_oracle;
    fmt::print("{:<18} {:<10} {:<12} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10.2f}  {} / {}{}{}\n", o.method, o.format,
               o.executor, pct(o.quality.kept_mass_mean), pct(o.quality.kept_mass_min),
               o.method == "dense" ? "-" : fmt::format("{:.2e}", o.out_err), pct(o.quality.token_sparsity),
               pct(o.quality.block_sparsity), pct(o.needles),
               o.method == "dense" ? "-" : fmt::format("{:.2f}", o.select_ms), o.exec_ms, o.selector_on, o.executor_on,
               o.finite ? "" : "  OUTPUT NOT FINITE",
               o.consistent ? "" : fmt::format("  EXECUTOR MISMATCH: float64 error of the selection is {:.2e}", o.quality.out_rel_err));
  }
  fmt::print(
      "\nmass: fraction of each query's dense softmax mass on its selected keys (mean, worst query); out err: "
      "||out - dense|| / ||dense|| of the executor's output; tok sp / blk sp: visible (query, key) pairs / (tile, "
      "block) tiles left out{}; needles: planted needle keys selected by their queries.\n",
      start > 0 ? fmt::format(" (these five over queries {}..{})", start, p.Lq - 1) : std::string());
  bool any_oracle = false;
  for (const auto& o : results) any_oracle = any_oracle || !std::isnan(o.oracle_mass);
  if (any_oracle) {
    fmt::print("\nselectors on the device against the CPU's float64 oracle (mean kept mass; must agree within {:.1f} %):\n",
               100.0 * kMassGap);
    for (const auto& o : results)
      if (!std::isnan(o.oracle_mass))
        fmt::print("  {:<18} {:<10} device {:>9}  oracle {:>9}  gap {:+.4f} %{}\n", o.method, o.format,
                   pct(o.quality.kept_mass_mean), pct(o.oracle_mass), 100.0 * (o.quality.kept_mass_mean - o.oracle_mass),
                   o.mass_matches_oracle ? "" : "  MASS DIFFERS FROM THE ORACLE");
  }

  if (!c.json.empty()) {
    nlohmann::json j = build_json(where);
    j["command"] = "demo";
    j["config"] = {{"seed", c.seed}, {"batch", p.B}, {"len", p.Lq}, {"heads", p.Hq}, {"kv_heads", p.Hkv}, {"dim", p.D},
                   {"causal", true}, {"dtype", "bf16"}, {"budget_blocks", c.budget}, {"eval_first_query", start}, {"lightning_tokens", top_tokens}};
    for (const auto& nd : w.needles)
      j["needles"].push_back({{"b", nd.b}, {"group", nd.g}, {"q_tile", nd.tile}, {"kv_block", nd.block},
                              {"keys", {nd.key_begin, nd.key_end}}});
    for (const auto& o : results) {
      nlohmann::json r = {{"method", o.method},
                          {"selection", o.format},
                          {"executor", o.executor},
                          {"selector_device", o.selector_on},
                          {"executor_device", o.executor_on},
                          {"select_ms", o.select_ms},
                          {"exec_ms", o.exec_ms},
                          {"kept_mass_mean", o.quality.kept_mass_mean},
                          {"kept_mass_min", o.quality.kept_mass_min},
                          {"out_rel_err_vs_dense_executor", o.out_err},
                          {"out_rel_err_selection_float64", o.quality.out_rel_err},
                          {"token_sparsity", o.quality.token_sparsity},
                          {"block_sparsity", o.quality.block_sparsity},
                          {"selected_pairs", o.quality.selected_pairs},
                          {"visible_pairs", o.quality.visible_pairs},
                          {"kept_mass_mean_per_head", o.quality.kept_mass_mean_per_head},
                          {"output_finite", o.finite},
                          {"executor_consistent_with_selection", o.consistent},
                          {"selector_mass_matches_cpu_oracle", o.mass_matches_oracle}};
      r["kept_mass_mean_cpu_oracle"] = std::isnan(o.oracle_mass) ? nlohmann::json(nullptr) : nlohmann::json(o.oracle_mass);
      r["needle_recall"] = std::isnan(o.needles) ? nlohmann::json(nullptr) : nlohmann::json(o.needles);
      j["results"].push_back(std::move(r));
    }
    write_json(c.json, j);
    progress("wrote {}", c.json);
  }
  if (!all_ok) {
    fmt::print(stderr, "error: an executor left non-finite values in its output or disagrees with its selection\n");
    return 1;
  }
  if (!masses_ok) {
    fmt::print(stderr, "error: a device selector's kept mass differs from the CPU oracle's by more than {:.1f} %\n",
               100.0 * kMassGap);
    return 1;
  }
  return 0;
}

}  // namespace sparse_attn::cli
