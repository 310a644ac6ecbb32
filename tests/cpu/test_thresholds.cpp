// Threshold calibration (a hand-checked case, random data against a float64 brute force, -inf for
// short histories), the ThresholdTable lookups and its safetensors file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/testing.hpp"
#include "core/safetensors.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("sparse_attn_thresholds_" + std::to_string(::getpid()) + "_" + name + ".safetensors"))
      .string();
}

template <class F>
void expect_error(F&& f, const std::string& arg, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no error (expected one about '" << arg << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

/// One head, D = 1, q = 1 and scale 1: every score is the key itself, so block maxima are planted
/// keys (all others are drawn from (-1, 0)).
HostTensor planted_keys(std::int64_t L, const std::vector<std::pair<std::int64_t, float>>& planted, std::uint64_t seed) {
  HostTensor k(DType::f32, {1, L, 1, 1});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> below(-0.99f, -0.01f);
  for (std::int64_t i = 0; i < L; ++i) k.data<float>()[i] = below(rng);
  for (const auto& [pos, value] : planted) k.data<float>()[pos] = value;
  return k;
}

HostTensor ones_q(std::int64_t L) {
  HostTensor q(DType::f32, {1, L, 1, 1});
  std::fill(q.data<float>(), q.data<float>() + L, 1.0f);
  return q;
}

TEST(Calibrator, HandCheckedTable) {
  // Gate tiles of 64 rows (L = 384: six). Gate tile g's candidates are the blocks whose last key
  // is <= its first row 64 g: none for g = 0, 1; block 0 for g = 2, 3; blocks 0, 1 for g = 4, 5.
  // Sample A: block 0 max 0.5, block 1 max 2.0. Sample B: 1.5 and 0.25.
  // Sample C (200 tokens, gate tiles 0..3): block 0 max 3.0.
  const HostTensor ka = planted_keys(384, {{5, 0.5f}, {200, 2.0f}, {300, 9.0f}}, 1);
  const HostTensor kb = planted_keys(384, {{127, 1.5f}, {128, 0.25f}, {383, 9.0f}}, 2);
  const HostTensor kc = planted_keys(200, {{64, 3.0f}}, 3);
  const auto calibrate = [&](std::int64_t sinks) {
    Calibrator cal({1, 2}, 2, "tiny-model", sinks);
    cal.add(0, ones_q(384).view(), ka.view(), 1.0f);
    cal.add(0, ones_q(384).view(), kb.view(), 1.0f);
    cal.add(0, ones_q(200).view(), kc.view(), 1.0f);
    cal.add(1, ones_q(200).view(), kc.view(), 1.0f);
    return cal.finish();
  };
  const ThresholdTable t = calibrate(0);
  EXPECT_EQ(t.budgets, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(t.n_layers, 2);
  EXPECT_EQ(t.n_heads, 1);
  EXPECT_EQ(t.n_qtiles, 6);
  EXPECT_EQ(t.model, "tiny-model");
  EXPECT_EQ(t.tile_q, 64);
  EXPECT_EQ(t.tile_k, 128);
  EXPECT_EQ(t.sink_blocks, 0);
  ASSERT_EQ(t.values.size(), 2u * 2u * 1u * 6u);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t g = 0; g < 2; ++g) EXPECT_EQ(t.at(b, 0, 0, g), kNegInf);
  for (std::int64_t g = 2; g < 4; ++g) {
    EXPECT_FLOAT_EQ(t.at(0, 0, 0, g), static_cast<float>((0.5 + 1.5 + 3.0) / 3.0));  // k = 1: A, B, C
    EXPECT_EQ(t.at(1, 0, 0, g), kNegInf);                                            // k = 2: one candidate
  }
  for (std::int64_t g = 4; g < 6; ++g) {  // A and B only; block 2 (planted 9.0) is diagonal
    EXPECT_FLOAT_EQ(t.at(0, 0, 0, g), (2.0f + 1.5f) / 2.0f);
    EXPECT_FLOAT_EQ(t.at(1, 0, 0, g), (0.5f + 0.25f) / 2.0f);
  }
  // Layer 1 saw only the 4-gate-tile sample: its gate tiles 4, 5 repeat gate tile 3.
  EXPECT_EQ(t.at(0, 1, 0, 1), kNegInf);
  EXPECT_FLOAT_EQ(t.at(0, 1, 0, 2), 3.0f);
  EXPECT_FLOAT_EQ(t.at(0, 1, 0, 5), 3.0f);
  EXPECT_EQ(t.at(1, 1, 0, 5), kNegInf);
  // Positions past the table reuse the last one.
  EXPECT_EQ(t.at(1, 0, 0, 1000), t.at(1, 0, 0, 5));

  // One sink block: block 0 leaves the candidates.
  const ThresholdTable s = calibrate(1);
  EXPECT_EQ(s.sink_blocks, 1);
  for (std::int64_t g = 0; g < 4; ++g) EXPECT_EQ(s.at(0, 0, 0, g), kNegInf) << "gate tile " << g;
  EXPECT_FLOAT_EQ(s.at(0, 0, 0, 4), (2.0f + 0.25f) / 2.0f);
  EXPECT_EQ(s.at(1, 0, 0, 5), kNegInf);
  EXPECT_EQ(s.at(0, 1, 0, 5), kNegInf);
}

/// Gate tile g's candidate blocks (Lq = Lk = L): every pair visible (last key <= first row 64 g),
/// past the sinks.
std::vector<std::int64_t> candidates(std::int64_t L, std::int64_t g, std::int64_t sinks) {
  std::vector<std::int64_t> js;
  for (std::int64_t j = sinks; j * 128 < L && std::min(L, (j + 1) * 128) - 1 <= g * 64; ++j) js.push_back(j);
  return js;
}

/// Float64 brute force of one sample: threshold per [budget][head][gate tile] (-inf below k candidates).
std::vector<double> brute_force_sample(const HostTensor& q, const HostTensor& k, const std::vector<std::int64_t>& budgets,
                                       double scale, std::int64_t sinks) {
  const std::int64_t L = q.shape()[1], Hq = q.shape()[2], D = q.shape()[3], Hkv = k.shape()[2];
  const std::int64_t T = (L + 63) / 64, nb = static_cast<std::int64_t>(budgets.size());
  std::vector<double> out(static_cast<std::size_t>(nb * Hq * T));
  for (std::int64_t h = 0; h < Hq; ++h) {
    const std::int64_t hk = h / (Hq / Hkv);
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<double> maxima;
      for (const std::int64_t j : candidates(L, t, sinks)) {
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t i = t * 64; i < std::min(L, (t + 1) * 64); ++i)
          for (std::int64_t c = j * 128; c < std::min(L, (j + 1) * 128); ++c) {
            double dot = 0;
            for (std::int64_t d = 0; d < D; ++d)
              dot += testing::element(q, (i * Hq + h) * D + d) * testing::element(k, (c * Hkv + hk) * D + d);
            m = std::max(m, dot * scale);
          }
        maxima.push_back(m);
      }
      std::sort(maxima.begin(), maxima.end(), std::greater<double>());
      for (std::int64_t b = 0; b < nb; ++b) {
        const std::int64_t kk = budgets[static_cast<std::size_t>(b)];
        out[static_cast<std::size_t>((b * Hq + h) * T + t)] = static_cast<std::int64_t>(maxima.size()) >= kk
                                                                  ? maxima[static_cast<std::size_t>(kk - 1)]
                                                                  : -std::numeric_limits<double>::infinity();
      }
    }
  }
  return out;
}

class CalibratorSinks : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(CalibratorSinks, RandomSamplesMatchBruteForce) {
  const std::int64_t sinks = GetParam();
  const std::vector<std::int64_t> budgets{1, 3, 5};
  const std::int64_t Hq = 4, Hkv = 2, D = 16, n_layers = 2;
  const std::vector<std::vector<std::int64_t>> lengths{{700, 1013, 300}, {1013, 129}};  // per layer
  const double scale = 1.0 / std::sqrt(double(D));
  Calibrator cal(budgets, n_layers, "random", sinks);
  const std::int64_t nq = 16;  // ceil(1013 / 64)
  // Per layer: sums, counts, -inf flags per [budget][head][tile], brute-forced.
  std::vector<std::vector<double>> sum(n_layers, std::vector<double>(budgets.size() * Hq * nq, 0.0));
  std::vector<std::vector<int>> cnt(n_layers, std::vector<int>(sum[0].size(), 0));
  std::vector<std::vector<bool>> neg(n_layers, std::vector<bool>(sum[0].size(), false));
  std::uint64_t seed = 50;
  for (std::int64_t layer = 0; layer < n_layers; ++layer)
    for (std::int64_t L : lengths[static_cast<std::size_t>(layer)]) {
      const HostTensor q = testing::random_tensor(DType::f32, {1, L, Hq, D}, seed++);
      const HostTensor k = testing::random_tensor(DType::f32, {1, L, Hkv, D}, seed++);
      cal.add(layer, q.view(), k.view());
      const std::vector<double> s = brute_force_sample(q, k, budgets, scale, sinks);
      const std::int64_t T = (L + 63) / 64;
      for (std::size_t b = 0; b < budgets.size(); ++b)
        for (std::int64_t h = 0; h < Hq; ++h)
          for (std::int64_t t = 0; t < T; ++t) {
            const double x = s[(b * Hq + static_cast<std::size_t>(h)) * static_cast<std::size_t>(T) + static_cast<std::size_t>(t)];
            const std::size_t at = (b * Hq + static_cast<std::size_t>(h)) * nq + static_cast<std::size_t>(t);
            ++cnt[static_cast<std::size_t>(layer)][at];
            if (std::isinf(x)) neg[static_cast<std::size_t>(layer)][at] = true;
            else sum[static_cast<std::size_t>(layer)][at] += x;
          }
    }
  const ThresholdTable t = cal.finish();
  ASSERT_EQ(t.n_qtiles, nq);
  ASSERT_EQ(t.n_heads, Hq);
  for (std::int64_t layer = 0; layer < n_layers; ++layer)
    for (std::size_t b = 0; b < budgets.size(); ++b)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t tile = 0; tile < nq; ++tile) {
          const std::size_t at = (b * Hq + static_cast<std::size_t>(h)) * nq + static_cast<std::size_t>(tile);
          const float got = t.at(static_cast<std::int64_t>(b), layer, h, tile);
          // Every sample reaches gate tile 0..T-1 of its own length; all layers here reach tile 15.
          ASSERT_GT(cnt[static_cast<std::size_t>(layer)][at], 0);
          if (neg[static_cast<std::size_t>(layer)][at]) {
            EXPECT_EQ(got, kNegInf) << "layer " << layer << " budget " << b << " head " << h << " tile " << tile;
          } else {
            const double want = sum[static_cast<std::size_t>(layer)][at] / cnt[static_cast<std::size_t>(layer)][at];
            EXPECT_NEAR(got, want, 1e-5 * (1.0 + std::abs(want)))
                << "layer " << layer << " budget " << b << " head " << h << " tile " << tile;
          }
          // Fewer candidates than the budget in the longest sample: never pruned.
          if (static_cast<std::int64_t>(candidates(1013, tile, sinks).size()) < budgets[b]) EXPECT_EQ(got, kNegInf);
        }
  // Layer 1's sample of 129 tokens reaches gate tile 2 (row 128) with blocks 0 and 1 as candidates
  // (row 128 sees every key of both); the 1013-token sample has block 0 there: finite for k = 1
  // unless block 0 is a sink.
  EXPECT_EQ(std::isfinite(t.at(0, 1, 0, 2)), sinks == 0);
  EXPECT_EQ(t.sink_blocks, sinks);
}

INSTANTIATE_TEST_SUITE_P(Sinks, CalibratorSinks, ::testing::Values(0, 1, 2));

TEST(Calibrator, SingleSampleThresholdsGateTheirOwnTopK) {
  // Calibrated on one sample, the threshold is that sample's k-th largest block maximum, computed by
  // the same kernel gated() uses, so gating the sample itself keeps exactly min(k, candidates)
  // candidate blocks per gate tile (random maxima have no ties), with the same sinks.
  const std::int64_t L = 1013, Hq = 2, Hkv = 1, D = 32, k = 3, T = 16;
  const HostTensor q = testing::random_tensor(DType::f32, {1, L, Hq, D}, 71);
  const HostTensor kk = testing::random_tensor(DType::f32, {1, L, Hkv, D}, 72);
  const HostTensor v = testing::random_tensor(DType::f32, {1, L, Hkv, D}, 73);
  for (const std::int64_t sinks : {0, 1}) {
    Calibrator cal({2, k}, 1, "", sinks);
    cal.add(0, q.view(), kk.view());
    const ThresholdTable table = cal.finish();
    HostTensor out(DType::f32, {1, L, Hq, D}), kept(DType::i32, {1, Hq, T});
    testing::poison(out);
    GatedOptions opt;
    opt.kept_per_tile = kept.view();
    opt.sink_blocks = table.sink_blocks;
    const GatedStats s =
        gated(q.view(), kk.view(), v.view(), table.slice(table.budget_index(k), 0), out.view(), std::nullopt, opt);
    std::int64_t want_gated = 0;
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t g = 0; g < T; ++g) {
        const std::int64_t visible = (std::min(L, 64 * (g + 1)) + 127) / 128;
        const std::int64_t cand = static_cast<std::int64_t>(candidates(L, g, sinks).size());
        const std::int64_t keep = std::min(k, cand);
        EXPECT_EQ(kept.data<std::int32_t>()[h * T + g], visible - cand + keep) << "head " << h << " gate tile " << g;
        want_gated += keep;
      }
    EXPECT_EQ(s.gated_kept, want_gated);
    EXPECT_TRUE(testing::all_finite(out));
  }
}

TEST(Calibrator, RejectsBadInput) {
  expect_error([] { Calibrator({}, 1); }, "budgets", "at least one");
  expect_error([] { Calibrator({4, 0}, 1); }, "budgets", "budget 0 at [1]");
  expect_error([] { Calibrator({2, 2}, 1); }, "budgets", "repeated");
  expect_error([] { Calibrator({2}, 0); }, "n_layers", "got 0");
  expect_error([] { Calibrator({2}, 1, "", -1); }, "sink_blocks", "got -1");
  Calibrator cal({1}, 2);
  expect_error([&] { (void)cal.finish(); }, "", "no calibration sample");
  const HostTensor q = testing::random_tensor(DType::f32, {1, 200, 4, 8}, 1);
  const HostTensor k = testing::random_tensor(DType::f32, {1, 200, 2, 8}, 2);
  expect_error([&] { cal.add(2, q.view(), k.view()); }, "layer", "2 is out of range [0, 2)");
  expect_error([&] { cal.add(-1, q.view(), k.view()); }, "layer", "-1 is out of range");
  const HostTensor q2 = testing::random_tensor(DType::f32, {2, 200, 4, 8}, 3);
  expect_error([&] { cal.add(0, q2.view(), k.view()); }, "q", "one sample");
  const HostTensor k_short = testing::random_tensor(DType::f32, {1, 150, 2, 8}, 4);
  expect_error([&] { cal.add(0, q.view(), k_short.view()); }, "k", "expected shape [1, 200, *, 8]");
  const HostTensor k3 = testing::random_tensor(DType::f32, {1, 200, 3, 8}, 5);
  expect_error([&] { cal.add(0, q.view(), k3.view()); }, "k", "multiple of KV heads");
  cal.add(0, q.view(), k.view());
  const HostTensor q8 = testing::random_tensor(DType::f32, {1, 200, 8, 8}, 6);
  expect_error([&] { cal.add(1, q8.view(), k.view()); }, "q", "earlier samples had 4");
  // Layer 1 never received a sample.
  expect_error([&] { (void)cal.finish(); }, "layer", "layer 1 has no calibration sample");
}

ThresholdTable sample_table() {
  ThresholdTable t;
  t.budgets = {4, 16};
  t.n_layers = 3;
  t.n_heads = 2;
  t.n_qtiles = 5;
  t.model = "org/model@rev";
  std::mt19937_64 rng(9);
  std::normal_distribution<float> d(0.0f, 2.0f);
  t.values.resize(2 * 3 * 2 * 5);
  for (float& x : t.values) x = d(rng);
  t.values[3] = kNegInf;
  return t;
}

TEST(ThresholdTable, LookupsAndSlices) {
  const ThresholdTable t = sample_table();
  // at(): row-major [budget, layer, head, qtile]; past the end -> the last position.
  EXPECT_EQ(t.at(1, 2, 1, 4), t.values[((1 * 3 + 2) * 2 + 1) * 5 + 4]);
  EXPECT_EQ(t.at(1, 2, 1, 99), t.at(1, 2, 1, 4));
  EXPECT_EQ(t.at(0, 0, 0, 3), kNegInf);
  EXPECT_EQ(t.budget_index(16), 1);
  const TensorView s = t.slice(1, 2);
  ASSERT_EQ(s.ndim, 2);
  EXPECT_EQ(s.shape[0], 2);
  EXPECT_EQ(s.shape[1], 5);
  EXPECT_EQ(s.dtype, DType::f32);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t q = 0; q < 5; ++q)
      EXPECT_EQ(*(s.ptr<const float>() + h * s.stride[0] + q * s.stride[1]), t.at(1, 2, h, q));

  expect_error([&] { (void)t.at(2, 0, 0, 0); }, "budget", "2 is out of range [0, 2)");
  expect_error([&] { (void)t.at(0, 3, 0, 0); }, "layer", "3 is out of range [0, 3)");
  expect_error([&] { (void)t.at(0, 0, -1, 0); }, "head", "-1 is out of range");
  expect_error([&] { (void)t.at(0, 0, 0, -1); }, "qtile", "must be >= 0");
  expect_error([&] { (void)t.slice(0, 5); }, "layer", "5 is out of range");
  expect_error([&] { (void)t.budget_index(8); }, "k", "no slice for budget 8 (budgets: [4, 16])");
  ThresholdTable broken = t;
  broken.values.pop_back();
  expect_error([&] { (void)broken.at(0, 0, 0, 0); }, "values", "expected 60");
}

TEST(ThresholdTable, SaveLoadRoundTrip) {
  const ThresholdTable t = sample_table();
  const std::string path = temp_path("roundtrip");
  t.save(path);
  const ThresholdTable r = ThresholdTable::load(path);
  std::filesystem::remove(path);
  EXPECT_EQ(r.budgets, t.budgets);
  EXPECT_EQ(r.n_layers, t.n_layers);
  EXPECT_EQ(r.n_heads, t.n_heads);
  EXPECT_EQ(r.n_qtiles, t.n_qtiles);
  EXPECT_EQ(r.tile_q, 64);
  EXPECT_EQ(r.tile_k, 128);
  EXPECT_EQ(r.sink_blocks, t.sink_blocks);
  EXPECT_EQ(r.model, t.model);
  ASSERT_EQ(r.values.size(), t.values.size());
  for (std::size_t i = 0; i < t.values.size(); ++i) EXPECT_EQ(r.values[i], t.values[i]) << i;

  // The file is plain safetensors with the documented names and metadata.
  t.save(path);
  const detail::SafetensorsFile f = detail::read_safetensors(path);
  std::filesystem::remove(path);
  EXPECT_EQ(f.metadata.at("format"), "sparse_attn.thresholds.v1");
  EXPECT_EQ(f.metadata.at("tile_q"), "64");
  EXPECT_EQ(f.metadata.at("tile_k"), "128");
  EXPECT_EQ(f.metadata.at("sink_blocks"), std::to_string(t.sink_blocks));
  EXPECT_EQ(f.metadata.at("model"), "org/model@rev");
  EXPECT_EQ(f.get("thresholds").dtype, "F32");
  EXPECT_EQ(f.get("thresholds").shape, (std::vector<std::int64_t>{2, 3, 2, 5}));
  EXPECT_EQ(f.get("budgets").dtype, "I64");
}

TEST(ThresholdTable, FilesWithoutSinkMetadataReadAsNoSinks) {
  // Tables written before the sink option treated block 0 as a candidate: sink_blocks = 0.
  ThresholdTable t = sample_table();
  t.sink_blocks = 2;
  const std::string path = temp_path("nosink");
  t.save(path);
  detail::SafetensorsFile f = detail::read_safetensors(path);
  EXPECT_EQ(ThresholdTable::load(path).sink_blocks, 2);
  f.metadata.erase("sink_blocks");
  detail::write_safetensors(path, f);
  EXPECT_EQ(ThresholdTable::load(path).sink_blocks, 0);
  f.metadata["sink_blocks"] = "-1";
  detail::write_safetensors(path, f);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "'sink_blocks' must be >= 0");
  f.metadata["sink_blocks"] = "one";
  detail::write_safetensors(path, f);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "metadata 'sink_blocks' is not an integer");
  std::filesystem::remove(path);
}

TEST(ThresholdTable, LoadRejectsOtherFilesAndTileShapes) {
  ThresholdTable t = sample_table();
  const std::string path = temp_path("reject");
  t.tile_k = 64;
  t.save(path);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "calibrated for gate tiles of 64 x 64");
  // The 128-row gate of earlier versions: block maxima over other rows, recalibration needed.
  t.tile_q = 128;
  t.tile_k = 128;
  t.save(path);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "gate tiles of 128 x 128, this library gates 64 x 128");

  detail::SafetensorsFile other;
  other.metadata["format"] = "someone.else.v3";
  detail::SafetensorsEntry e;
  e.name = "thresholds";
  e.dtype = "F32";
  e.shape = {1};
  e.data.resize(4);
  other.tensors.push_back(e);
  detail::write_safetensors(path, other);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "format 'someone.else.v3' is not a threshold table");

  other.metadata.clear();
  detail::write_safetensors(path, other);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "metadata key 'format' is missing");

  t.tile_q = 64;
  t.save(path);
  detail::SafetensorsFile f = detail::read_safetensors(path);
  f.metadata["tile_q"] = "12x";
  detail::write_safetensors(path, f);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "metadata 'tile_q' is not an integer");
  std::filesystem::remove(path);

  EXPECT_THROW((void)ThresholdTable::load(temp_path("missing")), Error);
  ThresholdTable empty;
  expect_error([&] { empty.save(path); }, "budgets", "no budget slice");
}

// Extents whose product overflows, and budgets the format does not allow (>= 1, none repeated),
// are refused before any index is computed, whether the table comes from code or from a file.
TEST(ThresholdTable, RejectsOverflowingExtentsAndBadBudgets) {
  ThresholdTable t;
  t.budgets = {1};
  t.n_layers = std::int64_t{1} << 62;  // 1 x 2^62 x 4 x 1 floats: the product wrapped to 0 before
  t.n_heads = 4;
  t.n_qtiles = 1;
  expect_error([&] { (void)t.at(0, 0, 0, 0); }, "values", "overflow");
  expect_error([&] { (void)ThresholdTable::value_count(1, 1, 0, 1); }, "n_heads", "must be >= 1, got 0");
  EXPECT_EQ(ThresholdTable::value_count(2, 3, 4, 5), 120u);
  t.n_layers = 1;
  t.n_qtiles = 1000000;  // larger than values
  t.values.assign(4, 0.0f);
  expect_error([&] { (void)t.slice(0, 0); }, "values", "holds 4 values, expected 4000000");

  ThresholdTable bad = sample_table();
  bad.budgets = {-5, -5};
  const std::string path = temp_path("budgets");
  expect_error([&] { bad.save(path); }, "budgets", "budget -5 at [0] must be >= 1");
  bad.budgets = {3, 3};
  expect_error([&] { bad.validate(); }, "budgets", "budget 3 is repeated");
  // The same table written directly: load refuses it, naming the file.
  sample_table().save(path);
  detail::SafetensorsFile f = detail::read_safetensors(path);
  const std::int64_t minus_five[2] = {-5, -5};
  for (auto& e : f.tensors)
    if (e.name == "budgets") std::memcpy(e.data.data(), minus_five, sizeof minus_five);
  detail::write_safetensors(path, f);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "invalid table: ThresholdTable: argument 'budgets'");
  // An empty thresholds tensor with huge extents: no value to read, refused by its extents.
  f.tensors = {detail::SafetensorsEntry{"thresholds", "F32", {1, 0, std::int64_t{1} << 62, std::int64_t{1} << 62}, {}},
               detail::SafetensorsEntry{"budgets", "I64", {1}, std::vector<std::byte>(8)}};
  detail::write_safetensors(path, f);
  expect_error([&] { (void)ThresholdTable::load(path); }, path, "argument 'n_layers': must be >= 1, got 0");
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace sparse_attn
