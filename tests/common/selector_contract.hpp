// The GPU selectors' contract (docs/design.md §5.7), checked against float64 scores computed on the
// host: each list is a top-k of the exact scores up to the kernel's stated bound ε.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sparse_attn::testing {

/// Exact scores of one selection problem: `rows` lists, each over `candidates` ids (blocks or keys).
/// score[r * candidates + c]: the float64 score, -inf where c is not a candidate of row r (not
/// visible), +inf where it is forced (sink, local block). NaN is not allowed.
struct ExactScores {
  std::int64_t rows = 0, candidates = 0;
  std::vector<double> score;
  double& at(std::int64_t r, std::int64_t c) { return score[static_cast<std::size_t>(r * candidates + c)]; }
  double at(std::int64_t r, std::int64_t c) const { return score[static_cast<std::size_t>(r * candidates + c)]; }
};

/// Outcome of a contract check, for reports: the worst margin seen, min over rows of
/// (min selected score) - (max unselected score) + eps(row) (>= 0 when the contract holds), and the
/// rows whose selected set differs from the float64 top-k (allowed within ε).
struct ContractReport {
  std::int64_t rows_checked = 0;
  std::int64_t rows_differing = 0;  // selected set != the float64 top-k with ties to the lower id
  double worst_margin = 0.0;
};

/// Checks every row of a selector's output against `exact` (gtest failures naming `what` and the
/// row): ids[r * stride .. + width) hold the row's list, ascending, -1 padded; `count` (when given)
/// its length. The list must hold exactly min(top_k, candidates of the row) ids, all candidates, no
/// repeats; every forced id is in it when the forced ids fit in top_k (else the lower forced ids);
/// and min(score of a selected id) >= max(score of an unselected candidate) - eps(r).
ContractReport expect_top_k_within(const ExactScores& exact, const std::int32_t* ids, std::int64_t stride,
                                   std::int64_t width, const std::int32_t* count, int top_k,
                                   const std::function<double(std::int64_t row)>& eps, const std::string& what);

/// Kept mass of a selection: for each row, sum over selected ids of weight[r, c], divided by the sum
/// over the row's candidates (rows without weight count as 1). Returns the mean over rows. `weight`
/// has the layout of ExactScores (e.g. a block's share of the row's attention mass); -inf / 0 outside.
double mean_kept_fraction(const ExactScores& weight, const std::int32_t* ids, std::int64_t stride, std::int64_t width);

}  // namespace sparse_attn::testing
