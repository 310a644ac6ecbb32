// Each case: fresh random bf16 inputs and selection -> one poisoned run checked in full for finite
// values and on sampled rows against a float64 reference -> `repeat` timed runs. A case whose check
// fails is not timed, and the program exits non-zero.
//
// The full docs/design.md §7 shapes are sized for an H200. On the CPU, --scale s (default 4, 8 or 16) divides the
// batch (at least 1), the lengths and the per-tile / per-query block counts (at least 1) by s, which
// keeps each workload's density while cutting its work by about s^2.
#include "bench.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>

#include "common.hpp"
#include "core/cpu.hpp"
#ifdef SPARSE_ATTN_WITH_CUDA
#include "cuda/query_sparse/backend.hpp"
#endif

namespace sparse_attn::cli {

void add_bench_options(CLI::App& app, BenchConfig& c) {
  app.add_option("workload", c.workload, "tile16, pipeline, dense, query16of32, query-long, gated or entmax")
      ->required()
      ->check(CLI::IsMember({"tile16", "pipeline", "dense", "query16of32", "query-long", "gated", "entmax"}));
  app.add_option("--pattern", c.pattern, "tile16: 'independent' lists, or 'pairs' of Q tiles sharing one list")
      ->capture_default_str()
      ->check(CLI::IsMember({"independent", "pairs"}));
  app.add_option("--lk", c.lk, "Key lengths at full scale (tile16: Lk; other workloads: L), e.g. --lk 4096 16384")
      ->check(CLI::Range(std::int64_t{128}, std::int64_t{1} << 22));
  app.add_option("--repeat", c.repeat, "Timed runs per case (default: 5 on the GPU, 2 on the CPU)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--sustain-ms", c.sustain_ms,
                 "Make each timed run at least this many ms of back-to-back calls and report the mean per call "
                 "(a GPU at its power limit lowers its clock within tens of ms; default 0: one call per run)")
      ->check(finite_range(0.0, 60000.0));
  app.add_option("--scale", c.scale, "Divide batch, lengths and block counts by this (default: 1 on the GPU; on the CPU 4, gated 16, entmax 8)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--density", c.densities, "gated: target block densities, one gated (and tile_sparse) case each")
      ->capture_default_str()
      ->check(finite_range(0.0, 1.0));
  app.add_option("--partials", c.partials,
                 "query16of32 / query-long: precision of the KV-centric partial outputs, f32, bf16 or both (one case each)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16", "both"}));
  app.add_option("--verify-rows", c.verify_rows, "Sampled (batch, query, head) rows checked per case")
      ->capture_default_str()
      ->check(CLI::Range(8, 100000));
  app.add_option("--seed", c.seed, "Seed of the random inputs and selections")->capture_default_str()->check(unsigned_integer());
  app.add_option("--device", c.device, "auto, cpu or cuda")->capture_default_str()->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--json", c.json, "Write the results as JSON to this file");
}

namespace {

// bf16 outputs: rounding alone gives a relative error near 2^-9; twice a plain bf16 implementation's
// error plus headroom.
constexpr double kRelErrBound = 8e-3;
constexpr double kMaxAbsBound = 3e-2;
// A gated block whose max lies this close to its threshold may go either way between implementations.
constexpr double kGateAmbiguity = 1e-3;

// CPU defaults that finish in a minute or a few on 2 cores: the gate computes every block's scores
// and the entmax passes are several, so those two are cut further.
int default_scale(const std::string& workload, bool cuda) {
  if (cuda) return 1;
  if (workload == "gated") return 16;
  if (workload == "entmax") return 8;
  return 4;
}

HostTensor random_bf16(std::vector<std::int64_t> shape, Rng& rng) {
  HostTensor t(DType::bf16, std::move(shape));
  auto* p = t.data<std::uint16_t>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = float_to_bf16(static_cast<float>(rng.normal()));
  return t;
}

std::vector<float> row_of(const TensorView& t, std::int64_t b, std::int64_t l, std::int64_t h) {
  std::vector<float> r(static_cast<std::size_t>(t.shape[3]));
  detail::load_bhld(t, b, l, h, r.data());
  return r;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (std::size_t d = 0; d < a.size(); ++d) s += double(a[d]) * double(b[d]);
  return s;
}

struct Inputs {
  ProblemShape p;
  Mirrored q, k, v, out;
};

Inputs make_inputs(const ProblemShape& p, const Placement& where, Rng& rng) {
  return Inputs{p, Mirrored(random_bf16({p.B, p.Lq, p.Hq, p.D}, rng), where),
                Mirrored(random_bf16({p.B, p.Lk, p.Hkv, p.D}, rng), where),
                Mirrored(random_bf16({p.B, p.Lk, p.Hkv, p.D}, rng), where),
                Mirrored(DType::bf16, {p.B, p.Lq, p.Hq, p.D}, where)};
}

/// Output row of attention with weights w over keys (already normalised), in float64.
std::vector<double> weighted_sum(const Inputs& in, std::int64_t b, std::int64_t g, const std::vector<double>& w) {
  std::vector<double> out(static_cast<std::size_t>(in.p.D), 0.0);
  for (std::int64_t j = 0; j < in.p.Lk; ++j) {
    if (w[static_cast<std::size_t>(j)] == 0.0) continue;
    const auto vr = row_of(in.v.host().view(), b, j, g);
    for (std::int64_t d = 0; d < in.p.D; ++d) out[d] += w[static_cast<std::size_t>(j)] * vr[d];
  }
  return out;
}

std::vector<double> scaled_scores(const Inputs& in, std::int64_t b, std::int64_t i, std::int64_t h) {
  const auto& p = in.p;
  const double scale = 1.0 / std::sqrt(double(p.D));
  const auto qr = row_of(in.q.host().view(), b, i, h);
  std::vector<double> z(static_cast<std::size_t>(p.Lk));
  for (std::int64_t j = 0; j < p.Lk; ++j) z[j] = scale * dot(qr, row_of(in.k.host().view(), b, j, h / p.group_size()));
  return z;
}

/// Softmax attention of one query row over the keys where mask[j] != 0.
std::vector<double> softmax_row(const Inputs& in, std::int64_t b, std::int64_t i, std::int64_t h,
                                const std::vector<std::uint8_t>& mask) {
  const auto z = scaled_scores(in, b, i, h);
  double m = -INFINITY;
  for (std::size_t j = 0; j < z.size(); ++j)
    if (mask[j]) m = std::max(m, z[j]);
  std::vector<double> w(z.size(), 0.0);
  if (m == -INFINITY) return std::vector<double>(static_cast<std::size_t>(in.p.D), 0.0);
  double den = 0.0;
  for (std::size_t j = 0; j < z.size(); ++j)
    if (mask[j]) den += (w[j] = std::exp(z[j] - m));
  for (auto& x : w) x /= den;
  return weighted_sum(in, b, h / in.p.group_size(), w);
}

using RowReference = std::function<std::optional<std::vector<double>>(std::int64_t b, std::int64_t i, std::int64_t h)>;

RowReference selection_reference(const Inputs& in, Selection sel) {
  return [&in, sel](std::int64_t b, std::int64_t i, std::int64_t h) -> std::optional<std::vector<double>> {
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(in.p.Lk));
    selection_row(sel, in.p, b, h, i, mask.data());
    return softmax_row(in, b, i, h, mask);
  };
}

/// Useful (query head, query, key) triples of a block selection: selected and visible.
double selected_pairs(const Selection& sel, const ProblemShape& p) {
  double total = 0.0;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(p.Lk));
  // Rows of one group share their selection except for causal visibility; count per query.
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h) {
      if (std::holds_alternative<QueryLists>(sel) || std::holds_alternative<TokenLists>(sel) || p.causal ||
          std::holds_alternative<AllBlocks>(sel)) {
        if (std::holds_alternative<AllBlocks>(sel)) {
          total += double(p.visible_pairs());
          continue;
        }
        for (std::int64_t i = 0; i < p.Lq; ++i) {
          selection_row(sel, p, b, h, i, row.data());
          total += double(std::count(row.begin(), row.end(), std::uint8_t{1}));
        }
      } else {
        for (std::int64_t t = 0; t < p.Tq(); ++t) {
          selection_row(sel, p, b, h, t * kTileQ, row.data());
          const std::int64_t rows = std::min(kTileQ, p.Lq - t * kTileQ);
          total += double(rows) * double(std::count(row.begin(), row.end(), std::uint8_t{1}));
        }
      }
    }
  return total;
}

struct CaseResult {
  std::string status = "ok";
  std::string ran_on;
  std::vector<double> ms;
  double pairs = 0.0;
  double rel_err = 0.0, max_abs = 0.0;
  std::int64_t rows_checked = 0, rows_skipped = 0;
  nlohmann::json extra = nlohmann::json::object();
};

class Bench {
 public:
  Bench(const BenchConfig& c)
      : cfg_(c),
        where_(Placement::choose(c.device)),
        scale_(c.scale ? c.scale : default_scale(c.workload, where_.cuda)),
        repeat_(c.repeat ? c.repeat : (where_.cuda ? 5 : 2)),
        rng_(c.seed * 0x2545f4914f6cdd1dull + 7) {}

  int run();

 private:
  std::int64_t scaled(std::int64_t full, std::int64_t floor) const { return std::max(floor, full / scale_); }
  std::vector<std::int64_t> lengths(std::vector<std::int64_t> defaults) const {
    return cfg_.lk.empty() ? defaults : cfg_.lk;
  }
  std::int64_t length(std::int64_t full) const {
    // Lengths stay multiples of 128 only when the full-scale length was one; odd lengths stay odd.
    return std::max<std::int64_t>(1, full / scale_);
  }

  /// ms per call of f: one call, or with --sustain-ms as many back-to-back calls as fill that time
  /// (counted from one call's time), timed together.
  double timed(bool dev, const std::function<void()>& f) const {
    if (cfg_.sustain_ms <= 0.0) return time_ms(dev, f);
    const double once = time_ms(dev, f);
    const int n = static_cast<int>(std::min(1e6, std::max(1.0, std::ceil(cfg_.sustain_ms / std::max(once, 1e-3)))));
    const auto calls = [&] {
      for (int i = 0; i < n; ++i) f();
    };
    return time_ms(dev, calls) / n;
  }

  /// Verifies one executor call, then times it. `op(device)` runs the executor into in.out.
  CaseResult measure(Inputs& in, const std::function<void(bool)>& op, const RowReference& ref,
                     const std::function<void(CaseResult&)>& after_verify);
  void record(const std::string& name, const ProblemShape& p, nlohmann::json params, CaseResult r);

  void tile16();
  void pipeline();
  void dense_workload();
  void query(bool long_variant);
  void query_phases(Inputs& in, Mirrored& lists, std::int64_t Kq, PartialPrecision prec, CaseResult& r);
  void gated_workload();
  void entmax_workload();

  const BenchConfig& cfg_;
  Placement where_;
  int scale_;
  int repeat_;
  Rng rng_;
  nlohmann::json cases_ = nlohmann::json::array();
  int failures_ = 0;
  int skipped_ = 0;
  bool trusted_ = false;  // true while measure() times a verified call
  AttentionOptions selection_options() const {
    AttentionOptions o;
    o.trusted = trusted_;
    return o;
  }
};

CaseResult Bench::measure(Inputs& in, const std::function<void(bool)>& op, const RowReference& ref,
                          const std::function<void(CaseResult&)>& after_verify) {
  CaseResult r;
  bool dev = where_.cuda;
  in.out.poison();
  try {
    if (dev) {
      op(true);
      device_synchronize();
      in.out.download();
    } else {
      op(false);
    }
  } catch (const Error& e) {
    if (!dev || !is_missing_implementation(e)) throw;
    // At GPU shapes the CPU would take hours: report instead of falling back.
    r.status = "skipped (no cuda implementation yet)";
    r.ran_on = "-";
    return r;
  }
  r.ran_on = dev ? "cuda" : "cpu";
  const auto& p = in.p;
  const TensorView out = in.out.host().view();
  if (!all_finite(out)) {
    r.status = "FAILED: output holds NaN or inf (unwritten or overflowed)";
    return r;
  }
  // Sampled rows: the first and last query, then groups of rows sharing a (batch, head, Q tile), so
  // that per-tile work of a reference (the gated block maxima) is shared.
  std::vector<std::array<std::int64_t, 3>> rows{{0, 0, 0}, {p.B - 1, p.Lq - 1, p.Hq - 1}};
  while (static_cast<int>(rows.size()) < cfg_.verify_rows) {
    const std::int64_t b = rng_.below(p.B), h = rng_.below(p.Hq), t = rng_.below(p.Tq());
    const std::int64_t n = std::min<std::int64_t>({8, cfg_.verify_rows - static_cast<std::int64_t>(rows.size())});
    for (std::int64_t s = 0; s < n; ++s)
      rows.push_back({b, std::min(p.Lq - 1, t * kTileQ + rng_.below(kTileQ)), h});
  }
  double num = 0.0, den = 0.0;
  for (const auto& [b, i, h] : rows) {
    const auto expect = ref(b, i, h);
    if (!expect) {
      ++r.rows_skipped;
      continue;
    }
    ++r.rows_checked;
    const auto got = row_of(out, b, i, h);
    for (std::int64_t d = 0; d < p.D; ++d) {
      const double e = got[d] - (*expect)[d];
      num += e * e;
      den += (*expect)[d] * (*expect)[d];
      r.max_abs = std::max(r.max_abs, std::abs(e));
    }
  }
  r.rel_err = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  if (after_verify) after_verify(r);
  if (r.status != "ok") return r;
  if (r.rows_checked == 0) {
    r.status = "FAILED: no row could be checked";
    return r;
  }
  if (!(r.rel_err <= kRelErrBound) || !(r.max_abs <= kMaxAbsBound)) {
    r.status = fmt::format("FAILED: relerr {:.2e} (bound {:.0e}), max abs err {:.2e} (bound {:.0e})", r.rel_err,
                           kRelErrBound, r.max_abs, kMaxAbsBound);
    return r;
  }
  // The verified call above validated the selection; the timed calls skip validation (`trusted`), as
  // a caller that reuses a checked selection does, so the times are the executor's alone.
  trusted_ = true;
  for (int rep = 0; rep < repeat_; ++rep) r.ms.push_back(timed(dev, [&] { op(dev); }));
  trusted_ = false;
  return r;
}

void Bench::record(const std::string& name, const ProblemShape& p, nlohmann::json params, CaseResult r) {
  const bool ok = r.status == "ok";
  if (r.status.rfind("FAILED", 0) == 0) ++failures_;
  if (r.status.rfind("skipped", 0) == 0) ++skipped_;
  const double flops = 4.0 * double(p.D) * r.pairs;
  nlohmann::json j = {{"case", name},
                      {"shape", {{"B", p.B}, {"Lq", p.Lq}, {"Lk", p.Lk}, {"Hq", p.Hq}, {"Hkv", p.Hkv}, {"D", p.D}, {"causal", p.causal}}},
                      {"dtype", "bf16"},
                      {"params", params},
                      {"status", r.status},
                      {"ran_on", r.ran_on},
                      {"verify", {{"rows_checked", r.rows_checked}, {"rows_skipped", r.rows_skipped}, {"rel_err", r.rel_err},
                                  {"max_abs_err", r.max_abs}, {"rel_err_bound", kRelErrBound}, {"max_abs_bound", kMaxAbsBound}}},
                      {"useful_pairs", r.pairs},
                      {"useful_flops", flops}};
  std::string timing = "-";
  if (ok && !r.ms.empty()) {
    const double med = median(r.ms), mn = *std::min_element(r.ms.begin(), r.ms.end());
    j["time_ms"] = {{"median", med}, {"min", mn}, {"all", r.ms}};
    j["useful_tflops"] = flops / (med * 1e-3) / 1e12;
    timing = fmt::format("{:10.3f} {:10.3f} {:9.3g}", med, mn, flops / (med * 1e-3) / 1e12);
  } else {
    timing = fmt::format("{:>10} {:>10} {:>9}", "-", "-", "-");
  }
  for (auto& [key, value] : r.extra.items()) j[key] = value;
  std::string extra;
  if (r.extra.contains("density")) extra += fmt::format(" density {:.3f}", r.extra["density"].get<double>());
  if (r.extra.contains("threshold") && r.extra["threshold"].is_number())
    extra += fmt::format(" threshold {:.3f}", r.extra["threshold"].get<double>());
  if (r.extra.contains("selector_ms"))
    extra += fmt::format(" selector {:.3f} ms, effective {:.3g} TFLOP/s", r.extra["selector_ms"]["median"].get<double>(),
                         r.extra["effective_tflops"].get<double>());
  if (r.extra.contains("phases_ms"))
    extra += fmt::format(" reverse index {:.3f}, attention {:.3f}, combine {:.3f} ms",
                         r.extra["phases_ms"]["reverse_index"].get<double>(), r.extra["phases_ms"]["attention"].get<double>(),
                         r.extra["phases_ms"]["combine"].get<double>());
  if (r.extra.contains("validated_ms") && !r.ms.empty())
    extra += fmt::format(" validated {:.4f} ms ({:+.1f} % over trusted)", r.extra["validated_ms"]["median"].get<double>(),
                         100.0 * (r.extra["validated_ms"]["median"].get<double>() / median(r.ms) - 1.0));
  if (r.extra.contains("support_fraction"))
    extra += fmt::format(" support {:.3f}", r.extra["support_fraction"].get<double>());
  fmt::print("{:<34} {} {:>9} {:>5}  {}{}\n", name, timing,
             r.rows_checked ? fmt::format("{:.1e}", r.rel_err) : std::string("-"), r.ran_on,
             ok ? "ok" : r.status, extra);
  std::fflush(stdout);
  cases_.push_back(std::move(j));
}

// ---- tile16: Q-centric lists, 16 blocks per Q tile, independent or shared by neighbouring tiles
void Bench::tile16() {
  for (std::int64_t full_lk : lengths({4096, 8192, 16384, 32768, 65536})) {
    ProblemShape p{scaled(2, 1), length(4096), length(full_lk), 16, 1, 128, false};
    const std::int64_t blocks = std::min(p.Tk(), scaled(16, 1));
    progress("tile16 {} Lk={}: inputs and lists", cfg_.pattern, p.Lk);
    Inputs in = make_inputs(p, where_, rng_);
    Mirrored idx(DType::i32, {p.B, p.Hkv, p.Tq(), blocks}, where_), cnt(DType::i32, {p.B, p.Hkv, p.Tq()}, where_);
    std::vector<std::int32_t> perm(static_cast<std::size_t>(p.Tk()));
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t t = 0; t < p.Tq(); ++t) {
        auto* list = idx.host().data<std::int32_t>() + (b * p.Tq() + t) * blocks;
        cnt.host().data<std::int32_t>()[b * p.Tq() + t] = static_cast<std::int32_t>(blocks);
        if (cfg_.pattern == "pairs" && t % 2 == 1) {
          std::copy(list - blocks, list, list);
          continue;
        }
        for (std::size_t j = 0; j < perm.size(); ++j) perm[j] = static_cast<std::int32_t>(j);
        for (std::int64_t s = 0; s < blocks; ++s)
          std::swap(perm[static_cast<std::size_t>(s)], perm[static_cast<std::size_t>(s + rng_.below(p.Tk() - s))]);
        std::sort(perm.begin(), perm.begin() + blocks);
        std::copy(perm.begin(), perm.begin() + blocks, list);
      }
    const Selection host_sel = TileLists{idx.host().view(), cnt.host().view()};
    progress("tile16 {} Lk={}: verify, then {} timed runs", cfg_.pattern, p.Lk, repeat_);
    auto r = measure(
        in,
        [&](bool d) {
          tile_sparse(in.q.view(d), in.k.view(d), in.v.view(d), TileLists{idx.view(d), cnt.view(d)}, in.out.view(d),
                      std::nullopt, selection_options());
        },
        selection_reference(in, host_sel), nullptr);
    r.pairs = selected_pairs(host_sel, p);
    if (r.status == "ok" && where_.cuda) {
      // The same calls validated (the lists checked inside the kernel), against the trusted times above.
      std::vector<double> ms;
      for (int rep = 0; rep < repeat_; ++rep)
        ms.push_back(timed(true, [&] {
          tile_sparse(in.q.view(true), in.k.view(true), in.v.view(true), TileLists{idx.view(true), cnt.view(true)},
                      in.out.view(true), std::nullopt, selection_options());
        }));
      check_device_faults();
      r.extra["validated_ms"] = {{"median", median(ms)}, {"min", *std::min_element(ms.begin(), ms.end())}, {"all", ms}};
    }
    record(fmt::format("tile16 {} Lk={}", cfg_.pattern, p.Lk), p, {{"blocks_per_tile", blocks}, {"pattern", cfg_.pattern}},
           std::move(r));
  }
}

// ---- pipeline: the tile16 shape with a selector in front of tile_sparse
void Bench::pipeline() {
  struct Selector {
    const char* name;
    int representatives;  // pooled R1 / R4; 0: token_max fp8 on the first head of the group
  };
  for (std::int64_t full_lk : lengths({4096, 8192, 16384, 32768}))
    for (const Selector sel : {Selector{"pooled R1", 1}, Selector{"pooled R4", 4}, Selector{"token_max fp8", 0}}) {
      ProblemShape p{scaled(2, 1), length(4096), length(full_lk), 16, 1, 128, false};
      const std::int64_t blocks = std::min(p.Tk(), scaled(16, 1));
      const std::string name = fmt::format("pipeline {} Lk={}", sel.name, p.Lk);
      progress("{}: inputs", name);
      Inputs in = make_inputs(p, where_, rng_);
      Mirrored idx(DType::i32, {p.B, p.Hkv, p.Tq(), blocks}, where_), cnt(DType::i32, {p.B, p.Hkv, p.Tq()}, where_);
      auto select = [&](bool d) {
        const TileLists out{idx.view(d), cnt.view(d)};
        if (sel.representatives) {
          PooledOptions o;
          o.representatives = sel.representatives;
          o.top_k = static_cast<int>(blocks);
          pooled_select(in.q.view(d), in.k.view(d), out, o);
        } else {
          TokenMaxOptions o;
          o.top_k = static_cast<int>(blocks);
          o.precision = IndexPrecision::fp8_e4m3;
          o.causal = false;
          TensorView qidx = in.q.view(d);  // the first query head of each group
          qidx.shape[2] = p.Hkv;
          qidx.stride[2] *= p.group_size();
          token_max_select(qidx, in.k.view(d), out, o);
        }
      };
      const bool dev = where_.cuda;
      idx.poison();
      cnt.poison();
      try {
        select(dev);
      } catch (const Error& e) {
        if (!dev || !is_missing_implementation(e)) throw;
        CaseResult r;
        r.status = "skipped (no cuda implementation yet)";
        r.ran_on = "-";
        record(name, p, {{"selector", sel.name}}, std::move(r));
        continue;
      }
      if (dev) {
        device_synchronize();
        idx.download();
        cnt.download();
      }
      const Selection host_sel = TileLists{idx.host().view(), cnt.host().view()};
      validate(host_sel, p, "pipeline");
      progress("{}: verify, then {} timed runs of the selector and of the executor", name, repeat_);
      auto r = measure(
          in,
          [&](bool d) {
            tile_sparse(in.q.view(d), in.k.view(d), in.v.view(d), TileLists{idx.view(d), cnt.view(d)}, in.out.view(d),
                      std::nullopt, selection_options());
          },
          selection_reference(in, host_sel), nullptr);
      r.pairs = selected_pairs(host_sel, p);
      if (r.status == "ok") {
        std::vector<double> sel_ms, pipe_ms;
        for (int rep = 0; rep < repeat_; ++rep) sel_ms.push_back(timed(dev, [&] { select(dev); }));
        // The pipeline as a caller runs it: the selector, then the executor on the lists it just made
        // (trusted: the caller produced them), queued back to back and timed as one.
        trusted_ = true;
        for (int rep = 0; rep < repeat_; ++rep)
          pipe_ms.push_back(timed(dev, [&] {
            select(dev);
            tile_sparse(in.q.view(dev), in.k.view(dev), in.v.view(dev), TileLists{idx.view(dev), cnt.view(dev)},
                        in.out.view(dev), std::nullopt, selection_options());
          }));
        trusted_ = false;
        const double s_med = median(sel_ms), a_med = median(r.ms), p_med = median(pipe_ms);
        const double useful = 4.0 * double(p.D) * r.pairs;
        r.extra["selector_ms"] = {{"median", s_med}, {"min", *std::min_element(sel_ms.begin(), sel_ms.end())}, {"all", sel_ms}};
        r.extra["pipeline_ms"] = {{"median", p_med}, {"min", *std::min_element(pipe_ms.begin(), pipe_ms.end())}, {"all", pipe_ms}};
        r.extra["effective_tflops"] = useful / (p_med * 1e-3) / 1e12;
        r.extra["attention_only_tflops"] = useful / (a_med * 1e-3) / 1e12;
        // Effective over attention-only TFLOP/s (target >= 0.9).
        r.extra["effective_over_attention_only"] = a_med / p_med;
      }
      record(name, p, {{"selector", sel.name}, {"blocks_per_tile", blocks}}, std::move(r));
    }
}

// ---- dense: MHA, causal and not
void Bench::dense_workload() {
  for (std::int64_t full_l : lengths({4096, 16384}))
    for (bool causal : {false, true}) {
      ProblemShape p{scaled(2, 1), length(full_l), length(full_l), 16, 16, 128, causal};
      progress("dense L={} {}: verify, then {} timed runs", p.Lq, causal ? "causal" : "full", repeat_);
      Inputs in = make_inputs(p, where_, rng_);
      AttentionOptions o;
      o.causal = causal;
      auto r = measure(
          in, [&](bool d) { dense(in.q.view(d), in.k.view(d), in.v.view(d), in.out.view(d), std::nullopt, o); },
          selection_reference(in, AllBlocks{}), nullptr);
      r.pairs = double(p.B * p.Hq) * double(p.visible_pairs());
      record(fmt::format("dense L={} {}", p.Lq, causal ? "causal" : "full"), p, nlohmann::json::object(), std::move(r));
    }
}

// ---- query16of32 / query-long: per-query random block lists, KV-centric executor
void Bench::query(bool long_variant) {
  std::vector<PartialPrecision> precisions;
  if (cfg_.partials != "bf16") precisions.push_back(PartialPrecision::f32);
  if (cfg_.partials != "f32") precisions.push_back(PartialPrecision::bf16);
  for (std::int64_t full_l : lengths({long_variant ? 32768 : 4096})) {
    ProblemShape p = long_variant ? ProblemShape{1, length(full_l), length(full_l), 32, 8, 128, false}
                                  : ProblemShape{scaled(8, 1), length(full_l), length(full_l), 16, 1, 128, false};
    const std::int64_t blocks = std::min(p.Tk(), scaled(16, 1));
    const std::string name = fmt::format("{} L={}", long_variant ? "query-long" : "query16of32", p.Lq);
    progress("{}: inputs and {} random blocks per query", name, blocks);
    Inputs in = make_inputs(p, where_, rng_);
    Mirrored lists(DType::i32, {p.B, p.Hkv, p.Lq, blocks}, where_);
    std::vector<std::int32_t> perm(static_cast<std::size_t>(p.Tk()));
    for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r) {
      for (std::size_t j = 0; j < perm.size(); ++j) perm[j] = static_cast<std::int32_t>(j);
      for (std::int64_t s = 0; s < blocks; ++s)
        std::swap(perm[static_cast<std::size_t>(s)], perm[static_cast<std::size_t>(s + rng_.below(p.Tk() - s))]);
      std::copy(perm.begin(), perm.begin() + blocks, lists.host().data<std::int32_t>() + r * blocks);
    }
    const Selection host_sel = QueryLists{lists.host().view()};
    const auto reference = selection_reference(in, host_sel);
    const double pairs = selected_pairs(host_sel, p);
    // The KV-centric merge window the GPU ran (the automatic choice); the CPU reference does not merge.
    const int merge_window = where_.cuda ? query_sparse_merge_window(p, blocks) : 1;
    for (const PartialPrecision prec : precisions) {
      const char* prec_name = prec == PartialPrecision::bf16 ? "bf16" : "f32";
      const std::string label = fmt::format("{} {} partials", name, prec_name);
      progress("{}: verify, then {} timed runs", label, repeat_);
      auto r = measure(
          in,
          [&](bool d) {
            QuerySparseOptions o;
            o.trusted = trusted_;
            o.partials = prec;
            query_sparse(in.q.view(d), in.k.view(d), in.v.view(d), QueryLists{lists.view(d)}, in.out.view(d), std::nullopt,
                         o);
          },
          reference, nullptr);
      r.pairs = pairs;
      if (where_.cuda && r.status == "ok") query_phases(in, lists, blocks, prec, r);
      record(label, p, {{"blocks_per_query", blocks}, {"merge_window", merge_window}, {"partials", prec_name}},
             std::move(r));
    }
  }
}

// The breakdown of the KV-centric schedule (GPU): its three phases timed one at a time on a workspace
// of their own, each `repeat` times (--sustain-ms applies): the reverse index (lists trusted: they were
// validated by the verified call), the attention into the partials, the combine into out. The phases'
// output must equal the verified one-call output bit for bit (the schedule is deterministic).
void Bench::query_phases(Inputs& in, Mirrored& lists, std::int64_t Kq, PartialPrecision prec, CaseResult& r) {
#ifdef SPARSE_ATTN_WITH_CUDA
  const ProblemShape& p = in.p;
  QuerySparseOptions o;
  o.causal = p.causal;
  o.trusted = true;
  o.partials = prec;
  const std::size_t bytes = query_sparse_workspace_bytes(p, Kq, prec);
  DeviceTensor ws(DType::u8, {static_cast<std::int64_t>(bytes)}, where_.index);
  void* w = ws.view().data;
  const detail::AttentionCall a = detail::resolve_call("query_sparse", in.q.view(true), in.k.view(true),
                                                       in.v.view(true), in.out.view(true), std::nullopt, o);
  const detail::QueryCall c{QueryLists{lists.view(true)}, Kq, prec, o.schedule, query_sparse_merge_window(p, Kq, o)};
  const cuda_backend::QuerySparseBins bins = cuda_backend::query_sparse_bins(p, Kq, c.merge_window);
  const std::function<void()> phases[3] = {[&] { cuda_backend::query_sparse_plan(a, c, bins, w, bytes); },
                                           [&] { cuda_backend::query_sparse_attend(a, c, bins, w, bytes); },
                                           [&] { cuda_backend::query_sparse_combine(a, c, bins, w, bytes); }};
  const HostTensor verified = in.out.host();
  in.out.poison();
  for (const auto& f : phases) f();  // each phase reads what the ones before it left
  device_synchronize();
  in.out.download();
  const auto& got = in.out.host();
  if (std::memcmp(got.view().data, verified.view().data, static_cast<std::size_t>(got.numel()) * dtype_size(got.dtype())) !=
      0) {
    r.status = "FAILED: the phases run one at a time disagree with the verified one-call output";
    return;
  }
  const char* names[3] = {"reverse_index", "attention", "combine"};
  nlohmann::json j = nlohmann::json::object();
  for (int i = 0; i < 3; ++i) {
    std::vector<double> ms;
    for (int rep = 0; rep < repeat_; ++rep) ms.push_back(timed(true, phases[i]));
    j[names[i]] = median(ms);
  }
  r.extra["phases_ms"] = j;
#else
  (void)in, (void)lists, (void)Kq, (void)prec, (void)r;
#endif
}

// ---- gated: dense causal baseline; per target density the gate with thresholds from the input's
// own block maxima, and beside it tile_sparse walking as many blocks per Q tile as the gate kept
// (docs/design.md §5.5: gate tiles of kGateRows queries, sink blocks as GatedOptions' default).
namespace {

/// Pairs (query, key) of Q tile rows [q0, q1) and block keys [k0, k1) that the causal rule shows.
std::int64_t visible_pairs_of(const ProblemShape& p, std::int64_t q0, std::int64_t q1, std::int64_t k0, std::int64_t k1) {
  if (k1 - 1 <= q0 + p.offset()) return (q1 - q0) * (k1 - k0);  // every pair
  std::int64_t n = 0;
  for (std::int64_t i = q0; i < q1; ++i) n += std::clamp<std::int64_t>(i + p.offset() + 1 - k0, 0, k1 - k0);
  return n;
}

/// The gate's geometry for gate tile g and block j: visible to some row, kept outside the gate.
struct GateBlock {
  bool visible, forced;
};
GateBlock gate_block(const ProblemShape& p, std::int64_t g, std::int64_t j, std::int64_t sinks) {
  const std::int64_t q0 = g * kGateRows, q1 = std::min(p.Lq, q0 + kGateRows);
  const std::int64_t k0 = j * kBlockK, k1 = std::min(p.Lk, k0 + kBlockK);
  return {k0 < p.Lk && k0 <= q1 - 1 + p.offset(), j < sinks || k1 - 1 > q0 + p.offset()};
}

}  // namespace

void Bench::gated_workload() {
  const std::int64_t sinks = GatedOptions{}.sink_blocks;
  for (std::int64_t full_l : lengths({8192, 32768, 65536})) {
    ProblemShape p{1, length(full_l), length(full_l), 32, 8, 128, true};
    const std::string base = fmt::format("gated L={}", p.Lq);
    progress("{}: inputs", base);
    Inputs in = make_inputs(p, where_, rng_);
    const double scale = 1.0 / std::sqrt(double(p.D));
    const std::int64_t Tg = ceil_div(p.Lq, kGateRows), Tq = p.Tq(), Tk = p.Tk();

    // Per (b, h): visible blocks, the ones kept outside the gate, and the gate's candidates.
    double visible_blocks = 0.0, forced_blocks = 0.0;
    std::vector<std::array<std::int64_t, 2>> candidates;  // (g, j)
    for (std::int64_t g = 0; g < Tg; ++g)
      for (std::int64_t j = 0; j < Tk; ++j) {
        const GateBlock gb = gate_block(p, g, j, sinks);
        if (!gb.visible) continue;
        visible_blocks += 1.0;
        if (gb.forced) forced_blocks += 1.0;
        else candidates.push_back({g, j});
      }
    // The maximum of a candidate block of the input, in float64 from the bf16 values.
    const auto block_max = [&](std::int64_t b, std::int64_t h, std::int64_t g, std::int64_t j) {
      double m = -INFINITY;
      std::vector<std::vector<float>> ks;
      for (std::int64_t s = j * kBlockK; s < std::min(p.Lk, (j + 1) * kBlockK); ++s)
        ks.push_back(row_of(in.k.host().view(), b, s, h / p.group_size()));
      for (std::int64_t i = g * kGateRows; i < std::min(p.Lq, (g + 1) * kGateRows); ++i) {
        const auto qr = row_of(in.q.host().view(), b, i, h);
        for (const auto& kr : ks) m = std::max(m, scale * dot(qr, kr));
      }
      return m;
    };
    // Thresholds from the input itself: quantiles of the maxima of sampled candidate blocks.
    std::vector<double> maxima;
    {
      Rng sample_rng(cfg_.seed + 977);
      const std::int64_t n = std::min<std::int64_t>(static_cast<std::int64_t>(candidates.size()) * p.B * p.Hq,
                                                    std::max<std::int64_t>(64, 1024 / scale_));
      progress("{}: maxima of {} sampled candidate blocks", base, n);
      for (std::int64_t s = 0; s < n && !candidates.empty(); ++s) {
        const auto& [g, j] = candidates[static_cast<std::size_t>(sample_rng.below(static_cast<std::int64_t>(candidates.size())))];
        maxima.push_back(block_max(sample_rng.below(p.B), sample_rng.below(p.Hq), g, j));
      }
      std::sort(maxima.begin(), maxima.end());
    }

    {
      progress("{} dense causal: verify, then {} timed runs", base, repeat_);
      AttentionOptions o;
      o.causal = true;
      auto r = measure(
          in, [&](bool d) { dense(in.q.view(d), in.k.view(d), in.v.view(d), in.out.view(d), std::nullopt, o); },
          selection_reference(in, AllBlocks{}), nullptr);
      r.pairs = double(p.B * p.Hq) * double(p.visible_pairs());
      record(base + " dense causal", p, nlohmann::json::object(), std::move(r));
    }
    for (const double density : cfg_.densities) {
      // Candidates that must pass for the target: the kept blocks less those kept outside the gate.
      const double cand = visible_blocks - forced_blocks;
      const double pass = cand > 0.0 ? std::clamp((density * visible_blocks - forced_blocks) / cand, 0.0, 1.0) : 1.0;
      float t = -INFINITY;
      if (pass < 1.0 && !maxima.empty())
        t = pass <= 0.0 ? static_cast<float>(maxima.back() + 1e3)  // above every maximum: nothing passes
                        : static_cast<float>(maxima[std::min(maxima.size() - 1,
                                                             static_cast<std::size_t>((1.0 - pass) * double(maxima.size())))]);
      const bool open = std::isinf(t) && t < 0;
      const std::string name = base + (open ? fmt::format(" gate off (-inf) for density {:.2f}", density)
                                            : fmt::format(" gate for density {:.2f}", density));
      progress("{}: verify, then {} timed runs", name, repeat_);
      Mirrored thresholds(DType::f32, {p.Hq, 1}, where_), kept(DType::i32, {p.B, p.Hq, Tg}, where_);
      std::fill_n(thresholds.host().data<float>(), p.Hq, t);
      GatedStats stats;
      // Block decisions of each sampled (b, h, gate tile): 1 kept, 0 skipped, -1 too close to call.
      std::map<std::array<std::int64_t, 3>, std::vector<int>> decisions;
      auto decide = [&](std::int64_t b, std::int64_t h, std::int64_t g) -> const std::vector<int>& {
        auto it = decisions.find({b, h, g});
        if (it != decisions.end()) return it->second;
        std::vector<int> dec(static_cast<std::size_t>(Tk), 0);
        for (std::int64_t j = 0; j < Tk; ++j) {
          const GateBlock gb = gate_block(p, g, j, sinks);
          if (!gb.visible) break;
          if (gb.forced) {
            dec[static_cast<std::size_t>(j)] = 1;
            continue;
          }
          const double m = block_max(b, h, g, j);
          dec[static_cast<std::size_t>(j)] = std::abs(m - double(t)) < kGateAmbiguity ? -1 : (m >= double(t) ? 1 : 0);
        }
        return decisions.emplace(std::array<std::int64_t, 3>{b, h, g}, std::move(dec)).first->second;
      };
      RowReference ref = [&](std::int64_t b, std::int64_t i, std::int64_t h) -> std::optional<std::vector<double>> {
        const auto& dec = decide(b, h, i / kGateRows);
        std::vector<std::uint8_t> mask(static_cast<std::size_t>(p.Lk), 0);
        for (std::int64_t j = 0; j <= std::min(p.Lk - 1, i + p.offset()); ++j) {
          const int d = dec[static_cast<std::size_t>(j / kBlockK)];
          if (d < 0) return std::nullopt;
          mask[static_cast<std::size_t>(j)] = static_cast<std::uint8_t>(d);
        }
        return softmax_row(in, b, i, h, mask);
      };
      auto r = measure(
          in,
          [&](bool d) {
            GatedOptions o;
            o.kept_per_tile = kept.view(d);
            stats = gated(in.q.view(d), in.k.view(d), in.v.view(d), thresholds.view(d), in.out.view(d), std::nullopt, o);
          },
          ref,
          [&](CaseResult& cr) {
            if (where_.cuda) kept.download();
            double pairs = 0.0, kept_total = 0.0;
            for (std::int64_t b = 0; b < p.B; ++b)
              for (std::int64_t h = 0; h < p.Hq; ++h)
                for (std::int64_t g = 0; g < Tg; ++g) {
                  const std::int64_t n = kept.host().data<std::int32_t>()[(b * p.Hq + h) * Tg + g];
                  const std::int64_t q0 = g * kGateRows, q1 = std::min(p.Lq, q0 + kGateRows);
                  // Kept candidates are fully visible; the forced blocks as the causal rule shows them.
                  std::int64_t forced = 0, forced_pairs = 0;
                  for (std::int64_t j = 0; j < Tk; ++j) {
                    const GateBlock gb = gate_block(p, g, j, sinks);
                    if (!gb.visible || !gb.forced) continue;
                    ++forced;
                    forced_pairs += visible_pairs_of(p, q0, q1, j * kBlockK, std::min(p.Lk, (j + 1) * kBlockK));
                  }
                  pairs += double(n - forced) * double(q1 - q0) * double(kBlockK) + double(forced_pairs);
                  kept_total += double(n);
                  // Sampled gate tiles whose decisions are all clear must keep exactly the blocks counted here.
                  auto it = decisions.find({b, h, g});
                  if (it != decisions.end() && cr.status == "ok" &&
                      std::find(it->second.begin(), it->second.end(), -1) == it->second.end()) {
                    const auto expect = std::count(it->second.begin(), it->second.end(), 1);
                    if (expect != n)
                      cr.status = fmt::format("FAILED: kept_per_tile[{}, {}, {}] = {}, the reference keeps {}", b, h, g, n, expect);
                  }
                }
            cr.pairs = pairs;
            cr.extra["density"] = kept_total / (double(p.B * p.Hq) * visible_blocks);
            cr.extra["threshold"] = open ? nlohmann::json("-inf") : nlohmann::json(t);
            cr.extra["stats"] = {{"kept_blocks", stats.kept_blocks}, {"visible_blocks", stats.visible_blocks},
                                 {"gated_candidates", stats.gated_candidates}, {"gated_kept", stats.gated_kept}};
          });
      const bool gated_ok = r.status == "ok";
      record(name, p, {{"target_density", density}, {"sink_blocks", sinks}}, std::move(r));
      if (!gated_ok) continue;

      // tile_sparse over per-head lists of as many blocks per Q tile as the gate kept in either of its
      // gate tiles: the blocks the gate had to keep, then random visible ones. The same attention work
      // without the QK of the skipped blocks: the difference in time is the cost of the exact gate.
      const std::string ts_name = base + fmt::format(" tile_sparse kept blocks {:.2f}", density);
      progress("{}: verify, then {} timed runs", ts_name, repeat_);
      Mirrored idx(DType::i32, {p.B, p.Hq, Tq, Tk}, where_), cnt(DType::i32, {p.B, p.Hq, Tq}, where_);
      Rng list_rng(cfg_.seed + 31 * static_cast<std::uint64_t>(density * 1000.0));
      std::vector<std::int32_t> pick;
      for (std::int64_t b = 0; b < p.B; ++b)
        for (std::int64_t h = 0; h < p.Hq; ++h)
          for (std::int64_t tile = 0; tile < Tq; ++tile) {
            std::int64_t n = 0;
            std::vector<std::uint8_t> chosen(static_cast<std::size_t>(Tk), 0);
            std::vector<std::int32_t> others;
            for (std::int64_t g = 2 * tile; g < std::min(Tg, 2 * tile + 2); ++g) {
              n = std::max<std::int64_t>(n, kept.host().data<std::int32_t>()[(b * p.Hq + h) * Tg + g]);
              for (std::int64_t j = 0; j < Tk; ++j) {
                const GateBlock gb = gate_block(p, g, j, sinks);
                if (gb.visible && gb.forced) chosen[static_cast<std::size_t>(j)] = 1;
              }
            }
            for (std::int64_t j = 0; j < Tk; ++j)
              if (!chosen[static_cast<std::size_t>(j)] && gate_block(p, std::min(Tg - 1, 2 * tile + 1), j, sinks).visible)
                others.push_back(static_cast<std::int32_t>(j));
            std::int64_t have = std::count(chosen.begin(), chosen.end(), std::uint8_t{1});
            for (std::size_t s = 0; have < n && s < others.size(); ++s, ++have) {
              std::swap(others[s], others[s + static_cast<std::size_t>(list_rng.below(static_cast<std::int64_t>(others.size() - s)))]);
              chosen[static_cast<std::size_t>(others[s])] = 1;
            }
            std::int32_t* row = idx.host().data<std::int32_t>() + ((b * p.Hq + h) * Tq + tile) * Tk;
            std::int32_t c = 0;
            for (std::int64_t j = 0; j < Tk; ++j)
              if (chosen[static_cast<std::size_t>(j)]) row[c++] = static_cast<std::int32_t>(j);
            std::fill(row + c, row + Tk, -1);
            cnt.host().data<std::int32_t>()[(b * p.Hq + h) * Tq + tile] = c;
          }
      if (where_.cuda) {
        idx.upload();
        cnt.upload();
      }
      const TileLists lists{idx.host().view(), cnt.host().view()};
      auto ts = measure(
          in,
          [&](bool d) {
            AttentionOptions o = selection_options();
            o.causal = true;
            tile_sparse(in.q.view(d), in.k.view(d), in.v.view(d), TileLists{idx.view(d), cnt.view(d)}, in.out.view(d),
                        std::nullopt, o);
          },
          selection_reference(in, lists), nullptr);
      double pairs = 0.0;
      for (std::int64_t row = 0; row < p.B * p.Hq * Tq; ++row) {
        const std::int64_t tile = row % Tq, q0 = tile * kTileQ, q1 = std::min(p.Lq, q0 + kTileQ);
        const std::int32_t* ids = idx.host().data<std::int32_t>() + row * Tk;
        for (std::int32_t s = 0; s < cnt.host().data<std::int32_t>()[row]; ++s)
          pairs += double(visible_pairs_of(p, q0, q1, ids[s] * kBlockK, std::min(p.Lk, (ids[s] + 1) * kBlockK)));
      }
      ts.pairs = pairs;
      record(ts_name, p, {{"target_density", density}, {"lists", "per head, the gate's counts per Q tile"}}, std::move(ts));
    }
  }
}

// ---- entmax: alpha = 1.5, causal
void Bench::entmax_workload() {
  constexpr float kAlpha = 1.5f;
  for (std::int64_t full_l : lengths({4096, 8192, 16384, 32768})) {
    ProblemShape p{1, length(full_l), length(full_l), 32, 8, 128, true};
    const std::string name = fmt::format("entmax L={} alpha=1.5", p.Lq);
    progress("{}: verify, then {} timed runs", name, repeat_);
    Inputs in = make_inputs(p, where_, rng_);
    EntmaxStats stats;
    RowReference ref = [&](std::int64_t b, std::int64_t i, std::int64_t h) -> std::optional<std::vector<double>> {
      const auto z = scaled_scores(in, b, i, h);
      const std::int64_t end = std::min(p.Lk, i + p.offset() + 1);
      const double a1 = kAlpha - 1.0;
      double hi = -INFINITY;
      for (std::int64_t j = 0; j < end; ++j) hi = std::max(hi, a1 * z[j]);
      // sum_j [(alpha-1) z_j - tau]_+^(1/(alpha-1)) decreases in tau; it is >= 1 at max - 1 and 0 at max.
      double lo = hi - 1.0;
      auto mass = [&](double tau) {
        double s = 0.0;
        for (std::int64_t j = 0; j < end; ++j) s += std::pow(std::max(0.0, a1 * z[j] - tau), 1.0 / a1);
        return s;
      };
      for (int it = 0; it < 200; ++it) {
        const double mid = 0.5 * (lo + hi);
        (mass(mid) >= 1.0 ? lo : hi) = mid;
      }
      std::vector<double> w(static_cast<std::size_t>(p.Lk), 0.0);
      double total = 0.0;
      for (std::int64_t j = 0; j < end; ++j) total += (w[j] = std::pow(std::max(0.0, a1 * z[j] - lo), 1.0 / a1));
      for (auto& x : w) x /= total;
      return weighted_sum(in, b, h / p.group_size(), w);
    };
    auto r = measure(
        in,
        [&](bool d) {
          EntmaxOptions o;
          o.alpha = kAlpha;
          o.causal = true;
          stats = entmax(in.q.view(d), in.k.view(d), in.v.view(d), in.out.view(d), o);
        },
        ref,
        [&](CaseResult& cr) {
          const double visible = double(p.B * p.Hq) * double(p.visible_pairs());
          cr.pairs = double(stats.support);
          cr.extra["support_fraction"] = double(stats.support) / visible;
          cr.extra["active_tiles"] = stats.active_tiles;
          cr.extra["visible_tiles"] = stats.visible_tiles;
        });
    record(name, p, {{"alpha", kAlpha}}, std::move(r));
  }
}

int Bench::run() {
  if (!cfg_.json.empty()) check_writable(cfg_.json);
  fmt::print("{}\n", where_.banner());
  fmt::print("workload {}: scale 1/{}{}, {} timed runs per case, each verified first on {} sampled rows\n", cfg_.workload,
             scale_, scale_ > 1 ? " (batch, lengths and block counts divided; see docs/cli.md)" : "", repeat_,
             cfg_.verify_rows);
  fmt::print("\n{:<34} {:>10} {:>10} {:>9} {:>9} {:>5}  {}\n", "case", "median ms", "min ms", "TFLOP/s", "relerr", "on",
             "check");
  if (cfg_.workload == "tile16") tile16();
  else if (cfg_.workload == "pipeline") pipeline();
  else if (cfg_.workload == "dense") dense_workload();
  else if (cfg_.workload == "query16of32") query(false);
  else if (cfg_.workload == "query-long") query(true);
  else if (cfg_.workload == "gated") gated_workload();
  else if (cfg_.workload == "entmax") entmax_workload();
  else throw std::runtime_error("unknown workload '" + cfg_.workload + "'");
  fmt::print("\nTFLOP/s: useful FLOPs (4 * D * selected visible (head, query, key) triples) / median time.\n");

  if (!cfg_.json.empty()) {
    nlohmann::json j = build_json(where_);
    j["command"] = "bench";
    j["workload"] = cfg_.workload;
    j["scale"] = scale_;
    j["repeat"] = repeat_;
    j["sustain_ms"] = cfg_.sustain_ms;
    j["seed"] = cfg_.seed;
    j["cases"] = cases_;
    write_json(cfg_.json, j);
    progress("wrote {}", cfg_.json);
  }
  if (failures_) {
    fmt::print(stderr, "error: {} case(s) failed verification\n", failures_);
    return 1;
  }
  return 0;
}

}  // namespace

int run_bench(const BenchConfig& config) {
  Bench bench(config);
  return bench.run();
}

}  // namespace sparse_attn::cli
