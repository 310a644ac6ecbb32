// Public entry points of the executors: argument checks, selection validation, then the one device
// dispatch of each operator (the `if (q.device == Device::cuda)` line is where a backend plugs in).

#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "attention/cpu_backend.hpp"
#include "core/call.hpp"
#include "core/check.hpp"
#include "schedule/merge_window.hpp"
#include "sparse_attn/ops.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/backend.hpp"
#include "cuda/query_sparse/backend.hpp"
#endif

namespace sparse_attn {
namespace {

using detail::require;
using detail::resolve_call;

// A trusted selection skips the content checks, but its shape still decides which memory the
// executor reads, so shapes, dtypes and devices are checked in every case (O(1)).
void check_index(const std::string& op, const std::string& name, const TensorView& t, DType dtype,
                 std::initializer_list<std::int64_t> shape, const TensorView& q) {
  detail::check_tensor(op, name, t, static_cast<int>(shape.size()), {dtype});
  detail::check_shape(op, name, t, shape);
  detail::check_same_device(op, name, t, "q", q);
}

void check_structure(const std::string& op, const TileLists& s, const ProblemShape& p, const TensorView& q) {
  detail::check_tensor(op, "tiles.idx", s.idx, 4, {DType::i32});
  const std::int64_t G = selection_groups(Selection{s}, p, op);
  check_index(op, "tiles.idx", s.idx, DType::i32, {p.B, G, p.Tq(), -1}, q);
  check_index(op, "tiles.cnt", s.cnt, DType::i32, {p.B, G, p.Tq()}, q);
}

void check_structure(const std::string& op, const BlockBits& s, const ProblemShape& p, const TensorView& q) {
  detail::check_tensor(op, "bits.bits", s.bits, 4, {DType::u32});
  const std::int64_t G = selection_groups(Selection{s}, p, op);
  check_index(op, "bits.bits", s.bits, DType::u32, {p.B, G, p.Tq(), ceil_div(p.Tk(), 32)}, q);
}

void check_structure(const std::string& op, const QueryLists& s, const ProblemShape& p, const TensorView& q) {
  check_index(op, "lists.idx", s.idx, DType::i32, {p.B, p.Hkv, p.Lq, -1}, q);
}

void check_structure(const std::string& op, const TokenLists& s, const ProblemShape& p, const TensorView& q) {
  check_index(op, "tokens.idx", s.idx, DType::i32, {p.B, p.Hkv, p.Lq, -1}, q);
}

// A fault that an earlier validated call left on q's device is thrown before this call runs.
void raise_pending_fault(const std::string& op, const TensorView& q, const AttentionOptions& options) {
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) cuda_backend::raise_pending_fault(q.device_index, options.stream, op);
#else
  (void)op, (void)q, (void)options;
#endif
}

// The selection's tensors by argument name: out and lse are written while they are read.
std::vector<std::pair<const char*, TensorView>> tensors_of(const TileLists& s) {
  return {{"tiles.idx", s.idx}, {"tiles.cnt", s.cnt}};
}
std::vector<std::pair<const char*, TensorView>> tensors_of(const BlockBits& s) { return {{"bits.bits", s.bits}}; }
std::vector<std::pair<const char*, TensorView>> tensors_of(const QueryLists& s) { return {{"lists.idx", s.idx}}; }
std::vector<std::pair<const char*, TensorView>> tensors_of(const TokenLists& s) { return {{"tokens.idx", s.idx}}; }

template <class S>
void check_selection(const std::string& op, const S& s, const detail::AttentionCall& a,
                     const AttentionOptions& options) {
  check_structure(op, s, a.p, a.q);
  for (const auto& [name, t] : tensors_of(s)) detail::check_outputs_apart(op, a.out, a.lse, name, t);
  if (!options.trusted) validate(s, a.p, op);
}

}  // namespace

void dense(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
           const std::optional<TensorView>& lse, const AttentionOptions& options) {
  const auto a = resolve_call("dense", q, k, v, out, lse, options);
  raise_pending_fault("dense", q, options);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) return cuda_backend::dense(a);
#endif
  if (q.device == Device::cuda) detail::unsupported_device("dense", "q", q);
  detail::cpu::dense(a);
}

void tile_sparse(const TensorView& q, const TensorView& k, const TensorView& v, const TileLists& tiles,
                 const TensorView& out, const std::optional<TensorView>& lse, const AttentionOptions& options) {
  const auto a = resolve_call("tile_sparse", q, k, v, out, lse, options);
  raise_pending_fault("tile_sparse", q, options);
  check_selection("tile_sparse", tiles, a, options);
  const detail::TileCall t{tiles, tiles.idx.shape[1], tiles.idx.shape[3]};
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) return cuda_backend::tile_sparse(a, t);
#endif
  if (q.device == Device::cuda) detail::unsupported_device("tile_sparse", "q", q);
  detail::cpu::tile_sparse(a, t);
}

void bits_sparse(const TensorView& q, const TensorView& k, const TensorView& v, const BlockBits& bits,
                 const TensorView& out, const std::optional<TensorView>& lse, const AttentionOptions& options) {
  const auto a = resolve_call("bits_sparse", q, k, v, out, lse, options);
  raise_pending_fault("bits_sparse", q, options);
  check_selection("bits_sparse", bits, a, options);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) return cuda_backend::bits_sparse(a, bits);
#endif
  if (q.device == Device::cuda) detail::unsupported_device("bits_sparse", "q", q);
  detail::cpu::bits_sparse(a, bits);
}

void check_device_faults(std::optional<int> device) {
#if defined(SPARSE_ATTN_WITH_CUDA)
  cuda_backend::check_device_faults(device);
#else
  (void)device;
#endif
}

const char* query_schedule_name(QuerySchedule s) {
  switch (s) {
    case QuerySchedule::kv_centric: return "kv_centric";
    case QuerySchedule::group_centric: return "group_centric";
  }
  return "unknown";
}

void query_sparse(const TensorView& q, const TensorView& k, const TensorView& v, const QueryLists& lists,
                  const TensorView& out, const std::optional<TensorView>& lse, const QuerySparseOptions& options) {
  const auto a = resolve_call("query_sparse", q, k, v, out, lse, options);
  raise_pending_fault("query_sparse", q, options);
  require(options.partials == PartialPrecision::f32 || options.partials == PartialPrecision::bf16, "query_sparse",
          "options.partials",
          [&] { return "unknown partial precision " + std::to_string(static_cast<int>(options.partials)); });
  require(options.schedule == QuerySchedule::kv_centric || options.schedule == QuerySchedule::group_centric,
          "query_sparse", "options.schedule",
          [&] { return "unknown schedule " + std::to_string(static_cast<int>(options.schedule)); });
  check_selection("query_sparse", lists, a, options);
  const std::int64_t Kq = lists.idx.shape[3];
  // Checked on every device (the CPU reference computes the same attention without merging).
  const detail::QueryCall c{lists, Kq, options.partials, options.schedule,
                            cuda_backend::resolve_merge_window(a.p, Kq, options.merge_window,
                                                               "query_sparse", "options.merge_window")};
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) return cuda_backend::query_sparse(a, c);
#endif
  if (q.device == Device::cuda) detail::unsupported_device("query_sparse", "q", q);
  detail::cpu::query_sparse(a, c);
}

void token_sparse(const TensorView& q, const TensorView& k, const TensorView& v, const TokenLists& tokens,
                  const TensorView& out, const std::optional<TensorView>& lse, const AttentionOptions& options) {
  const auto a = resolve_call("token_sparse", q, k, v, out, lse, options);
  raise_pending_fault("token_sparse", q, options);
  check_selection("token_sparse", tokens, a, options);
  const detail::TokenCall t{tokens, tokens.idx.shape[3]};
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) return cuda_backend::token_sparse(a, t);
#endif
  if (q.device == Device::cuda) detail::unsupported_device("token_sparse", "q", q);
  detail::cpu::token_sparse(a, t);
}

void sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v, const Selection& selection,
                      const TensorView& out, const std::optional<TensorView>& lse, const AttentionOptions& options) {
  std::visit(
      [&](const auto& s) {
        using S = std::decay_t<decltype(s)>;
        if constexpr (std::is_same_v<S, AllBlocks>) {
          dense(q, k, v, out, lse, options);
        } else if constexpr (std::is_same_v<S, TileLists>) {
          tile_sparse(q, k, v, s, out, lse, options);
        } else if constexpr (std::is_same_v<S, BlockBits>) {
          bits_sparse(q, k, v, s, out, lse, options);
        } else if constexpr (std::is_same_v<S, QueryLists>) {
          QuerySparseOptions qo;
          static_cast<AttentionOptions&>(qo) = options;
          query_sparse(q, k, v, s, out, lse, qo);
        } else {
          static_assert(std::is_same_v<S, TokenLists>);
          token_sparse(q, k, v, s, out, lse, options);
        }
      },
      selection);
}

}  // namespace sparse_attn
