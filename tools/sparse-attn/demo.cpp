// The demo workload is built so that a good selector has something to find:
//  - attention sinks: the first keys carry a direction every query shares;
//  - local bands: queries and keys carry a slowly rotating positional direction (sums of rotations
//    at several frequencies, as rotary embeddings do), so q_i . k_j peaks near j = i;
//  - needles: a run of 16 keys in one block far in the past carries a direction that every query
//    of one later Q tile (all heads of the group) shares, strongly enough to dominate those queries.
// Everything is a sum of orthonormal directions scaled to a target logit, plus noise, in bf16.
#include "demo.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "common.hpp"

namespace sparse_attn::cli {

namespace {

constexpr std::int64_t kDim = 128;
constexpr int kFrequencies = 8;       // rotation frequencies of the positional direction
constexpr std::int64_t kSinkKeys = 4;
constexpr std::int64_t kNeedleKeys = 16;
constexpr std::int64_t kNeedleMinGap = 4;  // blocks between a needle and the tile that looks for it
// Target logits (scaled scores) of each structure; the needle beats the band so that a missed
// needle costs its queries most of their attention mass.
constexpr double kSinkLogit = 5.0, kLocalLogit = 6.0, kNeedleLogit = 8.0, kNoise = 0.5;

struct Needle {
  std::int64_t b, g, tile, block, key_begin, key_end;
};

struct Workload {
  ProblemShape p;
  HostTensor q, k, v;
  std::vector<Needle> needles;
};

std::vector<std::vector<double>> orthonormal_basis(int count, std::int64_t dim, Rng& rng) {
  std::vector<std::vector<double>> basis;
  while (static_cast<int>(basis.size()) < count) {
    std::vector<double> x(static_cast<std::size_t>(dim));
    for (auto& e : x) e = rng.normal();
    for (const auto& u : basis) {
      double d = 0.0;
      for (std::int64_t i = 0; i < dim; ++i) d += x[i] * u[i];
      for (std::int64_t i = 0; i < dim; ++i) x[i] -= d * u[i];
    }
    double n = 0.0;
    for (double e : x) n += e * e;
    n = std::sqrt(n);
    if (n < 1e-6) continue;
    for (auto& e : x) e /= n;
    basis.push_back(std::move(x));
  }
  return basis;
}

/// First query of the evaluated tail: a Q tile boundary, so tile-indexed selections slice cleanly.
std::int64_t eval_start(const DemoConfig& c) {
  if (c.eval_queries <= 0 || c.eval_queries >= c.len) return 0;
  return (c.len - c.eval_queries) / kTileQ * kTileQ;
}

/// The view without its first `start` entries along `dim`.
TensorView drop_front(TensorView t, int dim, std::int64_t start) {
  t.data = static_cast<char*>(t.data) + start * t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
  t.shape[dim] -= start;
  return t;
}

/// The selection restricted to queries [start, Lq) (start on a Q tile boundary).
Selection drop_queries(const Selection& s, std::int64_t start) {
  struct Visitor {
    std::int64_t start;
    Selection operator()(const AllBlocks& a) const { return a; }
    Selection operator()(const TileLists& t) const {
      return TileLists{drop_front(t.idx, 2, start / kTileQ), drop_front(t.cnt, 2, start / kTileQ)};
    }
    Selection operator()(const BlockBits& b) const { return BlockBits{drop_front(b.bits, 2, start / kTileQ)}; }
    Selection operator()(const QueryLists& q) const { return QueryLists{drop_front(q.idx, 2, start)}; }
    Selection operator()(const TokenLists& t) const { return TokenLists{drop_front(t.idx, 2, start)}; }
  };
  return std::visit(Visitor{start}, s);
}

Workload make_workload(const DemoConfig& c) {
  Workload w;
  w.p = ProblemShape{c.batch, c.len, c.len, c.heads, c.kv_heads, kDim, true};
  const auto& p = w.p;
  Rng rng(c.seed * 0x9e3779b97f4a7c15ull + 1);

  // Needles first, so their directions can be counted.
  const std::int64_t Tq = p.Tq();
  // Needles go into the Q tiles whose quality is evaluated (the tail), so that a missed needle
  // shows in the kept mass as well as in the needle recall.
  const std::int64_t first_tile = std::max<std::int64_t>(kNeedleMinGap + 2, eval_start(c) / kTileQ);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t g = 0; g < p.Hkv; ++g) {
      std::vector<std::int64_t> tiles;
      for (std::int64_t t = first_tile; t < Tq; ++t) tiles.push_back(t);
      std::vector<std::int64_t> used_blocks;
      for (int n = 0; n < c.needles && !tiles.empty(); ++n) {
        const auto ti = rng.below(static_cast<std::int64_t>(tiles.size()));
        const std::int64_t tile = tiles[static_cast<std::size_t>(ti)];
        tiles.erase(tiles.begin() + ti);
        std::int64_t block = 0;
        for (int attempt = 0; attempt < 64 && (block == 0 || std::count(used_blocks.begin(), used_blocks.end(), block)); ++attempt)
          block = 1 + rng.below(tile - kNeedleMinGap);
        if (block == 0 || std::count(used_blocks.begin(), used_blocks.end(), block)) continue;
        used_blocks.push_back(block);
        const std::int64_t begin = block * kBlockK + kNeedleKeys * rng.below(kBlockK / kNeedleKeys);
        w.needles.push_back({b, g, tile, block, begin, begin + kNeedleKeys});
      }
    }

  // Directions: sink, 2 per frequency, then needles (reused cyclically if D runs out).
  const int fixed = 1 + 2 * kFrequencies;
  const int needle_dirs = std::min<int>(static_cast<int>(w.needles.size()), static_cast<int>(kDim) - fixed);
  const auto basis = orthonormal_basis(fixed + needle_dirs, kDim, rng);
  const double scale = 1.0 / std::sqrt(double(kDim));
  const double sink_amp = std::sqrt(kSinkLogit / scale);
  const double local_amp = std::sqrt(kLocalLogit / (kFrequencies * scale));
  const double needle_amp = std::sqrt(kNeedleLogit / scale);
  std::vector<double> omega(kFrequencies);
  for (int f = 0; f < kFrequencies; ++f)
    omega[f] = 2.0 * M_PI / (64.0 * std::pow(2048.0 / 64.0, double(f) / (kFrequencies - 1)));
  std::vector<double> head_amp(static_cast<std::size_t>(p.Hq));
  for (auto& a : head_amp) a = 0.8 + 0.4 * rng.uniform();

  auto positional = [&](std::int64_t pos, double amp, std::vector<double>& x) {
    for (int f = 0; f < kFrequencies; ++f) {
      const double cs = amp * std::cos(omega[f] * double(pos)), sn = amp * std::sin(omega[f] * double(pos));
      for (std::int64_t d = 0; d < kDim; ++d) x[d] += cs * basis[1 + 2 * f][d] + sn * basis[2 + 2 * f][d];
    }
  };
  auto add = [&](std::vector<double>& x, int dir, double amp) {
    for (std::int64_t d = 0; d < kDim; ++d) x[d] += amp * basis[static_cast<std::size_t>(dir)][d];
  };
  auto store = [](HostTensor& t, std::int64_t offset, const std::vector<double>& x) {
    auto* dst = t.data<std::uint16_t>() + offset;
    for (std::size_t d = 0; d < x.size(); ++d) dst[d] = float_to_bf16(static_cast<float>(x[d]));
  };
  auto needle_dir = [&](std::size_t n) { return fixed + static_cast<int>(n % static_cast<std::size_t>(needle_dirs)); };

  w.q = HostTensor(DType::bf16, {p.B, p.Lq, p.Hq, kDim});
  w.k = HostTensor(DType::bf16, {p.B, p.Lk, p.Hkv, kDim});
  w.v = HostTensor(DType::bf16, {p.B, p.Lk, p.Hkv, kDim});
  std::vector<double> x(static_cast<std::size_t>(kDim));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t i = 0; i < p.Lq; ++i)
      for (std::int64_t h = 0; h < p.Hq; ++h) {
        for (auto& e : x) e = kNoise * rng.normal();
        add(x, 0, sink_amp);
        positional(i, local_amp * head_amp[h], x);
        for (std::size_t n = 0; n < w.needles.size(); ++n) {
          const auto& nd = w.needles[n];
          if (nd.b == b && nd.g == h / p.group_size() && i / kTileQ == nd.tile) add(x, needle_dir(n), needle_amp);
        }
        store(w.q, ((b * p.Lq + i) * p.Hq + h) * kDim, x);
      }
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t j = 0; j < p.Lk; ++j)
      for (std::int64_t g = 0; g < p.Hkv; ++g) {
        for (auto& e : x) e = kNoise * rng.normal();
        if (j < kSinkKeys) add(x, 0, sink_amp);
        positional(j, local_amp, x);
        for (std::size_t n = 0; n < w.needles.size(); ++n) {
          const auto& nd = w.needles[n];
          if (nd.b == b && nd.g == g && j >= nd.key_begin && j < nd.key_end) add(x, needle_dir(n), needle_amp);
        }
        store(w.k, ((b * p.Lk + j) * p.Hkv + g) * kDim, x);
        for (auto& e : x) e = rng.normal();
        store(w.v, ((b * p.Lk + j) * p.Hkv + g) * kDim, x);
      }
  return w;
}

/// Fraction of (needle query head, query, planted key) triples the selection keeps.
double needle_recall(const Selection& s, const Workload& w) {
  if (w.needles.empty()) return NAN;
  const auto& p = w.p;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(p.Lk));
  std::int64_t kept = 0, total = 0;
  for (const auto& nd : w.needles)
    for (std::int64_t h = nd.g * p.group_size(); h < (nd.g + 1) * p.group_size(); ++h)
      for (std::int64_t i = nd.tile * kTileQ; i < std::min(p.Lq, (nd.tile + 1) * kTileQ); ++i) {
        selection_row(s, p, nd.b, h, i, row.data());
        for (std::int64_t j = nd.key_begin; j < nd.key_end; ++j) kept += row[static_cast<std::size_t>(j)];
        total += nd.key_end - nd.key_begin;
      }
  return double(kept) / double(total);
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
};

// bf16 outputs carry a relative rounding error near 2^-9 on both sides of the comparison.
constexpr double kConsistencyAbs = 1e-2, kConsistencyRel = 0.05;

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
  Workload w = make_workload(c);
  const auto& p = w.p;
  fmt::print("workload: {} with {} attention sinks, local bands and {} planted needles; budget {} blocks per tile\n",
             p.describe(), kSinkKeys, w.needles.size(), c.budget);

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
  Mirrored light_w(DType::f32, {p.B, p.Lq, p.Hq}, where), light_k(DType::bf16, {p.B, p.Lk, p.D}, where);
  std::fill_n(light_w.host().data<float>(), light_w.host().numel(), 1.0f / float(p.Hq));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t j = 0; j < p.Lk; ++j)
      for (std::int64_t d = 0; d < p.D; ++d) {
        double s = 0.0;
        for (std::int64_t g = 0; g < p.Hkv; ++g) s += bf16_to_float(w.k.data<std::uint16_t>()[((b * p.Lk + j) * p.Hkv + g) * p.D + d]);
        light_k.host().data<std::uint16_t>()[(b * p.Lk + j) * p.D + d] = float_to_bf16(float(s / double(p.Hkv)));
      }

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
    o.quality = evaluate_selection(drop_front(q.view(false), 1, start), k.view(false), v.view(false),
                                   drop_queries(host_sel, start), qopt);
    o.finite = all_finite(out.host().view());
    o.out_err = relative_error(drop_front(out.host().view(), 1, start), drop_front(dense_out.host().view(), 1, start));
    o.needles = needle_recall(host_sel, w);
    o.consistent = std::abs(o.out_err - o.quality.out_rel_err) <= kConsistencyAbs + kConsistencyRel * o.quality.out_rel_err;
    results.push_back(std::move(o));
  }

  // ---- report
  fmt::print("\n{:<18} {:<10} {:<12} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10}  {}\n", "method", "selection",
             "executor", "mass mean", "mass min", "out err", "tok sp", "blk sp", "needles", "select ms", "exec ms",
             "ran on (selector / executor)");
  bool all_ok = true;
  for (const auto& o : results) {
    all_ok = all_ok && o.finite && o.consistent;
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
                          {"executor_consistent_with_selection", o.consistent}};
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
  return 0;
}

}  // namespace sparse_attn::cli
