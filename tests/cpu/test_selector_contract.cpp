// The contract checker of the GPU selector tests (tests/common/selector_contract.hpp) on hand-made
// rows: it accepts a top-k within ε and flags every rule a list can break.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "common/selector_contract.hpp"

namespace st = sparse_attn::testing;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One row over 6 candidates: id 0 forced, id 5 not visible, scores 1.0, 0.5, 0.499, 0.2 for ids 1-4.
st::ExactScores one_row() {
  st::ExactScores e;
  e.rows = 1, e.candidates = 6;
  e.score = {kInf, 1.0, 0.5, 0.499, 0.2, -kInf};
  return e;
}

st::ContractReport check(const std::vector<std::int32_t>& ids, int top_k, double eps, std::int32_t count) {
  return st::expect_top_k_within(one_row(), ids.data(), static_cast<std::int64_t>(ids.size()),
                                 static_cast<std::int64_t>(ids.size()), &count, top_k, [&](std::int64_t) { return eps; },
                                 "case");
}

}  // namespace

TEST(SelectorContract, AcceptsTheExactTopK) {
  const st::ContractReport r = check({0, 1, 2, -1}, 3, 0.0, 3);
  EXPECT_EQ(r.rows_checked, 1);
  EXPECT_EQ(r.rows_differing, 0);
  EXPECT_DOUBLE_EQ(r.worst_margin, 0.5 - 0.499);
}

TEST(SelectorContract, AcceptsANearTieWithinEps) {
  const st::ContractReport r = check({0, 1, 3, -1}, 3, 0.002, 3);
  EXPECT_EQ(r.rows_differing, 1);
  EXPECT_NEAR(r.worst_margin, 0.499 - 0.5 + 0.002, 1e-12);
}

TEST(SelectorContract, FlagsEveryBrokenRule) {
  EXPECT_NONFATAL_FAILURE(check({0, 1, 3, -1}, 3, 0.0005, 3), "min selected");   // outside ε
  EXPECT_NONFATAL_FAILURE(check({1, 2, 3, -1}, 3, 1.0, 3), "forced id 0");       // forced id left out
  EXPECT_NONFATAL_FAILURE(check({0, 2, 1, -1}, 3, 1.0, 3), "not ascending");     // order
  EXPECT_NONFATAL_FAILURE(check({0, 1, 5, -1}, 3, 1.0, 3), "not a candidate");   // invisible id
  EXPECT_NONFATAL_FAILURE(check({0, 1, -1, -1}, 3, 1.0, 2), "holds 2 ids");      // too short
  EXPECT_NONFATAL_FAILURE(check({0, 1, 2, -1}, 3, 0.0, 2), "count 2");           // count disagrees
  EXPECT_NONFATAL_FAILURE(check({0, 1, 2, 7}, 3, 0.0, 3), "out of range");       // stray id
}

TEST(SelectorContract, KeptFraction) {
  st::ExactScores w;
  w.rows = 2, w.candidates = 3;
  w.score = {0.5, 0.25, 0.25, 1.0, 0.0, 0.0};
  const std::vector<std::int32_t> ids = {0, 2, 1, -1};
  EXPECT_DOUBLE_EQ(st::mean_kept_fraction(w, ids.data(), 2, 2), (0.75 + 0.0) / 2);
}
