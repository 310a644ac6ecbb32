// sparse_attn: input-dependent sparse attention for long-context prefill.
//
//   selectors (pooled, token_max, lightning)  ->  selections (TileLists, BlockBits, QueryLists,
//   TokenLists)  ->  executors (dense, tile_sparse, query_sparse, token_sparse, gated, entmax)
#pragma once

#include "sparse_attn/dtype.hpp"
#include "sparse_attn/error.hpp"
#include "sparse_attn/evaluation.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/plan.hpp"
#include "sparse_attn/selectors.hpp"
#include "sparse_attn/tensor.hpp"
#include "sparse_attn/thresholds.hpp"
#include "sparse_attn/version.hpp"
