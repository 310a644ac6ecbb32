#include "common/selector_contract.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace sparse_attn::testing {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string row_name(const std::string& what, std::int64_t r) { return what + ", row " + std::to_string(r); }

}  // namespace

ContractReport expect_top_k_within(const ExactScores& exact, const std::int32_t* ids, std::int64_t stride,
                                   std::int64_t width, const std::int32_t* count, int top_k,
                                   const std::function<double(std::int64_t row)>& eps, const std::string& what) {
  ContractReport rep;
  rep.worst_margin = kInf;
  const std::int64_t C = exact.candidates;
  std::vector<char> chosen(static_cast<std::size_t>(C));
  std::vector<std::int32_t> order;
  int failures = 0;
  for (std::int64_t r = 0; r < exact.rows && failures < 10; ++r) {
    const std::int32_t* row = ids + r * stride;
    std::int64_t candidates = 0, forced = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const double s = exact.at(r, c);
      if (std::isnan(s)) {
        ADD_FAILURE() << row_name(what, r) << ": NaN exact score at " << c;
        return rep;
      }
      candidates += s > -kInf;
      forced += s == kInf;
    }
    const std::int64_t want = std::min<std::int64_t>(top_k, candidates);
    std::int64_t n = 0;
    while (n < width && row[n] >= 0) ++n;
    bool ok = true;
    std::ostringstream why;
    for (std::int64_t s = n; s < width; ++s)
      if (row[s] != -1) ok = false, why << " slot " << s << " holds " << row[s] << " after the end;";
    if (count != nullptr && count[r] != n) ok = false, why << " count " << count[r] << " != " << n << " ids;";
    if (n != want) ok = false, why << " holds " << n << " ids, want min(top_k " << top_k << ", " << candidates << " candidates);";
    std::fill(chosen.begin(), chosen.end(), 0);
    for (std::int64_t s = 0; s < n; ++s) {
      const std::int32_t c = row[s];
      if (c < 0 || c >= C) {
        ok = false, why << " id " << c << " out of range;";
        continue;
      }
      if (s > 0 && c <= row[s - 1]) ok = false, why << " ids not ascending at slot " << s << ";";
      if (exact.at(r, c) == -kInf) ok = false, why << " id " << c << " is not a candidate;";
      chosen[static_cast<std::size_t>(c)] = 1;
    }
    // Forced ids: all of them when they fit, else the lower ones (the tie rule among +inf).
    std::int64_t forced_seen = 0;
    for (std::int64_t c = 0; c < C && forced_seen < std::min<std::int64_t>(forced, top_k); ++c)
      if (exact.at(r, c) == kInf) {
        ++forced_seen;
        if (!chosen[static_cast<std::size_t>(c)]) ok = false, why << " forced id " << c << " missing;";
      }
    double min_sel = kInf, max_unsel = -kInf;
    for (std::int64_t c = 0; c < C; ++c) {
      const double s = exact.at(r, c);
      if (s == -kInf) continue;
      if (chosen[static_cast<std::size_t>(c)]) min_sel = std::min(min_sel, s);
      else max_unsel = std::max(max_unsel, s);
    }
    const double e = eps(r);
    if (min_sel != kInf && max_unsel != -kInf) {
      const double margin = min_sel - max_unsel + e;
      rep.worst_margin = std::min(rep.worst_margin, margin);
      if (!(margin >= 0.0)) ok = false, why << " min selected " << min_sel << " < max unselected " << max_unsel << " - eps " << e << ";";
    }
    // The float64 top-k with ties to the lower id, for the report.
    order.clear();
    for (std::int64_t c = 0; c < C; ++c)
      if (exact.at(r, c) > -kInf) order.push_back(static_cast<std::int32_t>(c));
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return exact.at(r, a) > exact.at(r, b); });
    bool same = true;
    for (std::int64_t i = 0; i < want && i < static_cast<std::int64_t>(order.size()); ++i)
      same = same && chosen[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])];
    rep.rows_differing += !same;
    ++rep.rows_checked;
    if (!ok) {
      ADD_FAILURE() << row_name(what, r) << ":" << why.str();
      ++failures;
    }
  }
  return rep;
}

double mean_kept_fraction(const ExactScores& weight, const std::int32_t* ids, std::int64_t stride, std::int64_t width) {
  double sum = 0.0;
  for (std::int64_t r = 0; r < weight.rows; ++r) {
    double total = 0.0, kept = 0.0;
    for (std::int64_t c = 0; c < weight.candidates; ++c) {
      const double w = weight.at(r, c);
      if (w > 0.0) total += w;
    }
    for (std::int64_t s = 0; s < width && ids[r * stride + s] >= 0; ++s) {
      const double w = weight.at(r, ids[r * stride + s]);
      if (w > 0.0) kept += w;
    }
    sum += total > 0.0 ? kept / total : 1.0;
  }
  return weight.rows > 0 ? sum / static_cast<double>(weight.rows) : 1.0;
}

}  // namespace sparse_attn::testing
