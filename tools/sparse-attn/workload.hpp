// The structured synthetic workload shared by `demo` and `eval`: attention with structure that a
// selector can find, and ground truth (planted needles) to score it against.
//  - attention sinks: the first keys carry a direction every query shares;
//  - local bands: queries and keys carry a slowly rotating positional direction (sums of rotations
//    at several frequencies, as rotary embeddings do), so q_i . k_j peaks near j = i;
//  - needles: a run of 16 keys in one block far in the past carries a direction that every query
//    of one later Q tile (all heads of one group) shares, strongly enough to dominate those queries.
// Everything is a sum of orthonormal directions scaled to a target logit, plus noise, in bf16.
#pragma once

#include <cstdint>
#include <vector>

#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::cli {

inline constexpr std::int64_t kSyntheticDim = 128;
inline constexpr std::int64_t kSyntheticSinkKeys = 4;
inline constexpr std::int64_t kSyntheticNeedleKeys = 16;
// Blocks between a needle and the Q tile that looks for it: the needle is "far away", outside any
// local window a selector might keep for free.
inline constexpr std::int64_t kSyntheticNeedleMinGap = 4;

struct SyntheticConfig {
  std::uint64_t seed = 1;
  std::int64_t batch = 1;
  std::int64_t len = 2048;  // queries = keys, causal
  std::int64_t heads = 8;
  std::int64_t kv_heads = 2;
  int needles = 4;          // planted needles per (batch, KV head)
  // Needles go into Q tiles at or after this query (rounded down to its tile), so that a quality
  // measurement over a tail of the queries sees every needle.
  std::int64_t needle_first_query = 0;
};

/// Keys [key_begin, key_end) of KV block `block` answer every query of Q tile `tile`, for all the
/// query heads of group g of batch b.
struct PlantedNeedle {
  std::int64_t b, g, tile, block, key_begin, key_end;
};

struct SyntheticWorkload {
  ProblemShape p;      // causal, D = kSyntheticDim
  HostTensor q, k, v;  // bf16, [B, L, Hq, D] and [B, L, Hkv, D]
  std::vector<PlantedNeedle> needles;
};

/// Deterministic in the configuration (and independent of the thread count).
SyntheticWorkload make_synthetic_workload(const SyntheticConfig& config);

/// Lightning's index keys when none are given: the mean over the KV heads of k, [B, Lk, D] in k's
/// dtype.
HostTensor mean_kv_heads(const TensorView& k);

/// First query of a tail of about `tail_queries` queries out of `len`, on a Q tile boundary so that
/// tile-indexed selections slice cleanly. 0 (everything) when tail_queries <= 0 or >= len.
std::int64_t tail_start(std::int64_t len, std::int64_t tail_queries);

/// The view without its first `start` entries along `dim`.
TensorView drop_front(TensorView t, int dim, std::int64_t start);

/// The selection restricted to queries [start, Lq) (start on a Q tile boundary). With q restricted
/// the same way and k, v whole, causal alignment is kept: the new Lk - Lq is the old one + start.
Selection drop_queries(const Selection& s, std::int64_t start);

/// Fraction of (needle query head, query, planted key) triples the selection keeps; NaN without
/// needles. `s` and `p` describe the queries [first_query, ...) of the workload (see
/// drop_queries); needle queries before first_query are not counted.
double needle_recall(const Selection& s, const ProblemShape& p, const std::vector<PlantedNeedle>& needles,
                     std::int64_t first_query = 0);

}  // namespace sparse_attn::cli
