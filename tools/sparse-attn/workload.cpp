#include "workload.hpp"

#include <algorithm>
#include <cmath>
#include <variant>

#include "common.hpp"
#include "core/cpu.hpp"

namespace sparse_attn::cli {

namespace {

constexpr std::int64_t kDim = kSyntheticDim;
constexpr int kFrequencies = 8;  // rotation frequencies of the positional direction
// Target logits (scaled scores) of each structure; the needle beats the band so that a missed
// needle costs its queries most of their attention mass.
constexpr double kSinkLogit = 5.0, kLocalLogit = 6.0, kNeedleLogit = 8.0, kNoise = 0.5;

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

}  // namespace

SyntheticWorkload make_synthetic_workload(const SyntheticConfig& c) {
  // q, k and v in bf16, and about as much again for the index tensors and the evaluation.
  check_memory(2.0 * double(c.batch) * double(c.len) * double(c.heads + 2 * c.kv_heads) * double(kDim) * 2.0,
               fmt::format("--batch {} x --len {} x --heads {} (--kv-heads {})", c.batch, c.len, c.heads, c.kv_heads));
  SyntheticWorkload w;
  w.p = ProblemShape{c.batch, c.len, c.len, c.heads, c.kv_heads, kDim, true};
  const auto& p = w.p;
  Rng rng(c.seed * 0x9e3779b97f4a7c15ull + 1);

  // Needles first, so their directions can be counted.
  const std::int64_t Tq = p.Tq();
  const std::int64_t first_tile =
      std::max<std::int64_t>(kSyntheticNeedleMinGap + 2, std::max<std::int64_t>(c.needle_first_query, 0) / kTileQ);
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
          block = 1 + rng.below(tile - kSyntheticNeedleMinGap);
        if (block == 0 || std::count(used_blocks.begin(), used_blocks.end(), block)) continue;
        used_blocks.push_back(block);
        const std::int64_t begin = block * kBlockK + kSyntheticNeedleKeys * rng.below(kBlockK / kSyntheticNeedleKeys);
        w.needles.push_back({b, g, tile, block, begin, begin + kSyntheticNeedleKeys});
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
        if (j < kSyntheticSinkKeys) add(x, 0, sink_amp);
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

HostTensor mean_kv_heads(const TensorView& k) {
  const std::int64_t B = k.shape[0], Lk = k.shape[1], Hkv = k.shape[2], D = k.shape[3];
  HostTensor out(k.dtype, {B, Lk, D});
  const TensorView o = out.view();
  std::vector<float> row(static_cast<std::size_t>(D)), mean(static_cast<std::size_t>(D));
  std::vector<double> sum(static_cast<std::size_t>(D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < Lk; ++j) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (std::int64_t g = 0; g < Hkv; ++g) {
        detail::load_bhld(k, b, j, g, row.data());
        for (std::int64_t d = 0; d < D; ++d) sum[d] += row[d];
      }
      for (std::int64_t d = 0; d < D; ++d) mean[d] = static_cast<float>(sum[d] / double(Hkv));
      detail::store_row(o, static_cast<char*>(o.data) + (b * Lk + j) * D * static_cast<std::int64_t>(dtype_size(o.dtype)),
                        D, mean.data());
    }
  return out;
}

std::int64_t tail_start(std::int64_t len, std::int64_t tail_queries) {
  if (tail_queries <= 0 || tail_queries >= len) return 0;
  return (len - tail_queries) / kTileQ * kTileQ;
}

TensorView drop_front(TensorView t, int dim, std::int64_t start) {
  t.data = static_cast<char*>(t.data) + start * t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
  t.shape[dim] -= start;
  return t;
}

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

double needle_recall(const Selection& s, const ProblemShape& p, const std::vector<PlantedNeedle>& needles,
                     std::int64_t first_query) {
  if (needles.empty()) return NAN;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(p.Lk));
  std::int64_t kept = 0, total = 0;
  for (const auto& nd : needles)
    for (std::int64_t h = nd.g * p.group_size(); h < (nd.g + 1) * p.group_size(); ++h)
      for (std::int64_t i = std::max(nd.tile * kTileQ, first_query); i < std::min(first_query + p.Lq, (nd.tile + 1) * kTileQ); ++i) {
        selection_row(s, p, nd.b, h, i - first_query, row.data());
        for (std::int64_t j = nd.key_begin; j < nd.key_end; ++j) kept += row[static_cast<std::size_t>(j)];
        total += nd.key_end - nd.key_begin;
      }
  return total > 0 ? double(kept) / double(total) : NAN;
}

}  // namespace sparse_attn::cli
