// One problem's inputs for every executor, from a seed: random q, k, v and a random selection in each
// format (tile lists and the same tiles as bit sets, per-query block lists, per-query token lists), all
// valid (ascending distinct tile ids, distinct query ids and token positions, -1 for empty slots).
// The concurrency tests run every executor on two of these at once (on_threads).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <numeric>
#include <random>
#include <string>
#include <thread>
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

inline ProblemShape problem(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
                            std::int64_t D, bool causal) {
  ProblemShape p;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = causal;
  return p;
}

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

/// The executors the concurrency tests call, in the order of their outputs (out, then lse, per executor).
inline constexpr int kExecutors = 5;
inline constexpr const char* kExecutorNames[kExecutors] = {"dense", "tile_sparse", "bits_sparse", "query_sparse",
                                                          "token_sparse"};

/// On `threads` host threads at once, each calls run(t) `iterations` times and compares what it returns
/// (out and lse per executor) with expected[t] by same(a, b). Returns per thread "" or what went wrong
/// first: the output that differed and when, or the message of an exception. (gtest assertions stay on
/// the calling thread.)
template <class Outputs, class Run, class Same>
std::vector<std::string> on_threads(const std::vector<Outputs>& expected, int iterations, Run run, Same same) {
  std::vector<std::string> failures(expected.size());
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < expected.size(); ++t)
    threads.emplace_back([&, t] {
      try {
        for (int it = 0; it < iterations && failures[t].empty(); ++it) {
          const Outputs got = run(t);
          for (std::size_t j = 0; j < got.size() && failures[t].empty(); ++j)
            if (!same(got[j], expected[t][j]))
              failures[t] = std::string(kExecutorNames[j / 2]) + (j % 2 ? " lse" : " out") + " differs at iteration " +
                            std::to_string(it);
        }
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  return failures;
}

}  // namespace sparse_attn::testing
