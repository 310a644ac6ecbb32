// CPU implementations of the executors. Arguments are already checked (check_attention_args) and
// the selection validated (unless the caller passed `trusted`); the scale is resolved. Block and
// key ids are still range-checked as they are read, so a wrong trusted selection raises Error
// instead of reading out of bounds.
#pragma once

#include <optional>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::detail::cpu {

struct AttentionArgs {
  TensorView q, k, v, out;
  std::optional<TensorView> lse;
  ProblemShape p;
  float scale = 1.0f;
};

void dense(const AttentionArgs& a);
void tile_sparse(const AttentionArgs& a, const TileLists& tiles);
void bits_sparse(const AttentionArgs& a, const BlockBits& bits);
void query_sparse(const AttentionArgs& a, const QueryLists& lists, PartialPrecision partials);
void token_sparse(const AttentionArgs& a, const TokenLists& tokens);

}  // namespace sparse_attn::detail::cpu
