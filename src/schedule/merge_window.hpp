// Merged slots of the KV-centric query_sparse (host only): the choice of the merge window, and of the
// query bands of the reverse index's bins when it does not merge. Used by
// src/cuda/query_sparse/query_sparse.cu, the planner and the query_sparse front end (src/attention);
// tested on the CPU (tests/cpu/test_merge_window.cpp).
//
// With a merge window of W blocks, a query's chosen blocks that fall in one window of W consecutive
// blocks (window w: blocks [W w, W w + W)) form one piece: the attention kernel runs the online softmax
// over the piece's blocks and writes one partial for it, so the partials written and read back by the
// combine shrink from one per chosen block to one per non-empty window. A piece's work item holds the
// rows of every query with the same blocks in that window (its bin: window and block mask, 2^W masks
// per window), so the bins must stay populated: a bin of a few rows still costs a whole 64-row tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/check.hpp"
#include "sparse_attn/formats.hpp"

namespace sparse_attn::cuda_backend {

inline constexpr int kMaxMergeWindow = 8;
// The merge pass reads each query's whole list once per slot (Kq^2 loads per query).
inline constexpr std::int64_t kMaxMergeSlots = 64;
// A merged piece is worth its bin when the typical multi-block piece shares its bin with at least
// one tile of rows (kAttendRows: the attention kernel's 64-row tile).
inline constexpr double kMinRowsPerBin = 64.0;
// A piece of several blocks runs its later blocks in 64-key halves, slower per block than a single
// block's tile, and its bins cost the reverse index more; merging paid on the H200 only where it
// removed most partials (docs/notes/kv_attention.md, merged slots: query16of32 with W = 8 saves 3/4 of
// the slots, whole call -9 %; W = 5 to 7 save 0.6-0.7, -5 to -9 %; W = 4 saves about half, no gain;
// query-long loses at every window from 4 to 8, +11 to +34 %, with a fifth of the slots saved at W = 8).
// So the automatic choice asks for at least this share of the slots saved.
inline constexpr double kMinSavedShare = 0.6;
// The reverse index keeps a per-(b, group) histogram of the bins in shared memory up to this many
// bins (reverse_index.cu, kHistBins); past it every slot would cost a global atomic. Merging is not
// offered past it, which also bounds the workspace reserved for the bins.
inline constexpr std::int64_t kMaxMergeBins = 12 * 1024;

/// Bins per (b, group) of the CSR for Tk KV blocks and merge window W (1: the blocks themselves).
inline std::int64_t merge_bins(std::int64_t Tk, int W) {
  if (W <= 1) return Tk;
  return (Tk + W - 1) / W << W;
}

/// The most bins per (b, group) any window the lists allow can make: what the workspace reserves.
inline std::int64_t max_merge_bins(std::int64_t Tk, std::int64_t Kq) {
  std::int64_t most = Tk;
  if (Kq > kMaxMergeSlots) return most;
  for (int W = 2; W <= kMaxMergeWindow; ++W)
    if (merge_bins(Tk, W) <= kMaxMergeBins) most = std::max(most, merge_bins(Tk, W));
  return most;
}

/// For lists of Kq random distinct blocks of Tk (each block chosen with probability rho = Kq / Tk),
/// `rows` (query, head) rows per (b, group) and window W: the share of the slots that merging saves
/// (E[(k - 1)+] per window over Kq, k ~ Binomial(n, rho) for a window of n blocks: Tk / W windows of W
/// and one of Tk % W), and the rows in the bin of a typical piece of two or more blocks (sum over
/// windows and k >= 2 of P(k) * rows * P(k) / C(n, k), over the sum of P(k >= 2)).
struct MergeEstimate {
  double saved = 0.0;
  double rows_per_bin = 0.0;
};

inline MergeEstimate merge_estimate(std::int64_t Tk, std::int64_t Kq, std::int64_t rows, int W) {
  MergeEstimate e;
  if (W <= 1 || Tk <= 0 || Kq <= 0) return e;
  const double rho = std::min(1.0, static_cast<double>(Kq) / static_cast<double>(Tk));
  // One window of n blocks: E[(k - 1)+] and the sums behind rows_per_bin.
  struct Window {
    double extra = 0.0, multi = 0.0, weighted = 0.0;
  };
  const auto window = [&](int n) {
    Window w;
    double choose = 1.0;
    for (int k = 0; k <= n; ++k) {
      if (k > 0) choose = choose * (n - k + 1) / k;
      const double pk = choose * std::pow(rho, k) * std::pow(1.0 - rho, n - k);
      if (k < 2) continue;
      w.multi += pk;
      w.weighted += pk * static_cast<double>(rows) * pk / choose;
      w.extra += (k - 1) * pk;
    }
    return w;
  };
  const std::int64_t full = Tk / W;
  const int rest = static_cast<int>(Tk % W);
  const Window a = window(W), b = window(rest);
  e.saved = (static_cast<double>(full) * a.extra + (rest > 1 ? b.extra : 0.0)) / static_cast<double>(Kq);
  const double multi = static_cast<double>(full) * a.multi + b.multi, weighted = static_cast<double>(full) * a.weighted + b.weighted;
  e.rows_per_bin = multi > 0.0 ? weighted / multi : 0.0;
  return e;
}

/// The merge window to run: `requested` if it is 1 to 8 (1: no merging), or for 0 (automatic)
/// the window of 2 to 8 blocks that saves the most partials, at least kMinSavedShare of the slots, while
/// its bins stay populated (kMinRowsPerBin), and 1 if none does. Tk KV blocks, Kq slots per query, rows = group size x Lq.
/// Errors name `argument` for a value outside [0, 8], for merging with more than kMaxMergeSlots slots
/// per query, and for a window whose bins exceed kMaxMergeBins.
inline int resolve_merge_window(std::int64_t Tk, std::int64_t Kq, std::int64_t rows, int requested,
                                const std::string& op, const std::string& argument) {
  detail::require(requested >= 0 && requested <= kMaxMergeWindow, op, argument, [&] {
    return "is 0 (automatic), 1 (off) or a window of 2 to " + std::to_string(kMaxMergeWindow) + " blocks, got " +
           std::to_string(requested);
  });
  if (requested == 1) return 1;
  if (requested > 1) {
    detail::require(Kq <= kMaxMergeSlots, op, argument, [&] {
      return "merging slots takes at most " + std::to_string(kMaxMergeSlots) + " slots per query, the lists have " +
             std::to_string(Kq) + " (use 1)";
    });
    detail::require(merge_bins(Tk, requested) <= kMaxMergeBins, op, argument, [&] {
      return "a window of " + std::to_string(requested) + " blocks over " + std::to_string(Tk) + " KV blocks makes " +
             std::to_string(merge_bins(Tk, requested)) + " bins per (batch, KV head), more than " +
             std::to_string(kMaxMergeBins) + " (use a smaller window or 1)";
    });
    return requested;
  }
  if (Kq < 2 || Kq > kMaxMergeSlots) return 1;
  int best = 1;
  double best_saved = 0.0;
  for (int W = kMaxMergeWindow; W >= 2; --W) {
    if (merge_bins(Tk, W) > kMaxMergeBins) continue;
    const MergeEstimate e = merge_estimate(Tk, Kq, rows, W);
    if (e.rows_per_bin >= kMinRowsPerBin && e.saved >= kMinSavedShare && e.saved > best_saved) {
      best = W;
      best_saved = e.saved;
    }
  }
  return best;
}

// Query bands (without merging): a (b, group)'s work items walk every KV block's rows of one band of
// consecutive queries before the next band's, so the Q rows that band's items gather (each query's
// row is gathered once per chosen block) stay in L2 between their uses instead of coming from DRAM
// again (docs/notes/kv_attention.md, query bands: query-long, 33.5 MB of Q per (b, group), in 4 bands
// of 8.4 MB: the attention's DRAM reads 2.42 -> 1.05 GB, its time back to back -4 %, the whole call's
// -1.2 %, since the reverse index scans four times the bins). A band of at most
// kBandQBytes of Q, as long as every band's bins keep about a whole work item of rows (kBandMinRows
// per bin) and the bins fit the reverse index's shared histogram.
inline constexpr std::int64_t kBandQBytes = 8LL << 20;
inline constexpr std::int64_t kBandMinRows = 768;  // kRowsPerItem of the attention kernel

/// Query bands per (b, group) for Lq queries of `group` heads of D elements (`elem` bytes each), Tk KV
/// blocks and Kq slots per query (1: none). `forced` > 0 asks for that many (tests and timings), capped
/// by Lq and the shared histogram; merging (W > 1) never uses bands.
inline int resolve_query_bands(std::int64_t Lq, std::int64_t group, std::int64_t D, std::int64_t elem,
                               std::int64_t Tk, std::int64_t Kq, int W, int forced) {
  if (W > 1 || Lq <= 0 || Tk <= 0) return 1;
  const std::int64_t most = std::max<std::int64_t>(1, std::min(Lq, kMaxMergeBins / Tk));
  if (forced > 0) return static_cast<int>(std::min<std::int64_t>(forced, most));
  const std::int64_t q_bytes = Lq * group * D * elem;
  std::int64_t bands = (q_bytes + kBandQBytes - 1) / kBandQBytes;
  bands = std::min(bands, Lq * Kq * group / (Tk * kBandMinRows));
  return static_cast<int>(std::clamp<std::int64_t>(bands, 1, most));
}

/// The same for a problem shape and lists of Kq slots per query (rows = group size x Lq).
inline int resolve_merge_window(const ProblemShape& p, std::int64_t Kq, int requested, const std::string& op,
                                const std::string& argument) {
  return resolve_merge_window(p.Tk(), Kq, p.group_size() * p.Lq, requested, op, argument);
}

}  // namespace sparse_attn::cuda_backend
