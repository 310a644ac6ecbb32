// GPU tests of the CUDA selectors against their contract (docs/design.md §5.7): each list a top-k of the
// exact float64 scores within the kernel's ε (token_max: token_max_contract.hpp; lightning blocks:
// lightning_testing.hpp; pooled in test_pooled_gpu.cu), on random inputs and on planted ones (far-away blocks copied from the
// queries, and duplicated blocks whose exact ties must go to the lower id), over awkward shapes
// (Lq = 1, 17, 1013; Lk not a multiple of 128; GQA 1 and 16; B > 1; causal and not). Device outputs
// are poisoned first, so an unwritten slot cannot match the reference.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "gpu/lightning_testing.hpp"
#include "gpu/token_max_contract.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::cuda_ok;
using st::Dev;
using st::expect_equal_i32;
using st::poisoned_i32;

// Copies `n` rows of [B, L, H, D] tensors of one dtype: dst[b, dl + r, dh] = src[b, sl + r, sh].
void copy_rows(sa::HostTensor& dst, std::int64_t b, std::int64_t dl, std::int64_t dh, const sa::HostTensor& src,
               std::int64_t sl, std::int64_t sh, std::int64_t n) {
  const auto es = static_cast<std::int64_t>(sa::dtype_size(dst.dtype()));
  const auto& ds = dst.shape();
  const auto& ss = src.shape();
  const std::int64_t D = ds[3];
  for (std::int64_t r = 0; r < n && dl + r < ds[1] && sl + r < ss[1]; ++r) {
    char* d = dst.data<char>() + (((b * ds[1] + dl + r) * ds[2] + dh) * D) * es;
    const char* s = src.data<const char>() + (((b * ss[1] + sl + r) * ss[2] + sh) * D) * es;
    std::memcpy(d, s, static_cast<std::size_t>(D * es));
  }
}

// Plants structure into k given q (both [B, L, H, D], same dtype): for every batch, a far block takes
// the keys of a Q tile's queries (a strong match), and two blocks get identical contents (exact ties).
void plant(const sa::HostTensor& q, sa::HostTensor& k, std::int64_t group) {
  const std::int64_t B = k.shape()[0], Lq = q.shape()[1], Lk = k.shape()[1], Hk = k.shape()[2];
  const std::int64_t Tk = sa::ceil_div(Lk, sa::kBlockK), Tq = sa::ceil_div(Lq, sa::kTileQ);
  if (Tk < 4) return;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t far = 1 + b % 2, t = (Tq - 1) / (1 + b);
    for (std::int64_t h = 0; h < Hk; ++h) copy_rows(k, b, far * sa::kBlockK, h, q, t * sa::kTileQ, h * group, sa::kBlockK);
    const std::int64_t twin = Tk - 2 == far ? Tk - 1 : Tk - 2, src = far;
    for (std::int64_t h = 0; h < Hk; ++h) copy_rows(k, b, twin * sa::kBlockK, h, k, src * sa::kBlockK, h, sa::kBlockK);
  }
}

// ---- token_max -----------------------------------------------------------------------------------

struct TokenCase {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 128, Hkv = 1, Hk = 1, Di = 64;
  int top_k = 4, kmax = 4;
  bool causal = true, reserve_local = true, planted = false;
  sa::DType dtype = sa::DType::bf16;
};

// The GPU lists against the token_max contract (token_max_contract.hpp): a top-k of the exact scores
// within the kernel's eps, not the CPU's ids bit for bit.
void run_token_max(const TokenCase& c, sa::IndexPrecision prec, bool tiles, std::uint64_t seed) {
  sa::HostTensor q = st::random_tensor(c.dtype, {c.B, c.Lq, c.Hkv, c.Di}, seed);
  sa::HostTensor k = st::random_tensor(c.dtype, {c.B, c.Lk, c.Hk, c.Di}, seed + 1);
  if (c.planted) plant(q, k, c.Hkv / c.Hk);
  const st::TokenMaxCase tc{c.name, c.B, c.Lq, c.Lk, c.Hkv, c.Hk, c.Di, c.top_k, c.kmax, c.causal, c.reserve_local};
  st::check_token_max_gpu(tc, prec, tiles, q, k);
}

std::vector<TokenCase> token_cases() {
  return {
      {"Lq=1 causal", 1, 1, 333, 1, 1, 64, 3, 4, true},
      {"Lq=17 non-causal Hk=Hkv", 1, 17, 900, 2, 2, 64, 4, 5, false},
      {"Lq=1013 causal B=2 planted", 2, 1013, 1013, 1, 1, 64, 5, 5, true, true, true},
      {"Lq<Lk causal Hk=1 of 2, Di=128", 2, 200, 1500, 2, 1, 128, 4, 6, true, true, true},
      {"non-causal no reserve planted, Di=48 f32", 1, 150, 1100, 1, 1, 48, 3, 3, false, false, true, sa::DType::f32},
      {"Lq>Lk causal (queries see nothing), f16", 1, 300, 140, 1, 1, 32, 2, 2, true, true, false, sa::DType::f16},
      {"top_k above candidates, Di=20", 1, 130, 400, 1, 1, 20, 8, 9, true},
  };
}

TEST(SelectorsGpu, TokenMaxQueryListsWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 500;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3, sa::IndexPrecision::fp4_e2m1})
    for (const auto& c : token_cases()) run_token_max(c, prec, false, seed += 10);
}

TEST(SelectorsGpu, TokenMaxTileListsWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 900;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3, sa::IndexPrecision::fp4_e2m1})
    for (const auto& c : token_cases()) run_token_max(c, prec, true, seed += 10);
}

// ---- lightning (block form) --------------------------------------------------------------------

struct LightningCase {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 128, HI = 4, Di = 32, G = 1;
  int top_k = 2;
  bool causal = true;
  sa::DType dtype = sa::DType::bf16;
};

void run_lightning(const LightningCase& c, sa::IndexPrecision prec, std::uint64_t seed) {
  SCOPED_TRACE(c.name + " " + sa::precision_name(prec));
  const sa::HostTensor q = st::random_tensor(c.dtype, {c.B, c.Lq, c.HI, c.Di}, seed);
  const sa::HostTensor k = st::random_tensor(c.dtype, {c.B, c.Lk, c.Di}, seed + 1);
  const sa::HostTensor w = st::random_tensor(sa::DType::f32, {c.B, c.Lq, c.HI}, seed + 2);
  sa::LightningOptions o;
  o.top_k = c.top_k, o.causal = c.causal, o.precision = prec;
  const sa::HostTensor idx(sa::DType::i32, {c.B, c.G, c.Lq, c.top_k + 1});
  Dev dq(q), dk(k), dw(w), didx(poisoned_i32(idx.shape()));
  sa::lightning_select(dq.view, dw.view, dk.view, sa::QueryLists{didx.view}, o);
  cuda_ok(cudaDeviceSynchronize(), "lightning_select");
  st::expect_lightning_contract(st::lightning_oracle(q, w, k, o, true), didx.download(idx), c.top_k, "idx");
}

// The block form's contract (docs/design.md §5.7): a top-k of the CPU's float64 block scores up to ε.
TEST(SelectorsGpu, LightningBlocksContract) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const LightningCase cases[] = {
      {"Lq=1 causal", 1, 1, 300, 4, 32, 1, 2, true},
      {"Lq=17 non-causal G=2 B=2", 2, 17, 700, 3, 24, 2, 3, false},
      {"Lq=1013 causal, 8 heads of 64", 1, 1013, 1013, 8, 64, 1, 4, true},
      {"Lq<Lk causal f32", 2, 150, 900, 2, 16, 1, 2, true, sa::DType::f32},
      {"Lq>Lk causal f16 (queries see nothing)", 1, 300, 140, 2, 16, 1, 2, true, sa::DType::f16},
  };
  std::uint64_t seed = 1300;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const auto& c : cases) run_lightning(c, prec, seed += 10);
}

// Host memory labelled cuda is an Error naming the tensor, before any kernel could fault on it.
TEST(SelectorsGpu, HostMemoryLabelledCudaIsRejected) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {1, 130, 2, 64}, 8);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {1, 300, 1, 64}, 9);
  sa::HostTensor idx(sa::DType::i32, {1, 1, 2, 2}), cnt(sa::DType::i32, {1, 1, 2});
  Dev dq(q), dk(k), didx(idx), dcnt(cnt);
  sa::TensorView hq = q.view();
  hq.device = sa::Device::cuda;
  sa::PooledOptions o;
  o.top_k = 2;
  try {
    sa::pooled_select(hq, dk.view, sa::TileLists{didx.view, dcnt.view}, o);
    ADD_FAILURE() << "no Error for a host pointer labelled cuda";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
  }
  sa::TensorView hidx = idx.view();
  hidx.device = sa::Device::cuda;
  try {
    sa::pooled_select(dq.view, dk.view, sa::TileLists{hidx, dcnt.view}, o);
    ADD_FAILURE() << "no Error for a host output labelled cuda";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "out.idx") << e.what();
  }
  cuda_ok(cudaDeviceSynchronize(), "no kernel ran on host memory");
}

// The public functions run on the caller's stream: results on a fresh stream keep the contract
// (token_max's: a top-k of the exact scores within its eps).
TEST(SelectorsGpu, RunOnCallerStream) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {1, 256, 2, 64}, 77);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {1, 700, 1, 64}, 78);
  const st::TokenMaxCase c{"caller stream", 1, 256, 700, 2, 1, 64, 3, 3, true};
  Dev dq(q), dk(k);
  st::check_token_max_gpu(c, sa::IndexPrecision::fp8_e4m3, false, q, k, dq.view, dk.view, s);
  cudaStreamDestroy(s);
}

// Small enough for compute-sanitizer (scripts/gpu_run.sh runs '*SanitizerSmall*'): every kernel of
// the token_max (three precisions, both formats) and lightning (blocks) selectors once, with partial
// blocks (pooled: PooledGpu.SanitizerSmall).
TEST(SelectorsGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenCase c{"sanitizer token_max", 2, 150, 290, 2, 1, 40, 2, 3, true, true, true};
  run_token_max(c, sa::IndexPrecision::bf16, false, 13);
  run_token_max(c, sa::IndexPrecision::fp8_e4m3, true, 14);
  run_token_max(c, sa::IndexPrecision::fp4_e2m1, false, 15);
  run_lightning({"sanitizer lightning", 2, 150, 290, 3, 24, 2, 2, true}, sa::IndexPrecision::fp8_e4m3, 16);
}

}  // namespace
