// MSA-style token-max selector on the CPU (docs/design.md §5.7).
//
// Index vectors go through the requested precision once (per-tensor scales over the whole
// tensor), then every query scores the visible keys of each block in float64 (exact products of
// the dequantised values) and keeps the block maximum.
#include <limits>
#include <vector>

#include "selectors/select_common.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/selectors/backend.hpp"
#endif
#include "sparse_attn/selectors.hpp"

namespace sparse_attn {

namespace {

using detail::require;
using detail::Scored;

constexpr double kForced = std::numeric_limits<double>::infinity();
constexpr double kNone = -std::numeric_limits<double>::infinity();

struct IndexShape {
  std::int64_t B, Lq, Lk, Hkv, Hk, Di, Tq, Tk;
  bool causal;
  std::int64_t offset() const { return Lk - Lq; }
  /// Keys [0, key_end(i)) are visible to query i.
  std::int64_t key_end(std::int64_t i) const { return causal ? std::clamp<std::int64_t>(i + offset() + 1, 0, Lk) : Lk; }
  /// The query's own aligned key position, or -1 when the query sees no key.
  std::int64_t aligned(std::int64_t i) const {
    if (causal) return i + offset() >= 0 ? i + offset() : -1;
    return std::clamp<std::int64_t>(i + offset(), 0, Lk - 1);
  }
};

IndexShape check_token_max_args(const std::string& op, const TensorView& qidx, const TensorView& kidx,
                                const TokenMaxOptions& o) {
  require(o.top_k >= 1, op, "options.top_k", [&] { return "must be >= 1, got " + std::to_string(o.top_k); });
  detail::check_precision(op, o.precision);
  detail::check_tensor(op, "qidx", qidx, 4, {DType::bf16, DType::f16, DType::f32});
  detail::check_tensor(op, "kidx", kidx, 4, {DType::bf16, DType::f16, DType::f32});
  detail::check_same_device(op, "kidx", kidx, "qidx", qidx);
  IndexShape s{};
  s.B = qidx.shape[0];
  s.Lq = qidx.shape[1];
  s.Hkv = qidx.shape[2];
  s.Di = qidx.shape[3];
  s.Lk = kidx.shape[1];
  s.Hk = kidx.shape[2];
  s.causal = o.causal;
  require(s.B > 0 && s.Lq > 0 && s.Hkv > 0 && s.Di > 0, op, "qidx",
          [&] { return "every extent must be > 0, got " + detail::shape_string(qidx); });
  require(s.Lk > 0, op, "kidx", [&] { return "every extent must be > 0, got " + detail::shape_string(kidx); });
  detail::check_shape(op, "kidx", kidx, {s.B, -1, -1, s.Di});
  require(s.Hk == 1 || s.Hk == s.Hkv, op, "kidx",
          [&] { return "must have 1 or Hkv = " + std::to_string(s.Hkv) + " heads, got " + std::to_string(s.Hk); });
  detail::check_last_contiguous(op, "qidx", qidx);
  detail::check_last_contiguous(op, "kidx", kidx);
  s.Tq = ceil_div(s.Lq, kTileQ);
  s.Tk = ceil_div(s.Lk, kBlockK);
  return s;
}

void check_capacity(const std::string& op, const std::string& name, const TensorView& idx, int top_k) {
  require(idx.shape[3] >= top_k, op, name,
          [&] { return
              "capacity " + std::to_string(idx.shape[3]) + " is smaller than options.top_k = " +
              std::to_string(top_k); });
}

// scores[j] = max over visible keys s of block j of q . k_s (kNone for blocks without one).
void query_block_scores(const float* q, const detail::QuantizedTensor& kq, std::int64_t b, std::int64_t hk,
                        std::int64_t key_end, std::vector<double>& scores) {
  constexpr std::int64_t kChunk = 32;
  const float* rows[kChunk];
  double dots[kChunk];
  std::fill(scores.begin(), scores.end(), kNone);
  for (std::int64_t s0 = 0; s0 < key_end; s0 += kChunk) {
    const std::int64_t m = std::min(kChunk, key_end - s0);
    for (std::int64_t r = 0; r < m; ++r) rows[r] = kq.row(b, s0 + r, hk);
    detail::dots_f64(q, rows, m, kq.D, dots);
    for (std::int64_t r = 0; r < m; ++r) {
      double& best = scores[static_cast<std::size_t>((s0 + r) / kBlockK)];
      best = std::max(best, detail::sanitize(dots[r]));
    }
  }
}

struct Prepared {
  detail::QuantizedTensor q, k;
};

Prepared prepare(const std::string& op, const TensorView& qidx, const TensorView& kidx, IndexPrecision p) {
  return {detail::load_quantized(op, "qidx", qidx, p), detail::load_quantized(op, "kidx", kidx, p)};
}

}  // namespace

void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out,
                      const TokenMaxOptions& options) {
  const std::string op = "token_max_select";
  const IndexShape s = check_token_max_args(op, qidx, kidx, options);
  detail::check_tensor(op, "out.idx", out.idx, 4, {DType::i32});
  detail::check_shape(op, "out.idx", out.idx, {s.B, s.Hkv, s.Lq, -1});
  check_capacity(op, "out.idx", out.idx, options.top_k);
  detail::check_same_device(op, "out.idx", out.idx, "qidx", qidx);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (qidx.device == Device::cuda) return cuda_backend::token_max_select(qidx, kidx, out, options);
#endif
  if (qidx.device != Device::cpu) detail::unsupported_device(op, "qidx", qidx);

  const Prepared in = prepare(op, qidx, kidx, options.precision);
  detail::parallel_for(s.B * s.Hkv, [&](std::int64_t bg) {
    const std::int64_t b = bg / s.Hkv, g = bg % s.Hkv, hk = s.Hk == 1 ? 0 : g;
    std::vector<double> scores(static_cast<std::size_t>(s.Tk));
    std::vector<Scored> cand;
    std::vector<std::int32_t> ids;
    for (std::int64_t i = 0; i < s.Lq; ++i) {
      const std::int64_t end = s.key_end(i);
      query_block_scores(in.q.row(b, i, g), in.k, b, hk, end, scores);
      const std::int64_t local = options.reserve_local && s.aligned(i) >= 0 ? s.aligned(i) / kBlockK : -1;
      cand.clear();
      for (std::int64_t j = 0; j < ceil_div(end, kBlockK); ++j) {
        const bool forced = j == local || (options.force_block0 && j == 0);
        cand.push_back({forced ? kForced : scores[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)});
      }
      detail::top_k_ascending(cand, options.top_k, ids);
      detail::write_padded(detail::idx_ptr4(out.idx, b, g, i, 0), out.idx.stride[3], out.idx.shape[3], ids);
    }
  });
}

void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out,
                      const TokenMaxOptions& options) {
  const std::string op = "token_max_select";
  const IndexShape s = check_token_max_args(op, qidx, kidx, options);
  detail::check_tensor(op, "out.idx", out.idx, 4, {DType::i32});
  detail::check_shape(op, "out.idx", out.idx, {s.B, s.Hkv, s.Tq, -1});
  check_capacity(op, "out.idx", out.idx, options.top_k);
  detail::check_tensor(op, "out.cnt", out.cnt, 3, {DType::i32});
  detail::check_shape(op, "out.cnt", out.cnt, {s.B, s.Hkv, s.Tq});
  detail::check_same_device(op, "out.idx", out.idx, "qidx", qidx);
  detail::check_same_device(op, "out.cnt", out.cnt, "qidx", qidx);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (qidx.device == Device::cuda) return cuda_backend::token_max_select(qidx, kidx, out, options);
#endif
  if (qidx.device != Device::cpu) detail::unsupported_device(op, "qidx", qidx);

  const Prepared in = prepare(op, qidx, kidx, options.precision);
  detail::parallel_for(s.B * s.Hkv * s.Tq, [&](std::int64_t job) {
    const std::int64_t t = job % s.Tq, g = (job / s.Tq) % s.Hkv, b = job / (s.Tq * s.Hkv);
    const std::int64_t hk = s.Hk == 1 ? 0 : g;
    const std::int64_t i_first = t * kTileQ, i_last = std::min(s.Lq, i_first + kTileQ) - 1;
    std::vector<double> row(static_cast<std::size_t>(s.Tk)), tile(static_cast<std::size_t>(s.Tk), kNone);
    std::vector<std::uint8_t> reserved(static_cast<std::size_t>(s.Tk), 0);
    for (std::int64_t i = i_first; i <= i_last; ++i) {
      query_block_scores(in.q.row(b, i, g), in.k, b, hk, s.key_end(i), row);
      for (std::int64_t j = 0; j < s.Tk; ++j)
        tile[static_cast<std::size_t>(j)] = std::max(tile[static_cast<std::size_t>(j)], row[static_cast<std::size_t>(j)]);
      if (options.reserve_local && s.aligned(i) >= 0) reserved[static_cast<std::size_t>(s.aligned(i) / kBlockK)] = 1;
    }
    if (options.force_block0) reserved[0] = 1;  // only candidates are listed: a tile seeing no key stays empty
    std::vector<Scored> cand;
    for (std::int64_t j = 0; j < ceil_div(s.key_end(i_last), kBlockK); ++j)
      cand.push_back({reserved[static_cast<std::size_t>(j)] ? kForced : tile[static_cast<std::size_t>(j)],
                      static_cast<std::int32_t>(j)});
    std::vector<std::int32_t> ids;
    const std::int64_t cnt = detail::top_k_ascending(cand, options.top_k, ids);
    detail::write_padded(detail::idx_ptr4(out.idx, b, g, t, 0), out.idx.stride[3], out.idx.shape[3], ids);
    *reinterpret_cast<std::int32_t*>(static_cast<char*>(out.cnt.data) +
                                     (b * out.cnt.stride[0] + g * out.cnt.stride[1] + t * out.cnt.stride[2]) * 4) =
        static_cast<std::int32_t>(cnt);
  });
}

std::size_t token_max_workspace_bytes(const TensorView& qidx, const TensorView& kidx, bool tile_lists,
                                      const TokenMaxOptions& options) {
  const std::string op = "token_max_workspace_bytes";
  detail::require(qidx.ndim == 4, op, "qidx", [&] { return "expected [B, Lq, Hkv, Di], got " + qidx.describe(); });
  detail::require(kidx.ndim == 4, op, "kidx", [&] { return "expected [B, Lk, 1 or Hkv, Di], got " + kidx.describe(); });
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (qidx.device == Device::cuda)
    return cuda_backend::token_max_scratch_bytes(qidx.shape[0], qidx.shape[1], kidx.shape[1], qidx.shape[2],
                                                 kidx.shape[2], qidx.shape[3], options.precision, tile_lists);
#else
  (void)tile_lists, (void)options;
#endif
  return 0;
}

}  // namespace sparse_attn
