// GPU tests of the lightning indexer (TokenLists and the block form, QueryLists) against its contract
// (docs/design.md §5.7): every list of every group is a top-k of the exact float64 scores of the CPU-quantised
// inputs up to the kernel's bound ε (lightning_epsilon), holds min(top_k, candidates) ascending visible ids,
// the forced sink keys (blocks) first, -1 after; two runs are bitwise equal. In bf16 and fp8, on random
// inputs, awkward shapes (Lq = 1, 17, 1013, Lk not a multiple of 128, Lq != Lk both ways, queries seeing fewer
// than top_k keys or none, B > 1, G > 1, HI from 1 to 128, Di from 20 to 256, input views with padded rows)
// and adversarial ones (planted near-ties below and above ε, huge and tiny magnitudes, rows whose scores
// increase so that the candidate buffer overflows and its threshold rises many times, sinks). Device outputs
// are poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "gpu/lightning_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::cuda_ok;
using st::Dev;
using st::poisoned_i32;

struct Case {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 128, HI = 4, Di = 32, G = 1;
  int top_k = 16;
  bool causal = true;
  sa::DType dtype = sa::DType::bf16;
  int extra_width = 0;  // Kt - top_k
  int sink = 0;
};

struct Inputs {
  sa::HostTensor q, w, k;
};

Inputs random_inputs(const Case& c, std::uint64_t seed) {
  return {st::random_tensor(c.dtype, {c.B, c.Lq, c.HI, c.Di}, seed), st::random_tensor(sa::DType::f32, {c.B, c.Lq, c.HI}, seed + 1),
          st::random_tensor(c.dtype, {c.B, c.Lk, c.Di}, seed + 2)};
}

sa::LightningOptions options_of(const Case& c, sa::IndexPrecision prec) {
  sa::LightningOptions o;
  o.top_k = c.top_k, o.causal = c.causal, o.precision = prec, o.sink_keys = c.sink;
  return o;
}

// The GPU output [B, G, Lq, top_k + extra_width] of one form.
sa::HostTensor run_gpu(const Case& c, sa::IndexPrecision prec, const Inputs& in, bool blocks) {
  const sa::LightningOptions o = options_of(c, prec);
  const sa::HostTensor like(sa::DType::i32, {c.B, c.G, c.Lq, c.top_k + c.extra_width});
  Dev dq(in.q), dw(in.w), dk(in.k), didx(poisoned_i32(like.shape()));
  if (blocks) sa::lightning_select(dq.view, dw.view, dk.view, sa::QueryLists{didx.view}, o);
  else sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{didx.view}, o);
  const cudaError_t e = cudaDeviceSynchronize();
  EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  return didx.download(like);
}

// Both forms: the contract against the oracle, every slot past top_k -1, and a second run bitwise equal.
// Returns the token form's report.
st::ContractReport check(const Case& c, sa::IndexPrecision prec, const Inputs& in) {
  st::ContractReport token_report;
  for (const bool blocks : {false, true}) {
    const std::string what = c.name + " " + sa::precision_name(prec) + (blocks ? " blocks" : " tokens");
    SCOPED_TRACE(what);
    const sa::HostTensor got = run_gpu(c, prec, in, blocks);
    const st::LightningOracle oracle = st::lightning_oracle(in.q, in.w, in.k, options_of(c, prec), blocks);
    const st::ContractReport rep = st::expect_lightning_contract(oracle, got, c.top_k, what);
    if (!blocks) token_report = rep;
    const sa::HostTensor again = run_gpu(c, prec, in, blocks);
    EXPECT_EQ(std::memcmp(got.data<std::int32_t>(), again.data<std::int32_t>(), static_cast<std::size_t>(got.numel()) * 4), 0)
        << what << ": two runs differ";
  }
  return token_report;
}

const Case kCases[] = {
    {"Lq=1 causal", 1, 1, 300, 4, 32, 1, 16, true},
    {"Lq=17 non-causal G=2 B=2, Kt > k", 2, 17, 700, 3, 24, 2, 32, false, sa::DType::bf16, 5},
    {"Lq=1013 causal, 8 heads of 64", 1, 1013, 1013, 8, 64, 1, 64, true},
    {"Lq<Lk causal f32 B=2", 2, 150, 900, 2, 16, 1, 40, true, sa::DType::f32},
    {"Lq>Lk causal f16 (queries see nothing)", 1, 300, 140, 2, 16, 1, 8, true, sa::DType::f16},
    {"Di=20 HI=5 G=3 non-causal", 1, 40, 333, 5, 20, 3, 7, false},
    {"64 heads of 128, top-256", 1, 96, 2100, 64, 128, 1, 256, true},
    {"k=1", 2, 33, 257, 4, 48, 1, 1, true},
    {"HI=1", 1, 70, 650, 1, 64, 1, 12, true},
    {"HI=80 (128 head slots), Di=160", 1, 30, 400, 80, 160, 1, 50, true},
    {"HI=128, Di=256", 1, 9, 300, 128, 256, 1, 20, false},
    {"HI=16 (8 queries a tile), Lk % 128 = 1", 1, 100, 1153, 16, 32, 1, 24, true},
    {"HI=24 (4 queries a tile), Lq % 4 = 1", 1, 77, 900, 24, 48, 1, 30, true},
};

TEST(LightningGpu, ContractRandom) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4000;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const auto& c : kCases) check(c, prec, random_inputs(c, seed += 10));
}

// The bound is not vacuous: on random inputs ε stays well below the spread of a row's scores (a selection of
// arbitrary visible keys would break the contract), and (on a GPU) some rows come out equal to the float64 top-k.
TEST(LightningGpu, BoundIsNotVacuous) {
  const Case c{"non-vacuous", 1, 64, 1500, 8, 64, 1, 64, false};
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3}) {
    SCOPED_TRACE(sa::precision_name(prec));
    const Inputs in = random_inputs(c, 4300);
    const st::LightningOracle oracle = st::lightning_oracle(in.q, in.w, in.k, options_of(c, prec), false);
    for (std::int64_t r = 0; r < oracle.exact.rows; ++r) {
      double lo = INFINITY, hi = -INFINITY;
      for (std::int64_t s = 0; s < oracle.exact.candidates; ++s)
        lo = std::min(lo, oracle.exact.at(r, s)), hi = std::max(hi, oracle.exact.at(r, s));
      EXPECT_LT(oracle.eps[static_cast<std::size_t>(r)], 0.25 * (hi - lo)) << "row " << r;
    }
    // The worst keys instead of the best (row 0; the others take the exact top-k) break the contract: the
    // checker with this ε can fail.
    sa::HostTensor worst(sa::DType::i32, {1, 1, c.Lq, c.top_k});
    for (std::int64_t t = 0; t < c.Lq; ++t) {
      std::vector<std::pair<double, std::int32_t>> v;
      for (std::int64_t s = 0; s < c.Lk; ++s)
        v.push_back({(t == 0 ? 1.0 : -1.0) * oracle.exact.at(t, s), static_cast<std::int32_t>(s)});
      std::sort(v.begin(), v.end());
      std::vector<std::int32_t> ids;
      for (int i = 0; i < c.top_k; ++i) ids.push_back(v[static_cast<std::size_t>(i)].second);
      std::sort(ids.begin(), ids.end());
      std::copy(ids.begin(), ids.end(), worst.data<std::int32_t>() + t * c.top_k);
    }
    EXPECT_NONFATAL_FAILURE(st::expect_lightning_contract(oracle, worst, c.top_k, "worst keys"), "min selected");
    if (!sa::cuda_available()) continue;  // the bound's part above needs no GPU
    const st::ContractReport rep = check(c, prec, in);
    EXPECT_LT(rep.rows_differing, rep.rows_checked) << "no row equals the float64 top-k";
  }
}

// Planted near-ties: key 3i + 1 and 3i + 2 are key 3i scaled by 1 + δ with δ far below ε (the order among them
// is free) and far above it (the order is forced); exact duplicates (key 2i + 1 = key 2i); all keys equal.
TEST(LightningGpu, ContractNearTies) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4900;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3}) {
    for (const float delta : {0x1p-12f, 0x1p-2f}) {
      const Case c{"near-ties delta " + std::to_string(delta), 2, 70, 900, 16, 32, 1, 48, false, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      float* k = in.k.data<float>();
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t s = 0; s + 2 < c.Lk; s += 3) {
          float* r = k + (b * c.Lk + s) * c.Di;
          for (std::int64_t d = 0; d < c.Di; ++d) r[c.Di + d] = r[d] * (1.0f + delta), r[2 * c.Di + d] = r[d] * (1.0f - delta);
        }
      check(c, prec, in);
    }
    {
      const Case c{"duplicated keys", 1, 130, 1100, 8, 64, 1, 64, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      float* k = in.k.data<float>();
      for (std::int64_t s = 1; s < c.Lk; s += 2) std::copy(k + (s - 1) * c.Di, k + s * c.Di, k + s * c.Di);
      check(c, prec, in);
    }
    {
      const Case c{"all keys equal", 1, 50, 600, 4, 32, 2, 20, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      float* k = in.k.data<float>();
      for (std::int64_t s = 1; s < c.Lk; ++s) std::copy(k, k + c.Di, k + s * c.Di);
      check(c, prec, in);
    }
  }
}

// Magnitudes: qI times 2^60 and kI times 2^-70 (the per-tensor fp8 scales absorb them; bf16 keeps them),
// weights of 1e6; an all-zero query tensor (fp8: scale 0, every score 0, the lowest ids win).
TEST(LightningGpu, ContractMagnitudes) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 5000;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3}) {
    {
      const Case c{"huge q, tiny k, large w", 1, 120, 1000, 12, 64, 1, 30, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      for (std::int64_t i = 0; i < in.q.numel(); ++i) in.q.data<float>()[i] *= 0x1p60f;
      for (std::int64_t i = 0; i < in.k.numel(); ++i) in.k.data<float>()[i] *= 0x1p-70f;
      for (std::int64_t i = 0; i < in.w.numel(); ++i) in.w.data<float>()[i] *= 1e6f;
      check(c, prec, in);
    }
    {
      const Case c{"positive weights, a few long keys", 1, 120, 1000, 12, 64, 1, 30, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      for (std::int64_t i = 0; i < in.w.numel(); ++i) in.w.data<float>()[i] = std::fabs(in.w.data<float>()[i]);
      float* k = in.k.data<float>();
      for (std::int64_t s = 0; s < c.Lk; s += 37)
        for (std::int64_t d = 0; d < c.Di; ++d) k[s * c.Di + d] *= 16.0f;
      check(c, prec, in);
    }
    {
      const Case c{"zero queries", 1, 40, 300, 3, 16, 1, 10, false, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      std::fill(in.q.data<float>(), in.q.data<float>() + in.q.numel(), 0.0f);
      check(c, prec, in);
    }
  }
}

// Long rows whose scores increase with the key (every key enters the candidate buffer, which fills and is
// compacted again and again, the threshold rising each time), decrease (nothing enters after the first
// keys), or zig-zag; top_k small against rows of 20000 keys, B = 2, both causal modes.
TEST(LightningGpu, ContractBufferOverflow) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const int pattern : {0, 1, 2})
      for (const bool causal : {true, false}) {
        const Case c{"overflow pattern " + std::to_string(pattern), 2, 5, 20000, 4, 32, 1, 100, causal, sa::DType::f32};
        Inputs in = random_inputs(c, 5200 + pattern);
        for (std::int64_t i = 0; i < in.q.numel(); ++i) in.q.data<float>()[i] = 1.0f + 0.01f * static_cast<float>(i % 7);
        for (std::int64_t i = 0; i < in.w.numel(); ++i) in.w.data<float>()[i] = 1.0f;
        float* k = in.k.data<float>();
        for (std::int64_t b = 0; b < c.B; ++b)
          for (std::int64_t s = 0; s < c.Lk; ++s) {
            const double x = static_cast<double>(s) / c.Lk;
            const double f = pattern == 0 ? 1.0 + x : pattern == 1 ? 2.0 - x : 1.0 + 0.5 * x + 0.3 * ((s * 7919) % 13) / 13.0;
            for (std::int64_t d = 0; d < c.Di; ++d)
              k[(b * c.Lk + s) * c.Di + d] = static_cast<float>(f * (1.0 + 0.001 * static_cast<double>(d % 5)));
          }
        check(c, prec, in);
      }
}

// Sink keys: fewer than top_k, more than top_k (the lowest top_k ids), beyond what a causal query sees, and
// spanning several blocks in the block form.
TEST(LightningGpu, ContractSinkKeys) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"sink 4", 1, 200, 700, 4, 32, 1, 16, true, sa::DType::bf16, 0, 4},
      {"sink 40 > top_k", 2, 60, 500, 4, 32, 2, 16, true, sa::DType::bf16, 0, 40},
      {"sink 300 non-causal (3 blocks)", 1, 30, 900, 8, 64, 1, 5, false, sa::DType::bf16, 0, 300},
      {"sink 7, HI=20 (4 queries a tile), non-causal", 1, 41, 400, 20, 32, 1, 10, false, sa::DType::bf16, 0, 7},
      {"sink 130 (into block 1) < top_k, 64 heads (2 queries a tile)", 1, 50, 600, 64, 64, 1, 140, true, sa::DType::bf16, 0, 130},
  };
  std::uint64_t seed = 5400;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const auto& c : cases) check(c, prec, random_inputs(c, seed += 10));
}

// An output view that is a strided slice of a larger buffer ([B, Lq, G, Kt + 3] storage): only the view's
// elements are written, equal to the dense call's; the rest keeps its poison.
TEST(LightningGpu, StridedOutput) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"strided", 2, 90, 500, 4, 32, 2, 24, true};
  const Inputs in = random_inputs(c, 5100);
  const sa::LightningOptions o = options_of(c, sa::IndexPrecision::fp8_e4m3);
  const sa::HostTensor ref = run_gpu(c, sa::IndexPrecision::fp8_e4m3, in, false);
  const std::int64_t W = c.top_k + 3;
  Dev dq(in.q), dw(in.w), dk(in.k), dst(poisoned_i32({c.B, c.Lq, c.G, W}));
  sa::TensorView v = dst.view;
  v.shape = {c.B, c.G, c.Lq, c.top_k};
  v.stride = {c.Lq * c.G * W, W, c.G * W, 1};
  sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{v}, o);
  cuda_ok(cudaDeviceSynchronize(), "lightning_select");
  const sa::HostTensor got = dst.download(poisoned_i32({c.B, c.Lq, c.G, W}));
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < c.Lq; ++t)
      for (std::int64_t g = 0; g < c.G; ++g)
        for (std::int64_t s = 0; s < W; ++s) {
          const std::int32_t x = got.data<std::int32_t>()[((b * c.Lq + t) * c.G + g) * W + s];
          const std::int32_t want = s < c.top_k ? ref.data<std::int32_t>()[((b * c.G + g) * c.Lq + t) * c.top_k + s] : 0x5a5a5a5a;
          bad += x != want;
        }
  EXPECT_EQ(bad, 0);
}

// Input views that are slices of larger buffers (rows padded by `pad` elements; the keys starting `pad` elements
// in): pad 3 leaves rows unaligned (element loads), pad 8 keeps them 16-byte aligned but not contiguous (16-byte
// loads row by row). The codes are those of the contiguous inputs, so the lists equal the contiguous call's.
TEST(LightningGpu, StridedInputs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"strided inputs", 2, 70, 600, 4, 32, 1, 24, true};
  const Inputs in = random_inputs(c, 5150);
  const std::size_t es = sa::dtype_size(c.dtype);
  for (const std::int64_t pad : {3, 8}) {
    sa::HostTensor qp(c.dtype, {c.B, c.Lq, c.HI, c.Di + pad}), kp(c.dtype, {c.B, c.Lk + 1, c.Di + pad});
    const auto* q = static_cast<const unsigned char*>(in.q.view().data);
    const auto* k = static_cast<const unsigned char*>(in.k.view().data);
    for (std::int64_t r = 0; r < c.B * c.Lq * c.HI; ++r)
      std::memcpy(static_cast<unsigned char*>(qp.view().data) + r * (c.Di + pad) * es, q + r * c.Di * es, c.Di * es);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t s = 0; s < c.Lk; ++s)
        std::memcpy(static_cast<unsigned char*>(kp.view().data) + ((b * (c.Lk + 1) + s) * (c.Di + pad) + pad) * es,
                    k + (b * c.Lk + s) * c.Di * es, c.Di * es);
    for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
      for (const bool blocks : {false, true}) {
        SCOPED_TRACE("pad " + std::to_string(pad) + " " + sa::precision_name(prec) + (blocks ? " blocks" : " tokens"));
        const sa::HostTensor ref = run_gpu(c, prec, in, blocks);
        Dev dq(qp), dw(in.w), dk(kp), didx(poisoned_i32(ref.shape()));
        sa::TensorView qv = dq.view, kv = dk.view;
        qv.shape = {c.B, c.Lq, c.HI, c.Di};
        kv.data = static_cast<unsigned char*>(dk.ptr) + pad * es;
        kv.shape = {c.B, c.Lk, c.Di};
        const sa::LightningOptions o = options_of(c, prec);
        if (blocks) sa::lightning_select(qv, dw.view, kv, sa::QueryLists{didx.view}, o);
        else sa::lightning_select(qv, dw.view, kv, sa::TokenLists{didx.view}, o);
        cuda_ok(cudaDeviceSynchronize(), "lightning_select");
        const sa::HostTensor got = didx.download(ref);
        EXPECT_EQ(std::memcmp(got.data<std::int32_t>(), ref.data<std::int32_t>(), static_cast<std::size_t>(ref.numel()) * 4), 0);
      }
  }
}

// Non-finite inputs are not rejected on the device (no synchronisation): the lists stay well formed (distinct
// ascending visible ids, then -1).
TEST(LightningGpu, NonFiniteInputsGiveWellFormedLists) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"nan", 1, 50, 400, 4, 32, 1, 20, true, sa::DType::f32};
  Inputs in = random_inputs(c, 5300);
  in.q.data<float>()[7 * c.HI * c.Di + 3] = std::nanf("");
  in.k.data<float>()[100 * c.Di + 1] = INFINITY;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3}) {
    const sa::HostTensor got = run_gpu(c, prec, in, false);
    for (std::int64_t t = 0; t < c.Lq; ++t) {
      const std::int64_t visible = std::min<std::int64_t>(c.Lk, t + (c.Lk - c.Lq) + 1);
      const std::int64_t n = std::min<std::int64_t>(visible, c.top_k);
      const std::int32_t* r = got.data<std::int32_t>() + t * c.top_k;
      for (std::int64_t s = 0; s < c.top_k; ++s) {
        if (s < n) EXPECT_TRUE(r[s] >= 0 && r[s] < visible && (s == 0 || r[s] > r[s - 1])) << "row " << t << " slot " << s;
        else EXPECT_EQ(r[s], -1) << "row " << t << " slot " << s;
      }
    }
  }
}

TEST(LightningGpu, TopKBeyondSharedMemoryIsAnError) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"huge k", 1, 4, 64, 2, 16, 1, 1 << 20, true};
  const Inputs in = random_inputs(c, 5400);
  Dev dq(in.q), dw(in.w), dk(in.k), didx(poisoned_i32({1, 1, 4, c.top_k}));
  try {
    sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{didx.view}, options_of(c, sa::IndexPrecision::bf16));
    ADD_FAILURE() << "no Error for top_k = 2^20";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "options.top_k") << e.what();
  }
}

// The scratch size is a pure function of the shapes: one allocation holding the amax words and the codes of
// both tensors in whole 128-row tiles; 0 where the call is refused.
TEST(LightningGpu, ScratchBytes) {
  const std::size_t fp8 = sa::cuda_backend::lightning_scratch_bytes(1, 32768, 32768, 64, 128, 2048,
                                                                    sa::IndexPrecision::fp8_e4m3, false);
  // 32768 queries x 64 heads and 32768 keys, 128 bytes a row, plus the amax words (256 bytes).
  EXPECT_EQ(fp8, 256u + 32768u * 64u * 128u + 32768u * 128u);
  EXPECT_EQ(sa::cuda_backend::lightning_scratch_bytes(1, 32768, 32768, 64, 128, 2048, sa::IndexPrecision::bf16, false),
            256u + 2u * (32768u * 64u * 128u + 32768u * 128u));
  EXPECT_EQ(sa::cuda_backend::lightning_scratch_bytes(1, 8, 8, 4, 32, 1 << 20, sa::IndexPrecision::fp8_e4m3, false), 0u);
  EXPECT_EQ(sa::cuda_backend::lightning_scratch_bytes(1, 8, 8, 200, 32, 16, sa::IndexPrecision::fp8_e4m3, false), 0u);
}

// The oracle itself (no GPU needed): the CPU's exact lists pass the contract, with sinks, in both forms.
TEST(LightningGpu, OracleAcceptsCpuLists) {
  const Case c{"cpu", 2, 40, 333, 5, 40, 2, 24, true, sa::DType::bf16, 0, 3};
  const Inputs in = random_inputs(c, 5600);
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const bool blocks : {false, true}) {
      const sa::LightningOptions o = options_of(c, prec);
      sa::HostTensor idx(sa::DType::i32, {c.B, c.G, c.Lq, c.top_k});
      if (blocks) sa::lightning_select(in.q.view(), in.w.view(), in.k.view(), sa::QueryLists{idx.view()}, o);
      else sa::lightning_select(in.q.view(), in.w.view(), in.k.view(), sa::TokenLists{idx.view()}, o);
      const st::ContractReport rep =
          st::expect_lightning_contract(st::lightning_oracle(in.q, in.w, in.k, o, blocks), idx, c.top_k, "cpu");
      EXPECT_EQ(rep.rows_differing, 0);
    }
}

// Small enough for compute-sanitizer: both forms, both precisions, with partial tiles.
TEST(LightningGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"sanitizer", 2, 40, 333, 5, 40, 2, 24, true, sa::DType::bf16, 0, 3};
  const Inputs in = random_inputs(c, 5500);
  check(c, sa::IndexPrecision::fp8_e4m3, in);
  check(c, sa::IndexPrecision::bf16, in);
}

}  // namespace
