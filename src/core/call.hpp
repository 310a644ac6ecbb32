// The arguments of one executor call as its front end resolved them (src/attention): checked once
// there (check_attention_args, the selection's structure and, unless trusted, its contents), with the
// softmax scale and the options in effect. The CPU and CUDA backends take these and check only what
// depends on their device (alignment, 32-bit index ranges, shared memory, workspace size).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::detail {

/// q, k, v, out and lse agree with each other and with `p` (check_attention_args), every one on the
/// device of q (device index `device`).
struct AttentionCall {
  TensorView q, k, v, out;
  std::optional<TensorView> lse;
  ProblemShape p;            // causal included
  float scale = 1.0f;        // softmax scale in effect (options.softmax_scale or 1 / sqrt(D))
  float scale_log2 = 1.0f;   // scale * log2(e): for scores that go through exp2
  int device = 0;            // q.device_index
  void* stream = nullptr;    // options.stream
  bool trusted = false;      // options.trusted: the selection was not validated
};

/// check_attention_args and the softmax scale of one call: Error naming `op` and the argument at fault.
/// With `check_outputs`, out and lse must share no memory with q, k, v or each other; false only where
/// there is no output yet (query_sparse_plan passes q in its place).
AttentionCall resolve_call(const std::string& op, const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const std::optional<TensorView>& lse,
                           const AttentionOptions& options, bool check_outputs = true);

/// TileLists whose idx is [B, G, Tq, Kmax] and cnt [B, G, Tq] on q's device, G = Hkv or Hq.
struct TileCall {
  TileLists tiles;
  std::int64_t G = 0;
  std::int64_t Kmax = 0;
};

/// TokenLists whose idx is [B, Hkv, Lq, Kt] on q's device.
struct TokenCall {
  TokenLists tokens;
  std::int64_t Kt = 0;
};

/// QueryLists whose idx is [B, Hkv, Lq, Kq] on q's device, with the query_sparse options in effect:
/// a known partial precision and schedule, and the merge window resolved (resolve_merge_window; 1 to 8).
struct QueryCall {
  QueryLists lists;
  std::int64_t Kq = 0;
  PartialPrecision partials = PartialPrecision::f32;
  QuerySchedule schedule = QuerySchedule::kv_centric;
  int merge_window = 1;
};

}  // namespace sparse_attn::detail
