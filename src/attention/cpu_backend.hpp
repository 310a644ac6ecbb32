// CPU implementations of the executors. Arguments are already resolved (detail::resolve_call) and
// the selection validated (unless the caller passed `trusted`). Block and key ids are still
// range-checked as they are read, so a wrong trusted selection raises Error instead of reading out
// of bounds.
#pragma once

#include <cstdint>
#include <optional>

#include "core/call.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::detail::cpu {

using detail::AttentionCall;

/// Bytes of float K/V that the Q-centric executors convert and hold at once: (batch, KV head) pairs
/// are processed in passes that fit (at least one pair per pass). Tests pass a small value to
/// exercise the passes.
inline constexpr std::int64_t kKVStoreBudget = std::int64_t(256) << 20;

void dense(const AttentionCall& a, std::int64_t kv_store_budget = kKVStoreBudget);
void tile_sparse(const AttentionCall& a, const TileCall& t, std::int64_t kv_store_budget = kKVStoreBudget);
void bits_sparse(const AttentionCall& a, const BlockBits& bits, std::int64_t kv_store_budget = kKVStoreBudget);
/// Bytes of partial outputs held at once: queries are processed in chunks that fit (at least one
/// query per chunk). The default keeps long problems within memory; tests pass a small value to
/// exercise the chunking.
inline constexpr std::int64_t kQuerySparsePartialBudget = std::int64_t(64) << 20;
void query_sparse(const AttentionCall& a, const QueryCall& c, std::int64_t partial_budget = kQuerySparsePartialBudget);
void token_sparse(const AttentionCall& a, const TokenCall& t);

}  // namespace sparse_attn::detail::cpu
