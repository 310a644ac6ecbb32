// Selectors against brute-force scorers written here: representatives and visibility from double
// loops over every pair, quantisation re-done through the public round trip, exact ranking with
// the lower-id tie rule. Ids must match exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
using sa::DType;
using sa::HostTensor;
using sa::IndexPrecision;
using sa::kBlockK;
using sa::kTileQ;

namespace {

using I64 = std::int64_t;

struct Cand {
  double score;
  int id;
  bool forced;
};

// Forced first (among themselves by id), then higher score, then lower id; the best min(k, n),
// ascending.
std::vector<int> rank_top_k(std::vector<Cand> c, I64 k) {
  std::sort(c.begin(), c.end(), [](const Cand& a, const Cand& b) {
    if (a.forced != b.forced) return a.forced;
    if (!a.forced && a.score != b.score) return a.score > b.score;
    return a.id < b.id;
  });
  std::vector<int> ids;
  for (I64 i = 0; i < std::min<I64>(k, static_cast<I64>(c.size())); ++i) ids.push_back(c[static_cast<std::size_t>(i)].id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

bool visible(bool causal, I64 Lq, I64 Lk, I64 i, I64 s) { return !causal || s <= i + (Lk - Lq); }

double dot(const float* a, const float* b, I64 n) {
  double s = 0.0;
  for (I64 d = 0; d < n; ++d) s += static_cast<double>(a[d]) * static_cast<double>(b[d]);
  return s;
}

std::vector<float> as_floats(const HostTensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (I64 i = 0; i < t.numel(); ++i) out[static_cast<std::size_t>(i)] = static_cast<float>(sa::testing::element(t, i));
  return out;
}

// The tensor as the selectors see it: per-tensor scale from its amax, rows of `row` elements
// rounded through the precision.
std::vector<float> quantized(const HostTensor& t, IndexPrecision p, I64 row) {
  std::vector<float> x = as_floats(t);
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float scale = p == IndexPrecision::fp8_e4m3 ? amax / 448.0f : p == IndexPrecision::fp4_e2m1 ? amax / 2688.0f : 1.0f;
  for (I64 r = 0; r < t.numel() / row; ++r) sa::quantize_dequantize(x.data() + r * row, row, p, scale);
  return x;
}

std::int32_t at(const HostTensor& t, I64 a, I64 b, I64 c, I64 d) {
  const auto& s = t.shape();
  return t.data<std::int32_t>()[((a * s[1] + b) * s[2] + c) * s[3] + d];
}

// Checks one list row: ids[:n] equal `want`, the rest -1 (so every slot was written).
void expect_row(const HostTensor& idx, I64 a, I64 b, I64 c, const std::vector<int>& want, const std::string& where) {
  std::vector<int> got;
  for (I64 s = 0; s < idx.shape()[3]; ++s) got.push_back(at(idx, a, b, c, s));
  std::vector<int> padded = want;
  padded.resize(static_cast<std::size_t>(idx.shape()[3]), -1);
  ASSERT_EQ(got, padded) << where;
}

std::string where(I64 b, I64 g, I64 t) {
  return "at [" + std::to_string(b) + ", " + std::to_string(g) + ", " + std::to_string(t) + "]";
}

template <class F>
void expect_error(F&& f, const std::string& argument, const std::string& fragment = "") {
  try {
    f();
    ADD_FAILURE() << "no Error thrown (expected argument '" << argument << "')";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    if (!fragment.empty()) EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

// ---- pooled ------------------------------------------------------------------------------------

struct PooledCase {
  I64 B, Lq, Lk, Hq, Hkv, D;
  DType dtype;
  sa::PooledOptions o;
};

// Brute force for one (b, g, t): representatives by explicit sums, visibility by all pairs.
std::vector<int> brute_pooled(const PooledCase& c, const std::vector<float>& q, const std::vector<float>& k, I64 b,
                              I64 g, I64 t) {
  const I64 r = c.o.representatives, span = kTileQ / r, Tk = sa::ceil_div(c.Lk, kBlockK), group = c.Hq / c.Hkv;
  const I64 off = c.Lk - c.Lq, i0 = t * kTileQ, i1 = std::min(c.Lq, i0 + kTileQ);
  auto rep = [&](const std::vector<float>& x, I64 L, I64 H, I64 h, I64 first, I64& last) {
    std::vector<double> sum(static_cast<std::size_t>(c.D), 0.0);
    const I64 end = std::min(L, first + span);
    for (I64 l = first; l < end; ++l)
      for (I64 d = 0; d < c.D; ++d) sum[static_cast<std::size_t>(d)] += x[static_cast<std::size_t>(((b * L + l) * H + h) * c.D + d)];
    std::vector<float> mean(static_cast<std::size_t>(c.D));
    for (I64 d = 0; d < c.D; ++d) mean[static_cast<std::size_t>(d)] = static_cast<float>(sum[static_cast<std::size_t>(d)] / double(end - first));
    last = end - 1;
    return mean;
  };
  std::vector<Cand> cand;
  for (I64 j = 0; j < Tk; ++j) {
    bool any = false;
    for (I64 i = i0; i < i1 && !any; ++i)
      for (I64 s = j * kBlockK; s < std::min(c.Lk, (j + 1) * kBlockK) && !any; ++s) any = visible(c.o.causal, c.Lq, c.Lk, i, s);
    if (!any) continue;
    double best = -std::numeric_limits<double>::infinity();
    for (I64 h = g * group; h < (g + 1) * group; ++h)
      for (I64 a = 0; a < r; ++a) {
        if (i0 + a * span >= c.Lq) continue;
        I64 q_last = 0, k_last = 0;
        const auto qr = rep(q, c.Lq, c.Hq, h, i0 + a * span, q_last);
        for (I64 e = 0; e < r; ++e) {
          const I64 k_first = j * kBlockK + e * span;
          if (k_first >= c.Lk) continue;
          if (c.o.causal && k_first > q_last + off) continue;
          const auto kr = rep(k, c.Lk, c.Hkv, g, k_first, k_last);
          best = std::max(best, dot(qr.data(), kr.data(), c.D));
        }
      }
    bool forced = c.o.force_block0 && j == 0;
    if (c.o.force_local) {
      if (c.o.causal) {
        for (I64 i = i0; i < i1; ++i) forced = forced || (i + off >= 0 && (i + off) / kBlockK == j);
      } else {
        forced = forced || std::min(i0 * c.Lk / c.Lq / kBlockK, Tk - 1) == j;
      }
    }
    cand.push_back({best, static_cast<int>(j), forced});
  }
  return rank_top_k(cand, c.o.top_k);
}

struct PooledRun {
  HostTensor idx, cnt;
};

PooledRun run_pooled(const PooledCase& c, const HostTensor& q, const HostTensor& k, I64 extra_slots = 2) {
  const I64 Tq = sa::ceil_div(c.Lq, kTileQ);
  PooledRun out{HostTensor(DType::i32, {c.B, c.Hkv, Tq, c.o.top_k + extra_slots}), HostTensor(DType::i32, {c.B, c.Hkv, Tq})};
  sa::testing::poison(out.idx);
  sa::testing::poison(out.cnt);
  sa::pooled_select(q.view(), k.view(), {out.idx.view(), out.cnt.view()}, c.o);
  return out;
}

sa::ProblemShape problem(I64 B, I64 Lq, I64 Lk, I64 Hq, I64 Hkv, I64 D, bool causal) {
  sa::ProblemShape p;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = causal;
  return p;
}

void check_pooled(const PooledCase& c, const HostTensor& q, const HostTensor& k) {
  const PooledRun out = run_pooled(c, q, k);
  // Valid for the executors as produced (ascending, distinct, in range, counts within capacity).
  EXPECT_NO_THROW(sa::validate(sa::TileLists{out.idx.view(), out.cnt.view()},
                               problem(c.B, c.Lq, c.Lk, c.Hq, c.Hkv, c.D, c.o.causal), "test"));
  const auto qf = as_floats(q), kf = as_floats(k);
  for (I64 b = 0; b < c.B; ++b)
    for (I64 g = 0; g < c.Hkv; ++g)
      for (I64 t = 0; t < sa::ceil_div(c.Lq, kTileQ); ++t) {
        const auto want = brute_pooled(c, qf, kf, b, g, t);
        expect_row(out.idx, b, g, t, want, where(b, g, t));
        ASSERT_EQ(out.cnt.data<std::int32_t>()[(b * c.Hkv + g) * sa::ceil_div(c.Lq, kTileQ) + t],
                  static_cast<std::int32_t>(want.size()))
            << where(b, g, t);
      }
}

sa::PooledOptions pooled_opts(int r, int top_k, bool causal, bool local, bool block0) {
  sa::PooledOptions o;
  o.representatives = r;
  o.top_k = top_k;
  o.causal = causal;
  o.force_local = local;
  o.force_block0 = block0;
  return o;
}

TEST(Pooled, MatchesBruteForceOnRandomInputs) {
  const PooledCase cases[] = {
      {2, 300, 1000, 4, 2, 32, DType::f32, pooled_opts(1, 3, false, true, false)},
      {2, 300, 1000, 4, 2, 32, DType::f32, pooled_opts(4, 3, false, true, false)},
      {1, 1013, 1013, 2, 2, 16, DType::bf16, pooled_opts(4, 4, true, true, true)},
      {1, 1013, 1013, 2, 1, 16, DType::bf16, pooled_opts(1, 4, true, false, false)},
      {1, 700, 700, 2, 1, 16, DType::f32, pooled_opts(4, 2, true, false, false)},
      {1, 17, 1013, 16, 1, 16, DType::f32, pooled_opts(1, 2, true, true, true)},
      {1, 17, 1000, 16, 1, 16, DType::f16, pooled_opts(4, 3, false, true, true)},
      {2, 1, 300, 2, 1, 8, DType::f32, pooled_opts(4, 5, true, true, false)},  // top_k > candidates
      {1, 300, 129, 2, 1, 8, DType::f32, pooled_opts(4, 2, true, true, false)},  // tile 0 sees nothing
      {3, 256, 513, 8, 2, 8, DType::bf16, pooled_opts(1, 1, true, true, true)},  // forced > top_k
  };
  std::uint64_t seed = 100;
  for (const auto& c : cases) {
    SCOPED_TRACE("Lq=" + std::to_string(c.Lq) + " Lk=" + std::to_string(c.Lk) + " Hq=" + std::to_string(c.Hq) +
                 " r=" + std::to_string(c.o.representatives) + " causal=" + std::to_string(c.o.causal));
    const HostTensor q = sa::testing::random_tensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}, seed++);
    const HostTensor k = sa::testing::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed++);
    check_pooled(c, q, k);
  }
}

TEST(Pooled, TileWithoutVisibleKeysIsEmpty) {
  const PooledCase c{1, 300, 129, 2, 1, 8, DType::f32, pooled_opts(1, 2, true, true, true)};
  const HostTensor q = sa::testing::random_tensor(c.dtype, {1, 300, 2, 8}, 1);
  const HostTensor k = sa::testing::random_tensor(c.dtype, {1, 129, 1, 8}, 2);
  const PooledRun out = run_pooled(c, q, k);
  EXPECT_EQ(out.cnt.data<std::int32_t>()[0], 0);
  expect_row(out.idx, 0, 0, 0, {}, "tile 0");
  expect_row(out.idx, 0, 0, 2, {0, 1}, "tile 2 keeps both diagonal blocks");
}

// Keys of block 5 share a direction with every query; all else is small noise.
TEST(Pooled, FindsPlantedBlock) {
  for (int r : {1, 4}) {
    HostTensor q = sa::testing::random_tensor(DType::f32, {2, 256, 2, 16}, 7, 0.1f);
    HostTensor k = sa::testing::random_tensor(DType::f32, {2, 1024, 1, 16}, 8, 0.1f);
    for (I64 i = 0; i < q.numel(); ++i) q.data<float>()[i] += 1.0f;
    for (I64 b = 0; b < 2; ++b)
      for (I64 s = 5 * 128; s < 6 * 128; ++s)
        for (I64 d = 0; d < 16; ++d) k.data<float>()[(b * 1024 + s) * 16 + d] += 1.0f;
    const PooledCase cf{2, 256, 1024, 2, 1, 16, DType::f32, pooled_opts(r, 1, false, false, false)};
    const PooledRun out = run_pooled(cf, q, k);
    for (I64 b = 0; b < 2; ++b)
      for (I64 t = 0; t < 2; ++t) expect_row(out.idx, b, 0, t, {5}, "r=" + std::to_string(r) + " " + where(b, 0, t));
    check_pooled(cf, q, k);
  }
}

TEST(Pooled, TiesGoToTheLowerBlock) {
  HostTensor q = sa::testing::random_tensor(DType::f32, {1, 128, 1, 8}, 11, 0.1f);
  HostTensor k = sa::testing::random_tensor(DType::f32, {1, 896, 1, 8}, 12, 0.1f);
  for (I64 i = 0; i < q.numel(); ++i) q.data<float>()[i] += 1.0f;
  float* kp = k.data<float>();
  for (I64 s = 2 * 128; s < 3 * 128; ++s)
    for (I64 d = 0; d < 8; ++d) kp[s * 8 + d] += 2.0f;
  std::copy(kp + 2 * 128 * 8, kp + 3 * 128 * 8, kp + 4 * 128 * 8);  // block 4 := block 2
  for (int r : {1, 4}) {
    PooledCase c{1, 128, 896, 1, 1, 8, DType::f32, pooled_opts(r, 1, false, false, false)};
    expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {2}, "top 1");
    c.o.top_k = 2;
    expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {2, 4}, "top 2");
  }
}

TEST(Pooled, ForcedBlocksArePresent) {
  // Queries anti-aligned with blocks 0 and 3 (the local one): they score lowest yet stay selected.
  // Block 1 outscores block 2.
  HostTensor q = sa::testing::random_tensor(DType::f32, {1, 128, 2, 8}, 21, 0.1f);
  HostTensor k = sa::testing::random_tensor(DType::f32, {1, 512, 1, 8}, 22, 0.1f);
  for (I64 i = 0; i < q.numel(); ++i) q.data<float>()[i] += 1.0f;
  for (I64 s = 0; s < 512; ++s)
    for (I64 d = 0; d < 8; ++d) k.data<float>()[s * 8 + d] += (s < 128 || s >= 384) ? -3.0f : (s < 256 ? 1.5f : 1.0f);
  PooledCase c{1, 128, 512, 2, 1, 8, DType::f32, pooled_opts(1, 3, true, true, true)};
  expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {0, 1, 3}, "causal, block 0 and diagonal 3 forced");
  c.o.force_block0 = false;
  expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {1, 2, 3}, "diagonal 3 forced");
  c.o.force_local = false;
  c.o.causal = false;
  c.o.top_k = 2;
  expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {1, 2}, "nothing forced");
  c.o.force_local = true;  // non-causal: the block of key 0 * Lk / Lq = block 0
  expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {0, 1}, "non-causal local block 0");
  check_pooled(c, q, k);
}

// A block whose first 32 keys match the queries and whose other 96 oppose them: its mean opposes
// the queries (R1 drops it) but its first representative matches them (R4 keeps it).
TEST(Pooled, R4SeesWhatR1Averages) {
  HostTensor q = sa::testing::random_tensor(DType::f32, {1, 128, 1, 8}, 31, 0.01f);
  HostTensor k = sa::testing::random_tensor(DType::f32, {1, 512, 1, 8}, 32, 0.01f);
  for (I64 i = 0; i < q.numel(); ++i) q.data<float>()[i] += 1.0f;
  for (I64 s = 0; s < 512; ++s) {
    float add = -1.0f;
    if (s / 128 == 1) add = (s % 128) < 32 ? 3.0f : -2.0f;
    if (s / 128 == 2) add = 0.5f;
    for (I64 d = 0; d < 8; ++d) k.data<float>()[s * 8 + d] += add;
  }
  PooledCase c{1, 128, 512, 1, 1, 8, DType::f32, pooled_opts(1, 1, false, false, false)};
  expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {2}, "R1");
  check_pooled(c, q, k);
  c.o.representatives = 4;
  expect_row(run_pooled(c, q, k).idx, 0, 0, 0, {1}, "R4");
  check_pooled(c, q, k);
}

TEST(Pooled, RejectsBadArguments) {
  const HostTensor q = sa::testing::random_tensor(DType::f32, {1, 200, 4, 8}, 41);
  const HostTensor k = sa::testing::random_tensor(DType::f32, {1, 300, 2, 8}, 42);
  HostTensor idx(DType::i32, {1, 2, 2, 4}), cnt(DType::i32, {1, 2, 2});
  const sa::TileLists out{idx.view(), cnt.view()};
  auto opts = [](int r, int top_k) { return pooled_opts(r, top_k, false, true, false); };
  expect_error([&] { sa::pooled_select(q.view(), k.view(), out, opts(1, 0)); }, "options.top_k", "0");
  expect_error([&] { sa::pooled_select(q.view(), k.view(), out, opts(2, 4)); }, "options.representatives", "2");
  expect_error([&] { sa::pooled_select(q.view(), k.view(), out, opts(1, 5)); }, "out.idx", "5");
  HostTensor bad_cnt(DType::i32, {1, 2, 3});
  expect_error([&] { sa::pooled_select(q.view(), k.view(), {idx.view(), bad_cnt.view()}, opts(1, 4)); }, "out.cnt");
  HostTensor f_idx(DType::f32, {1, 2, 2, 4});
  expect_error([&] { sa::pooled_select(q.view(), k.view(), {f_idx.view(), cnt.view()}, opts(1, 4)); }, "out.idx");
  const HostTensor k3 = sa::testing::random_tensor(DType::f32, {1, 300, 3, 8}, 43);
  expect_error([&] { sa::pooled_select(q.view(), k3.view(), out, opts(1, 4)); }, "k", "multiple");
  const HostTensor kd = sa::testing::random_tensor(DType::f32, {1, 300, 2, 16}, 44);
  expect_error([&] { sa::pooled_select(q.view(), kd.view(), out, opts(1, 4)); }, "k");
  // Device views are rejected before any element is read.
  auto on_device = [](sa::TensorView v) {
    v.device = sa::Device::cuda;
    return v;
  };
  expect_error([&] {
    sa::pooled_select(on_device(q.view()), on_device(k.view()), {on_device(idx.view()), on_device(cnt.view())}, opts(1, 4));
  }, "q", "cuda");
}

// The first H heads of a tensor with 2H heads: same values as `t`, non-contiguous view.
struct Strided {
  HostTensor storage;
  sa::TensorView view;
};

Strided strided_copy(const HostTensor& t) {
  const auto& sh = t.shape();
  Strided s{HostTensor(t.dtype(), {sh[0], sh[1], 2 * sh[2], sh[3]}), {}};
  const std::size_t es = sa::dtype_size(t.dtype());
  const auto* src = static_cast<const char*>(t.view().data);
  auto* dst = static_cast<char*>(s.storage.view().data);
  for (I64 r = 0; r < sh[0] * sh[1]; ++r)
    for (I64 h = 0; h < 2 * sh[2]; ++h)
      for (I64 d = 0; d < sh[3]; ++d) {
        const I64 from = ((r * sh[2] + (h % sh[2])) * sh[3] + d);
        std::memcpy(dst + ((r * 2 * sh[2] + h) * sh[3] + d) * es, src + from * es, es);
      }
  s.view = s.storage.view();
  s.view.shape[2] = sh[2];
  return s;
}

// Lists written through a view whose rows are padded: the padding must stay untouched.
struct PaddedOut {
  HostTensor storage;
  sa::TensorView view;
};

PaddedOut padded_out(std::vector<I64> shape) {
  std::vector<I64> big = shape;
  big.back() += 3;
  PaddedOut o{HostTensor(DType::i32, big), {}};
  std::fill(o.storage.data<std::int32_t>(), o.storage.data<std::int32_t>() + o.storage.numel(), 12345);
  o.view = o.storage.view();
  o.view.shape[static_cast<std::size_t>(o.view.ndim - 1)] = shape.back();
  return o;
}

void expect_same_rows(const PaddedOut& got, const HostTensor& want) {
  const auto& sh = want.shape();
  const I64 width = sh.back(), rows = want.numel() / width;
  for (I64 r = 0; r < rows; ++r) {
    for (I64 s = 0; s < width; ++s)
      ASSERT_EQ(got.storage.data<std::int32_t>()[r * (width + 3) + s], want.data<std::int32_t>()[r * width + s]) << "row " << r;
    for (I64 s = width; s < width + 3; ++s) ASSERT_EQ(got.storage.data<std::int32_t>()[r * (width + 3) + s], 12345) << "row " << r;
  }
}

TEST(Pooled, StridedViewsGiveTheSameLists) {
  const PooledCase c{2, 300, 700, 4, 2, 16, DType::bf16, pooled_opts(4, 3, true, true, true)};
  const HostTensor q = sa::testing::random_tensor(c.dtype, {2, 300, 4, 16}, 51);
  const HostTensor k = sa::testing::random_tensor(c.dtype, {2, 700, 2, 16}, 52);
  const PooledRun want = run_pooled(c, q, k, 0);
  const Strided qs = strided_copy(q), ks = strided_copy(k);
  PaddedOut idx = padded_out({2, 2, 3, 3});
  HostTensor cnt(DType::i32, {2, 2, 3});
  sa::pooled_select(qs.view, ks.view, {idx.view, cnt.view()}, c.o);
  expect_same_rows(idx, want.idx);
  for (I64 i = 0; i < cnt.numel(); ++i) EXPECT_EQ(cnt.data<std::int32_t>()[i], want.cnt.data<std::int32_t>()[i]);
}

// ---- token_max ---------------------------------------------------------------------------------

struct TokenCase {
  I64 B, Lq, Lk, Hkv, Hk, Di;
  DType dtype;
  IndexPrecision precision;
  bool causal, reserve;
  int top_k;
  bool block0 = false;  // force_block0
};

// Per query block scores by a double loop over its visible keys (-inf where a block has none).
std::vector<double> brute_block_scores(const TokenCase& c, const std::vector<float>& q, const std::vector<float>& k,
                                       I64 b, I64 g, I64 i) {
  const I64 Tk = sa::ceil_div(c.Lk, kBlockK), hk = c.Hk == 1 ? 0 : g;
  std::vector<double> sc(static_cast<std::size_t>(Tk), -std::numeric_limits<double>::infinity());
  for (I64 s = 0; s < c.Lk; ++s) {
    if (!visible(c.causal, c.Lq, c.Lk, i, s)) continue;
    const double v = dot(q.data() + ((b * c.Lq + i) * c.Hkv + g) * c.Di, k.data() + ((b * c.Lk + s) * c.Hk + hk) * c.Di, c.Di);
    sc[static_cast<std::size_t>(s / kBlockK)] = std::max(sc[static_cast<std::size_t>(s / kBlockK)], v);
  }
  return sc;
}

I64 aligned_block(const TokenCase& c, I64 i) {
  const I64 pos = i + c.Lk - c.Lq;
  if (c.causal) return pos >= 0 ? pos / kBlockK : -1;
  return std::clamp<I64>(pos, 0, c.Lk - 1) / kBlockK;
}

struct TokenRun {
  HostTensor lists, tiles, cnt;
};

TokenRun run_token_max(const TokenCase& c, const HostTensor& qidx, const HostTensor& kidx) {
  const I64 Tq = sa::ceil_div(c.Lq, kTileQ);
  TokenRun r{HostTensor(DType::i32, {c.B, c.Hkv, c.Lq, c.top_k + 1}), HostTensor(DType::i32, {c.B, c.Hkv, Tq, c.top_k + 3}),
             HostTensor(DType::i32, {c.B, c.Hkv, Tq})};
  sa::testing::poison(r.lists);
  sa::testing::poison(r.tiles);
  sa::testing::poison(r.cnt);
  sa::TokenMaxOptions o;
  o.top_k = c.top_k;
  o.precision = c.precision;
  o.causal = c.causal;
  o.reserve_local = c.reserve;
  o.force_block0 = c.block0;
  sa::token_max_select(qidx.view(), kidx.view(), sa::QueryLists{r.lists.view()}, o);
  sa::token_max_select(qidx.view(), kidx.view(), sa::TileLists{r.tiles.view(), r.cnt.view()}, o);
  return r;
}

void check_token_max(const TokenCase& c, const HostTensor& qidx, const HostTensor& kidx) {
  const TokenRun r = run_token_max(c, qidx, kidx);
  const sa::ProblemShape p = problem(c.B, c.Lq, c.Lk, c.Hkv, c.Hkv, c.Di, c.causal);
  EXPECT_NO_THROW(sa::validate(sa::QueryLists{r.lists.view()}, p, "test"));
  EXPECT_NO_THROW(sa::validate(sa::TileLists{r.tiles.view(), r.cnt.view()}, p, "test"));
  const auto q = quantized(qidx, c.precision, c.Di), k = quantized(kidx, c.precision, c.Di);
  const I64 Tq = sa::ceil_div(c.Lq, kTileQ), Tk = sa::ceil_div(c.Lk, kBlockK);
  for (I64 b = 0; b < c.B; ++b)
    for (I64 g = 0; g < c.Hkv; ++g)
      for (I64 t = 0; t < Tq; ++t) {
        std::vector<double> tile(static_cast<std::size_t>(Tk), -std::numeric_limits<double>::infinity());
        std::vector<bool> reserved(static_cast<std::size_t>(Tk), false);
        for (I64 i = t * kTileQ; i < std::min(c.Lq, (t + 1) * kTileQ); ++i) {
          const auto sc = brute_block_scores(c, q, k, b, g, i);
          const I64 local = c.reserve ? aligned_block(c, i) : -1;
          std::vector<Cand> cand;
          for (I64 j = 0; j < Tk; ++j) {
            const bool forced = local == j || (c.block0 && j == 0);
            tile[static_cast<std::size_t>(j)] = std::max(tile[static_cast<std::size_t>(j)], sc[static_cast<std::size_t>(j)]);
            if (forced) reserved[static_cast<std::size_t>(j)] = true;
            if (sc[static_cast<std::size_t>(j)] == -std::numeric_limits<double>::infinity()) continue;  // no visible key
            cand.push_back({sc[static_cast<std::size_t>(j)], static_cast<int>(j), forced});
          }
          expect_row(r.lists, b, g, i, rank_top_k(cand, c.top_k), "query " + std::to_string(i) + " " + where(b, g, t));
        }
        std::vector<Cand> cand;
        for (I64 j = 0; j < Tk; ++j)
          if (tile[static_cast<std::size_t>(j)] != -std::numeric_limits<double>::infinity())
            cand.push_back({tile[static_cast<std::size_t>(j)], static_cast<int>(j), reserved[static_cast<std::size_t>(j)]});
        const auto want = rank_top_k(cand, c.top_k);
        expect_row(r.tiles, b, g, t, want, "tile " + where(b, g, t));
        ASSERT_EQ(r.cnt.data<std::int32_t>()[(b * c.Hkv + g) * Tq + t], static_cast<std::int32_t>(want.size())) << where(b, g, t);
      }
}

TEST(TokenMax, MatchesBruteForceOnRandomInputs) {
  const TokenCase cases[] = {
      {2, 300, 700, 2, 1, 32, DType::bf16, IndexPrecision::bf16, true, true, 3},
      {1, 1013, 1013, 1, 1, 16, DType::f32, IndexPrecision::fp8_e4m3, true, true, 4},
      {1, 17, 1000, 2, 2, 32, DType::f32, IndexPrecision::fp4_e2m1, true, true, 2},
      {2, 200, 300, 2, 2, 16, DType::bf16, IndexPrecision::fp4_e2m1, false, true, 2},
      {1, 300, 129, 1, 1, 16, DType::f32, IndexPrecision::fp8_e4m3, true, true, 2},
      {1, 260, 900, 4, 1, 16, DType::f16, IndexPrecision::bf16, true, false, 3},
      {1, 1, 700, 1, 1, 8, DType::f32, IndexPrecision::fp8_e4m3, false, false, 8},
      {2, 260, 1100, 2, 1, 16, DType::bf16, IndexPrecision::fp8_e4m3, true, true, 3, true},
      {1, 130, 500, 1, 1, 16, DType::f32, IndexPrecision::fp4_e2m1, false, false, 2, true},
  };
  std::uint64_t seed = 500;
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string("precision ") + sa::precision_name(c.precision) + " Lq=" + std::to_string(c.Lq) +
                 " Lk=" + std::to_string(c.Lk) + " causal=" + std::to_string(c.causal));
    const HostTensor qidx = sa::testing::random_tensor(c.dtype, {c.B, c.Lq, c.Hkv, c.Di}, seed++);
    const HostTensor kidx = sa::testing::random_tensor(c.dtype, {c.B, c.Lk, c.Hk, c.Di}, seed++);
    check_token_max(c, qidx, kidx);
  }
}

// One key of block 3 matches the queries: the block max finds a single token that a mean hides.
TEST(TokenMax, FindsPlantedToken) {
  for (auto p : {IndexPrecision::bf16, IndexPrecision::fp8_e4m3, IndexPrecision::fp4_e2m1}) {
    const TokenCase c{1, 200, 900, 1, 1, 16, DType::f32, p, false, false, 1};
    HostTensor qidx = sa::testing::random_tensor(DType::f32, {1, 200, 1, 16}, 61, 0.2f);
    HostTensor kidx = sa::testing::random_tensor(DType::f32, {1, 900, 1, 16}, 62, 0.2f);
    for (I64 i = 0; i < qidx.numel(); ++i) qidx.data<float>()[i] += 1.0f;
    for (I64 d = 0; d < 16; ++d) kidx.data<float>()[(3 * 128 + 77) * 16 + d] = 4.0f;
    const TokenRun r = run_token_max(c, qidx, kidx);
    for (I64 i = 0; i < 200; ++i) expect_row(r.lists, 0, 0, i, {3}, std::string(sa::precision_name(p)) + " query " + std::to_string(i));
    expect_row(r.tiles, 0, 0, 0, {3}, "tile 0");
    expect_row(r.tiles, 0, 0, 1, {3}, "tile 1");
    check_token_max(c, qidx, kidx);
  }
}

TEST(TokenMax, TiesAndReservedLocalBlock) {
  HostTensor qidx = sa::testing::random_tensor(DType::f32, {1, 128, 1, 16}, 71, 0.2f);
  HostTensor kidx = sa::testing::random_tensor(DType::f32, {1, 640, 1, 16}, 72, 0.2f);
  for (I64 i = 0; i < qidx.numel(); ++i) qidx.data<float>()[i] += 1.0f;
  float* kp = kidx.data<float>();
  for (I64 d = 0; d < 16; ++d) kp[(128 + 5) * 16 + d] = 3.0f;
  std::copy(kp + 128 * 16, kp + 256 * 16, kp + 3 * 128 * 16);  // block 3 := block 1
  TokenCase c{1, 128, 640, 1, 1, 16, DType::f32, IndexPrecision::fp8_e4m3, false, false, 1};
  TokenRun r = run_token_max(c, qidx, kidx);
  expect_row(r.lists, 0, 0, 0, {1}, "tie -> lower block");
  expect_row(r.tiles, 0, 0, 0, {1}, "tile tie -> lower block");
  // Causal and reserved: the local (diagonal) block 4 takes one of the two slots.
  c.causal = true;
  c.reserve = true;
  c.top_k = 2;
  r = run_token_max(c, qidx, kidx);
  for (I64 i = 0; i < 128; ++i) expect_row(r.lists, 0, 0, i, {1, 4}, "query " + std::to_string(i));
  expect_row(r.tiles, 0, 0, 0, {1, 4}, "tile");
  check_token_max(c, qidx, kidx);
}

// force_block0: block 0 ranks like the reserved local block in every list that sees a key; with
// top_k = 1 and both forced, the lower id (block 0) wins; lists that see no key stay empty.
TEST(TokenMax, ForceBlock0KeepsTheSink) {
  HostTensor qidx = sa::testing::random_tensor(DType::f32, {1, 300, 1, 16}, 73, 0.2f);
  HostTensor kidx = sa::testing::random_tensor(DType::f32, {1, 640, 1, 16}, 74, 0.2f);
  for (I64 i = 0; i < qidx.numel(); ++i) qidx.data<float>()[i] += 1.0f;
  for (I64 d = 0; d < 16; ++d) kidx.data<float>()[(2 * 128 + 9) * 16 + d] = 3.0f;  // block 2 scores highest
  TokenCase c{1, 300, 640, 1, 1, 16, DType::f32, IndexPrecision::bf16, false, false, 2, true};
  TokenRun r = run_token_max(c, qidx, kidx);
  for (I64 i = 0; i < 300; ++i) expect_row(r.lists, 0, 0, i, {0, 2}, "query " + std::to_string(i));
  expect_row(r.tiles, 0, 0, 1, {0, 2}, "tile 1");
  check_token_max(c, qidx, kidx);
  // Causal, reserved local block too, top_k = 1: block 0 (the lower forced id) is the list.
  c.causal = true, c.reserve = true, c.top_k = 1;
  r = run_token_max(c, qidx, kidx);
  for (I64 i = 0; i < 300; ++i) expect_row(r.lists, 0, 0, i, {0}, "query " + std::to_string(i));
  check_token_max(c, qidx, kidx);
  // Lq > Lk causal: the first queries see no key and get empty lists, block 0 included.
  const TokenCase late{1, 300, 140, 1, 1, 16, DType::f32, IndexPrecision::fp8_e4m3, true, true, 2, true};
  const HostTensor k2 = sa::testing::random_tensor(DType::f32, {1, 140, 1, 16}, 75);
  r = run_token_max(late, qidx, k2);
  expect_row(r.lists, 0, 0, 0, {}, "query 0 sees nothing");
  expect_row(r.lists, 0, 0, 299, {0, 1}, "query 299");
  check_token_max(late, qidx, k2);
}

TEST(TokenMax, StridedViewsGiveTheSameLists) {
  const TokenCase c{1, 200, 400, 2, 2, 16, DType::f32, IndexPrecision::fp4_e2m1, true, true, 2};
  const HostTensor qidx = sa::testing::random_tensor(DType::f32, {1, 200, 2, 16}, 91);
  const HostTensor kidx = sa::testing::random_tensor(DType::f32, {1, 400, 2, 16}, 92);
  const TokenRun want = run_token_max(c, qidx, kidx);
  const Strided qs = strided_copy(qidx), ks = strided_copy(kidx);
  PaddedOut lists = padded_out({1, 2, 200, 3});
  sa::TokenMaxOptions o;
  o.top_k = 2;
  o.precision = c.precision;
  o.causal = c.causal;
  o.reserve_local = c.reserve;
  sa::token_max_select(qs.view, ks.view, sa::QueryLists{lists.view}, o);
  expect_same_rows(lists, want.lists);
}

TEST(TokenMax, RejectsBadArguments) {
  const HostTensor qidx = sa::testing::random_tensor(DType::f32, {1, 100, 2, 16}, 81);
  const HostTensor kidx = sa::testing::random_tensor(DType::f32, {1, 300, 2, 16}, 82);
  HostTensor lists(DType::i32, {1, 2, 100, 4}), tiles(DType::i32, {1, 2, 1, 4}), cnt(DType::i32, {1, 2, 1});
  sa::TokenMaxOptions o;
  o.top_k = 4;
  auto with_top_k = [&](int k) {
    sa::TokenMaxOptions x = o;
    x.top_k = k;
    return x;
  };
  expect_error([&] { sa::token_max_select(qidx.view(), kidx.view(), sa::QueryLists{lists.view()}, with_top_k(0)); }, "options.top_k");
  expect_error([&] { sa::token_max_select(qidx.view(), kidx.view(), sa::QueryLists{lists.view()}, with_top_k(5)); }, "out.idx", "5");
  expect_error([&] { sa::token_max_select(qidx.view(), kidx.view(), sa::TileLists{tiles.view(), cnt.view()}, with_top_k(9)); }, "out.idx");
  const HostTensor k3 = sa::testing::random_tensor(DType::f32, {1, 300, 3, 16}, 83);
  expect_error([&] { sa::token_max_select(qidx.view(), k3.view(), sa::QueryLists{lists.view()}, o); }, "kidx", "3");
  HostTensor wrong(DType::i32, {1, 2, 99, 4});
  expect_error([&] { sa::token_max_select(qidx.view(), kidx.view(), sa::QueryLists{wrong.view()}, o); }, "out.idx");
  HostTensor bad_cnt(DType::i32, {1, 1, 1});
  expect_error([&] { sa::token_max_select(qidx.view(), kidx.view(), sa::TileLists{tiles.view(), bad_cnt.view()}, o); }, "out.cnt");
  sa::TokenMaxOptions bad_p = o;
  bad_p.precision = static_cast<IndexPrecision>(9);
  expect_error([&] { sa::token_max_select(qidx.view(), kidx.view(), sa::QueryLists{lists.view()}, bad_p); }, "options.precision");
  HostTensor nan_k = kidx;
  nan_k.data<float>()[(17 * 2 + 1) * 16 + 3] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { sa::token_max_select(qidx.view(), nan_k.view(), sa::QueryLists{lists.view()}, o); }, "kidx", "[0, 17, 1, 3]");
}

// ---- lightning ---------------------------------------------------------------------------------

struct LightningCase {
  I64 B, Lq, Lk, HI, Di, G;
  DType dtype;
  IndexPrecision precision;
  bool causal;
  int top_k;
  int sink = 0;  // options.sink_keys
};

// The whole score matrix of batch b, -inf where invisible (the test may hold it; the selector may not).
std::vector<double> brute_index_scores(const LightningCase& c, const std::vector<float>& q, const std::vector<float>& w,
                                       const std::vector<float>& k, I64 b) {
  std::vector<double> I(static_cast<std::size_t>(c.Lq * c.Lk), -std::numeric_limits<double>::infinity());
  for (I64 t = 0; t < c.Lq; ++t)
    for (I64 s = 0; s < c.Lk; ++s) {
      if (!visible(c.causal, c.Lq, c.Lk, t, s)) continue;
      double acc = 0.0;
      for (I64 j = 0; j < c.HI; ++j) {
        const double d = dot(q.data() + ((b * c.Lq + t) * c.HI + j) * c.Di, k.data() + (b * c.Lk + s) * c.Di, c.Di);
        acc += static_cast<double>(w[static_cast<std::size_t>((b * c.Lq + t) * c.HI + j)]) * std::max(0.0, d);
      }
      I[static_cast<std::size_t>(t * c.Lk + s)] = acc;
    }
  return I;
}

void check_lightning(const LightningCase& c, const HostTensor& qI, const HostTensor& w, const HostTensor& kI) {
  HostTensor tokens(DType::i32, {c.B, c.G, c.Lq, c.top_k + 2});
  const int block_k = 2;
  HostTensor blocks(DType::i32, {c.B, c.G, c.Lq, block_k + 1});
  sa::testing::poison(tokens);
  sa::testing::poison(blocks);
  sa::LightningOptions o;
  o.top_k = c.top_k;
  o.causal = c.causal;
  o.precision = c.precision;
  o.sink_keys = c.sink;
  sa::lightning_select(qI.view(), w.view(), kI.view(), sa::TokenLists{tokens.view()}, o);
  o.top_k = block_k;
  sa::lightning_select(qI.view(), w.view(), kI.view(), sa::QueryLists{blocks.view()}, o);
  const sa::ProblemShape p = problem(c.B, c.Lq, c.Lk, c.G, c.G, c.Di, c.causal);
  EXPECT_NO_THROW(sa::validate(sa::TokenLists{tokens.view()}, p, "test"));
  EXPECT_NO_THROW(sa::validate(sa::QueryLists{blocks.view()}, p, "test"));

  const auto q = quantized(qI, c.precision, c.Di), k = quantized(kI, c.precision, c.Di), wf = as_floats(w);
  const I64 Tk = sa::ceil_div(c.Lk, kBlockK);
  for (I64 b = 0; b < c.B; ++b) {
    const auto I = brute_index_scores(c, q, wf, k, b);
    for (I64 t = 0; t < c.Lq; ++t) {
      std::vector<Cand> keys;
      std::vector<double> pooled(static_cast<std::size_t>(Tk), -std::numeric_limits<double>::infinity());
      std::vector<bool> seen(static_cast<std::size_t>(Tk), false), forced(static_cast<std::size_t>(Tk), false);
      for (I64 s = 0; s < c.Lk; ++s) {
        if (!visible(c.causal, c.Lq, c.Lk, t, s)) continue;
        const double v = I[static_cast<std::size_t>(t * c.Lk + s)];
        keys.push_back({v, static_cast<int>(s), s < c.sink});
        pooled[static_cast<std::size_t>(s / kBlockK)] = std::max(pooled[static_cast<std::size_t>(s / kBlockK)], v);
        seen[static_cast<std::size_t>(s / kBlockK)] = true;
        if (s < c.sink) forced[static_cast<std::size_t>(s / kBlockK)] = true;
      }
      std::vector<Cand> blks;
      for (I64 j = 0; j < Tk; ++j)
        if (seen[static_cast<std::size_t>(j)])
          blks.push_back({pooled[static_cast<std::size_t>(j)], static_cast<int>(j), forced[static_cast<std::size_t>(j)]});
      const auto want_tokens = rank_top_k(keys, c.top_k), want_blocks = rank_top_k(blks, block_k);
      for (I64 g = 0; g < c.G; ++g) {
        expect_row(tokens, b, g, t, want_tokens, "tokens " + where(b, g, t));
        expect_row(blocks, b, g, t, want_blocks, "blocks " + where(b, g, t));
      }
    }
  }
}

TEST(Lightning, MatchesBruteForceTopK) {
  const LightningCase cases[] = {
      {2, 200, 300, 4, 32, 2, DType::f32, IndexPrecision::fp8_e4m3, true, 50},
      {1, 17, 1013, 2, 16, 1, DType::bf16, IndexPrecision::bf16, true, 2048},  // k > visible: all of them
      {1, 300, 129, 2, 16, 1, DType::f32, IndexPrecision::fp8_e4m3, true, 7},  // early rows see nothing
      {1, 64, 500, 3, 16, 3, DType::f16, IndexPrecision::bf16, false, 64},
      {1, 1, 1000, 4, 16, 1, DType::f32, IndexPrecision::fp8_e4m3, true, 100},
      // Sink keys: fewer than top_k; more than top_k (the lower ids); across blocks 0..2 (block form forced).
      {1, 150, 400, 2, 16, 1, DType::f32, IndexPrecision::fp8_e4m3, true, 20, 5},
      {2, 60, 300, 3, 16, 2, DType::bf16, IndexPrecision::bf16, true, 8, 30},
      {1, 20, 700, 2, 16, 1, DType::f32, IndexPrecision::bf16, false, 4, 300},
  };
  std::uint64_t seed = 900;
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string("precision ") + sa::precision_name(c.precision) + " Lq=" + std::to_string(c.Lq) +
                 " Lk=" + std::to_string(c.Lk) + " k=" + std::to_string(c.top_k));
    const HostTensor qI = sa::testing::random_tensor(c.dtype, {c.B, c.Lq, c.HI, c.Di}, seed++);
    const HostTensor w = sa::testing::random_tensor(DType::f32, {c.B, c.Lq, c.HI}, seed++);
    const HostTensor kI = sa::testing::random_tensor(c.dtype, {c.B, c.Lk, c.Di}, seed++);
    check_lightning(c, qI, w, kI);
  }
}

TEST(Lightning, TiesGoToTheLowerKey) {
  HostTensor qI = sa::testing::random_tensor(DType::f32, {1, 40, 2, 8}, 1001, 0.1f);
  HostTensor w = sa::testing::random_tensor(DType::f32, {1, 40, 2}, 1002, 0.1f);
  HostTensor kI = sa::testing::random_tensor(DType::f32, {1, 40, 8}, 1003, 0.1f);
  for (I64 i = 0; i < qI.numel(); ++i) qI.data<float>()[i] += 1.0f;
  for (I64 i = 0; i < w.numel(); ++i) w.data<float>()[i] = std::fabs(w.data<float>()[i]) + 1.0f;
  for (I64 d = 0; d < 8; ++d) kI.data<float>()[10 * 8 + d] = kI.data<float>()[20 * 8 + d] = 3.0f;
  HostTensor tokens(DType::i32, {1, 1, 40, 1});
  sa::testing::poison(tokens);
  sa::LightningOptions o;
  o.top_k = 1;
  o.causal = true;
  sa::lightning_select(qI.view(), w.view(), kI.view(), sa::TokenLists{tokens.view()}, o);
  for (I64 t = 0; t < 40; ++t) {
    // Causal: rows before 10 cannot see the planted keys; rows from 10 on pick 10 over its twin 20.
    if (t >= 10) EXPECT_EQ(at(tokens, 0, 0, t, 0), 10) << "row " << t;
    else EXPECT_LE(at(tokens, 0, 0, t, 0), t) << "row " << t;
  }
  check_lightning({1, 40, 40, 2, 8, 1, DType::f32, IndexPrecision::fp8_e4m3, true, 3}, qI, w, kI);
}

TEST(Lightning, RejectsBadArguments) {
  const HostTensor qI = sa::testing::random_tensor(DType::f32, {1, 50, 2, 16}, 1101);
  const HostTensor w = sa::testing::random_tensor(DType::f32, {1, 50, 2}, 1102);
  const HostTensor kI = sa::testing::random_tensor(DType::f32, {1, 80, 16}, 1103);
  HostTensor tokens(DType::i32, {1, 1, 50, 8});
  sa::LightningOptions o;
  o.top_k = 8;
  sa::LightningOptions fp4 = o;
  fp4.precision = IndexPrecision::fp4_e2m1;
  expect_error([&] { sa::lightning_select(qI.view(), w.view(), kI.view(), sa::TokenLists{tokens.view()}, fp4); },
               "options.precision", "fp4");
  sa::LightningOptions big = o;
  big.top_k = 9;
  expect_error([&] { sa::lightning_select(qI.view(), w.view(), kI.view(), sa::TokenLists{tokens.view()}, big); }, "out.idx", "9");
  sa::LightningOptions zero = o;
  zero.top_k = 0;
  expect_error([&] { sa::lightning_select(qI.view(), w.view(), kI.view(), sa::TokenLists{tokens.view()}, zero); }, "options.top_k");
  sa::LightningOptions sink = o;
  sink.sink_keys = -1;
  expect_error([&] { sa::lightning_select(qI.view(), w.view(), kI.view(), sa::TokenLists{tokens.view()}, sink); },
               "options.sink_keys", "-1");
  const HostTensor w_bad = sa::testing::random_tensor(DType::f32, {1, 50, 3}, 1104);
  expect_error([&] { sa::lightning_select(qI.view(), w_bad.view(), kI.view(), sa::TokenLists{tokens.view()}, o); }, "w");
  const HostTensor w_bf16 = sa::testing::random_tensor(DType::bf16, {1, 50, 2}, 1105);
  expect_error([&] { sa::lightning_select(qI.view(), w_bf16.view(), kI.view(), sa::TokenLists{tokens.view()}, o); }, "w");
  const HostTensor k_bad = sa::testing::random_tensor(DType::f32, {1, 80, 8}, 1106);
  expect_error([&] { sa::lightning_select(qI.view(), w.view(), k_bad.view(), sa::TokenLists{tokens.view()}, o); }, "kI");
  HostTensor w_inf = w;
  w_inf.data<float>()[7] = std::numeric_limits<float>::infinity();
  expect_error([&] { sa::lightning_select(qI.view(), w_inf.view(), kI.view(), sa::TokenLists{tokens.view()}, o); }, "w", "[0, 3, 1]");
}

}  // namespace
