// One problem's inputs for every executor, from a seed: random q, k, v and a random selection in each
// format (tile lists and the same tiles as bit sets, per-query block lists, per-query token lists), all
// valid (ascending distinct tile ids, distinct query ids and token positions, -1 for empty slots).
// The concurrency tests run every executor on two of these at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::testing {

struct Workload {
  ProblemShape p;
  HostTensor q, k, v;
  HostTensor tile_idx, tile_cnt, bits;  // G = Hkv, up to kTileSlots blocks per tile
  HostTensor query_idx;                 // up to kQuerySlots blocks per query
  HostTensor token_idx;                 // up to kTokenSlots positions per query
  static constexpr std::int64_t kTileSlots = 4, kQuerySlots = 3, kTokenSlots = 40;
};

/// k distinct values of [0, n) in random order (k <= n).
inline std::vector<std::int32_t> distinct(std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t i = 0; i < k; ++i)
    std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(i + rng() % static_cast<std::uint64_t>(n - i))]);
  all.resize(static_cast<std::size_t>(k));
  return all;
}

inline Workload random_workload(const ProblemShape& p, DType dtype, std::uint64_t seed) {
  Workload w;
  w.p = p;
  w.q = random_tensor(dtype, {p.B, p.Lq, p.Hq, p.D}, seed * 11 + 1);
  w.k = random_tensor(dtype, {p.B, p.Lk, p.Hkv, p.D}, seed * 11 + 2);
  w.v = random_tensor(dtype, {p.B, p.Lk, p.Hkv, p.D}, seed * 11 + 3);
  std::mt19937_64 rng(seed);
  const std::int64_t Tq = p.Tq(), Tk = p.Tk(), words = ceil_div(Tk, 32);

  const std::int64_t kt = std::min(Workload::kTileSlots, Tk);
  w.tile_idx = HostTensor(DType::i32, {p.B, p.Hkv, Tq, Workload::kTileSlots});
  w.tile_cnt = HostTensor(DType::i32, {p.B, p.Hkv, Tq});
  w.bits = HostTensor(DType::u32, {p.B, p.Hkv, Tq, words});
  auto* idx = w.tile_idx.data<std::int32_t>();
  auto* bits = w.bits.data<std::uint32_t>();
  std::fill(idx, idx + w.tile_idx.numel(), -1);
  std::fill(bits, bits + w.bits.numel(), 0u);
  for (std::int64_t t = 0; t < p.B * p.Hkv * Tq; ++t) {
    std::vector<std::int32_t> ids = distinct(Tk, 1 + static_cast<std::int64_t>(rng() % kt), rng);
    std::sort(ids.begin(), ids.end());
    w.tile_cnt.data<std::int32_t>()[t] = static_cast<std::int32_t>(ids.size());
    for (std::size_t s = 0; s < ids.size(); ++s) {
      idx[t * Workload::kTileSlots + static_cast<std::int64_t>(s)] = ids[s];
      bits[t * words + ids[s] / 32] |= 1u << (ids[s] % 32);
    }
  }

  // Per query: a random number of ids in random slots, the rest -1.
  const auto fill_rows = [&](HostTensor& t, std::int64_t slots, std::int64_t range) {
    auto* d = t.data<std::int32_t>();
    std::fill(d, d + t.numel(), -1);
    const std::int64_t most = std::min(slots, range);
    for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r) {
      const std::vector<std::int32_t> ids = distinct(range, static_cast<std::int64_t>(rng() % (most + 1)), rng);
      const std::vector<std::int32_t> at = distinct(slots, static_cast<std::int64_t>(ids.size()), rng);
      for (std::size_t s = 0; s < ids.size(); ++s) d[r * slots + at[s]] = ids[s];
    }
  };
  w.query_idx = HostTensor(DType::i32, {p.B, p.Hkv, p.Lq, Workload::kQuerySlots});
  fill_rows(w.query_idx, Workload::kQuerySlots, Tk);
  w.token_idx = HostTensor(DType::i32, {p.B, p.Hkv, p.Lq, Workload::kTokenSlots});
  fill_rows(w.token_idx, Workload::kTokenSlots, p.Lk);
  return w;
}

}  // namespace sparse_attn::testing
