// FastDiv (src/cuda/common/fast_div.hpp): the host path of the multiply-shift division the CUDA kernels
// use, against `/` and `%` over edge and random divisors and dividends of the whole 31-bit range.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "cuda/common/fast_div.hpp"

namespace {

using sparse_attn::cuda_kernels::FastDiv;

TEST(FastDivTest, MatchesIntegerDivision) {
  constexpr std::int64_t kTop = 0x7fffffffLL;  // largest divisor and dividend
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::int64_t> any(1, kTop);
  std::vector<std::int64_t> divisors;
  for (std::int64_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int k = 1; k <= 31; ++k)
    for (std::int64_t e = -1; e <= 1; ++e) {
      const std::int64_t d = (std::int64_t{1} << k) + e;
      if (d >= 1 && d <= kTop) divisors.push_back(d);
    }
  for (int i = 0; i < 4000; ++i) divisors.push_back(any(rng));
  std::int64_t checked = 0;
  for (const std::int64_t d : divisors) {
    const FastDiv f = FastDiv::make(d);
    std::vector<std::int64_t> ns = {0, 1, d - 1, d, d + 1, kTop, kTop - 1, kTop - d, (kTop / d) * d, (kTop / d) * d - 1};
    for (int i = 0; i < 64; ++i) ns.push_back(any(rng) - 1);
    for (const std::int64_t n : ns) {
      if (n < 0 || n > kTop) continue;
      const auto n32 = static_cast<std::int32_t>(n);
      ASSERT_EQ(f.div(n32), n / d) << "n = " << n << ", d = " << d;
      ASSERT_EQ(f.mod(n32), n % d) << "n = " << n << ", d = " << d;
      ++checked;
    }
  }
  EXPECT_GT(checked, 500000);
}

TEST(FastDivTest, RejectsDivisorsOutsideRange) {
  for (const std::int64_t d : {std::int64_t{0}, std::int64_t{-3}, std::int64_t{0x80000000LL}}) {
    try {
      (void)FastDiv::make(d);
      ADD_FAILURE() << "divisor " << d << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("divisor " + std::to_string(d)), std::string::npos) << e.what();
    }
  }
}

}  // namespace
