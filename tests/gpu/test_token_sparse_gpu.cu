// GPU tests of token_sparse (per-query key positions shared by the heads of a GQA group) on device
// tensors: every result against the float64 CPU reference with the lists applied as an explicit mask
// (docs/design.md §6), into poisoned outputs, on group sizes 1 to 32 (20 included), list capacities Kt from 1
// to 1000 (every key of Lk at most), causal and not, Lq > Lk under causal (queries that see no key:
// out exactly 0, lse -inf), Lq = 1 and 17, B = 2 and Hkv = 2 with different lists, D = 64 and 128,
// bf16 and f16, lists with random -1 holes, a row entirely -1, positions in shuffled and ascending
// order; checked, trusted and repeated runs bit for bit the same; strided q, k, v and out (padding after
// each head, token and batch, never written) and lists with a row stride past Kt, on a caller's
// non-blocking stream; the device-side validation of the lists, whose errors must be the CPU's (same
// argument, same text: the first faulty row in row-major order, its first faulty slot); and small
// cases for compute-sanitizer.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/query_lists_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::query_lists::cuda_ok;
using st::query_lists::DeviceBuffer;


enum class Order { shuffled, ascending };  // slot order of a row's positions
enum class Draw { anywhere, visible };     // positions from [0, Lk), or from the keys the query sees

struct Case {
  std::string name;
  sa::DType dtype = sa::DType::bf16;
  std::int64_t B = 1, Lq = 128, Lk = 256, Hq = 1, Hkv = 1, D = 128;
  bool causal = false;
  std::int64_t kt = 16;       // list capacity per query (Kt <= Lk)
  Order order = Order::shuffled;
  Draw draw = Draw::anywhere;
  int holes = 25;             // chance in percent that a drawn slot is left -1
  float scale = 0.0f;         // 0: default 1 / sqrt(D)
};

// TokenLists idx [B, Hkv, Lq, Kt]: per (b, g, query) min(Kt, n) distinct positions drawn from the n
// candidates ([0, Lk), or with Draw::visible the query's visible keys [0, key_end(i))), each left -1 with
// chance holes / 100; Order::shuffled puts them (and the empty slots) in random slots, Order::ascending
// keeps them ascending with the holes in place. The middle row in row-major order (flat index
// B * Hkv * Lq / 2) is entirely -1. Lists differ across b and g.
sa::HostTensor make_tokens(const Case& c, const sa::ProblemShape& p, std::uint64_t seed) {
  sa::HostTensor idx(sa::DType::i32, {p.B, p.Hkv, p.Lq, c.kt});
  auto* d = idx.data<std::int32_t>();
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> all(static_cast<std::size_t>(p.Lk));
  const std::int64_t rows = p.B * p.Hkv * p.Lq;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int32_t* row = d + r * c.kt;
    std::fill(row, row + c.kt, -1);
    if (r == rows / 2) continue;
    const std::int64_t i = r % p.Lq;
    const std::int64_t n = c.draw == Draw::visible ? p.key_end(i) : p.Lk;
    const std::int64_t picks = std::min(c.kt, n);
    std::iota(all.begin(), all.begin() + n, 0);
    for (std::int64_t s = 0; s < picks; ++s) {  // partial Fisher-Yates: all[0, picks) is a random subset
      const auto j = s + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(n - s));
      std::swap(all[static_cast<std::size_t>(s)], all[static_cast<std::size_t>(j)]);
    }
    if (c.order == Order::ascending) std::sort(all.begin(), all.begin() + picks);
    for (std::int64_t s = 0; s < picks; ++s)
      row[s] = static_cast<int>(rng() % 100) < c.holes ? -1 : all[static_cast<std::size_t>(s)];
    if (c.order == Order::shuffled) std::shuffle(row, row + c.kt, rng);
  }
  return idx;
}

// A case's inputs: random q, k, v and lists from the seed.
struct CaseData {
  sa::ProblemShape p;
  sa::HostTensor q, k, v, idx;
  sa::AttentionOptions opt;
  double scale = 0.0;
};

CaseData make_case(const Case& c, std::uint64_t seed) {
  CaseData d;
  d.p.B = c.B, d.p.Lq = c.Lq, d.p.Lk = c.Lk, d.p.Hq = c.Hq, d.p.Hkv = c.Hkv, d.p.D = c.D, d.p.causal = c.causal;
  d.q = st::random_tensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}, seed * 7 + 1);
  d.k = st::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed * 7 + 2);
  d.v = st::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed * 7 + 3);
  d.idx = make_tokens(c, d.p, seed * 7 + 4);
  d.opt.causal = c.causal;
  if (c.scale > 0) d.opt.softmax_scale = c.scale;
  d.scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.D));
  return d;
}

struct Result {
  sa::HostTensor out, lse;
};

Result poisoned_result(const Case& c) {
  Result r{sa::HostTensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}), sa::HostTensor(sa::DType::f32, {c.B, c.Hq, c.Lq})};
  st::poison(r.out);
  st::poison(r.lse);
  return r;
}

// One call of the public operator on device copies of the case's inputs, into poisoned outputs (lse
// left poisoned where `with_lse` is false).
Result run_gpu(const Case& c, const CaseData& d, bool trusted = false, bool with_lse = true) {
  Result r = poisoned_result(c);
  DeviceBuffer q(d.q), k(d.k), v(d.v), idx(d.idx), out(r.out), lse(r.lse);
  sa::AttentionOptions opt = d.opt;
  opt.trusted = trusted;
  const std::optional<sa::TensorView> lse_view = with_lse ? std::optional<sa::TensorView>(lse.view) : std::nullopt;
  sa::token_sparse(q.view, k.view, v.view, sa::TokenLists{idx.view}, out.view, lse_view, opt);
  cuda_ok(cudaDeviceSynchronize(), "token_sparse");
  out.download(r.out);
  lse.download(r.lse);
  return r;
}

st::Reference reference_of(const CaseData& d) {
  return st::reference_attention(d.q.view(), d.k.view(), d.v.view(), sa::TokenLists{d.idx.view()}, d.p, d.scale);
}

struct Tolerance {
  double rel, max_abs_frac, lse_abs;
};

// As for tile_sparse: a plain same-precision implementation lands near 3e-3 (bf16) / 4e-4 (f16)
// relative error (P and the output rounded to the 16-bit type); the bounds allow 2x that plus a small
// absolute term, and bound the worst element to a few units in the last place of the largest output.
Tolerance tolerance(sa::DType d) {
  if (d == sa::DType::bf16) return {2 * 3e-3 + 1e-4, 4 * std::ldexp(1.0, -8), 1e-3};
  return {2 * 4e-4 + 1e-5, 4 * std::ldexp(1.0, -11), 1e-3};
}

// `r` against the reference: error bounds, and queries that see no key exactly out = 0, lse = -inf.
void check_result(const Case& c, const st::Reference& ref, const Result& r) {
  // Every case must exercise the kernel: at least one query sees at least one key.
  ASSERT_TRUE(std::any_of(ref.lse.begin(), ref.lse.end(), [](double x) { return std::isfinite(x); }))
      << c.name << ": degenerate case, no query sees any key";
  const Tolerance tol = tolerance(c.dtype);
  EXPECT_TRUE(st::all_finite(r.out)) << c.name << ": out holds NaN/inf (unwritten or broken)";
  const double rel = st::rel_err(r.out, ref.out);
  double ref_max = 1.0;
  for (double x : ref.out) ref_max = std::max(ref_max, std::abs(x));
  const double max_abs = st::max_abs_err(r.out, ref.out);
  const double lse_err = st::lse_max_err(r.lse, ref.lse);
  EXPECT_LE(rel, tol.rel) << c.name << ": relative error";
  EXPECT_LE(max_abs, tol.max_abs_frac * ref_max) << c.name << ": max element error (max |ref| " << ref_max << ")";
  EXPECT_LE(lse_err, tol.lse_abs) << c.name << ": lse error";
  const std::int64_t empty = st::expect_empty_rows(r.out, r.lse, ref, c.name);
  std::printf("[ %-40s ] relerr %.3e  max_abs %.3e  lse_err %.3e  empty rows %lld\n", c.name.c_str(), rel, max_abs,
              lse_err, static_cast<long long>(empty));
}

bool same_bits(const sa::HostTensor& a, const sa::HostTensor& b) {
  const std::size_t bytes = static_cast<std::size_t>(a.numel()) * sa::dtype_size(a.dtype());
  return a.numel() == b.numel() && a.dtype() == b.dtype() && std::memcmp(a.view().data, b.view().data, bytes) == 0;
}

// ---- strided views ------------------------------------------------------------------------------

// Padding of a [B, L, H, D] tensor inside a wider buffer, in elements: after each head, after each
// token's heads, after each batch's tokens. Multiples of 8 keep every head row 16-byte aligned.
struct Padding {
  std::int64_t head = 0, token = 0, batch = 0;
};

struct Layout {
  std::array<std::int64_t, 4> stride;  // elements
  std::int64_t elems;                  // of the whole buffer
};

Layout padded_layout(const std::vector<std::int64_t>& shape, const Padding& pad) {
  const std::int64_t hs = shape[3] + pad.head, ts = shape[2] * hs + pad.token, bs = shape[1] * ts + pad.batch;
  return {{bs, ts, hs, 1}, shape[0] * bs};
}

// Copies the head rows of a dense [B, L, H, D] tensor into a 1-D buffer of the layout (to_padded) or
// back (from_padded).
template <class F>
void for_each_row(const std::vector<std::int64_t>& s, const Layout& l, F&& f) {
  for (std::int64_t b = 0; b < s[0]; ++b)
    for (std::int64_t i = 0; i < s[1]; ++i)
      for (std::int64_t h = 0; h < s[2]; ++h)
        f(((b * s[1] + i) * s[2] + h) * s[3], b * l.stride[0] + i * l.stride[1] + h * l.stride[2]);
}

void to_padded(const sa::HostTensor& t, sa::HostTensor& wide, const Layout& l) {
  const std::size_t es = sa::dtype_size(t.dtype()), row_bytes = static_cast<std::size_t>(t.shape()[3]) * es;
  const auto* src = static_cast<const unsigned char*>(t.view().data);
  auto* dst = static_cast<unsigned char*>(wide.view().data);
  for_each_row(t.shape(), l, [&](std::int64_t dense, std::int64_t padded) {
    std::memcpy(dst + static_cast<std::size_t>(padded) * es, src + static_cast<std::size_t>(dense) * es, row_bytes);
  });
}

void from_padded(const sa::HostTensor& wide, sa::HostTensor& t, const Layout& l) {
  const std::size_t es = sa::dtype_size(t.dtype()), row_bytes = static_cast<std::size_t>(t.shape()[3]) * es;
  const auto* src = static_cast<const unsigned char*>(wide.view().data);
  auto* dst = static_cast<unsigned char*>(t.view().data);
  for_each_row(t.shape(), l, [&](std::int64_t dense, std::int64_t padded) {
    std::memcpy(dst + static_cast<std::size_t>(dense) * es, src + static_cast<std::size_t>(padded) * es, row_bytes);
  });
}

// A poisoned (NaN) buffer of the layout holding `t`'s elements at their places.
sa::HostTensor padded_copy(const sa::HostTensor& t, const Layout& l) {
  sa::HostTensor wide(t.dtype(), {l.elems});
  st::poison(wide);
  to_padded(t, wide, l);
  return wide;
}

sa::TensorView padded_view(void* ptr, sa::DType dtype, const std::vector<std::int64_t>& shape, const Layout& l) {
  sa::TensorView v = sa::TensorView::contiguous(ptr, dtype, shape, sa::Device::cuda, 0);
  for (std::size_t d = 0; d < 4; ++d) v.stride[d] = l.stride[d];
  return v;
}

// ---- errors -------------------------------------------------------------------------------------

// Valid lists for the error cases: row r, slot s holds (7 r + 37 s) mod Lk (distinct within a row while
// 37 and Lk are coprime and Kt <= Lk), or -1 where (r + s) % 5 == 0. Each case spoils a few rows.
sa::HostTensor base_tokens(const sa::ProblemShape& p, std::int64_t kt) {
  sa::HostTensor idx(sa::DType::i32, {p.B, p.Hkv, p.Lq, kt});
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r)
    for (std::int64_t s = 0; s < kt; ++s)
      idx.data<std::int32_t>()[r * kt + s] = (r + s) % 5 == 0 ? -1 : static_cast<std::int32_t>((7 * r + 37 * s) % p.Lk);
  return idx;
}

// The CPU operator on host tensors and the device one on device copies of the same inputs: both must
// throw sa::Error with the same argument ("tokens.idx") and the same text, which must hold `want`.
void expect_same_error(const std::string& name, const Case& c, const CaseData& d, const sa::HostTensor& idx,
                       const std::string& want) {
  SCOPED_TRACE(name);
  Result cpu = poisoned_result(c);
  std::optional<sa::Error> cpu_err, gpu_err;
  try {
    sa::token_sparse(d.q.view(), d.k.view(), d.v.view(), sa::TokenLists{idx.view()}, cpu.out.view(), cpu.lse.view(),
                     d.opt);
  } catch (const sa::Error& e) {
    cpu_err = e;
  }
  Result gpu = poisoned_result(c);
  DeviceBuffer dq(d.q), dk(d.k), dv(d.v), didx(idx), dout(gpu.out), dlse(gpu.lse);
  try {
    sa::token_sparse(dq.view, dk.view, dv.view, sa::TokenLists{didx.view}, dout.view, dlse.view, d.opt);
  } catch (const sa::Error& e) {
    gpu_err = e;
  }
  cuda_ok(cudaDeviceSynchronize(), "after the rejected call");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the rejected call left a CUDA error behind";
  ASSERT_TRUE(cpu_err.has_value()) << "the CPU accepted lists the test made invalid";
  EXPECT_EQ(cpu_err->argument(), "tokens.idx") << cpu_err->what();
  EXPECT_NE(std::string(cpu_err->what()).find(want), std::string::npos) << cpu_err->what();
  ASSERT_TRUE(gpu_err.has_value()) << "the device accepted lists the CPU rejects: " << cpu_err->what();
  EXPECT_EQ(gpu_err->argument(), cpu_err->argument()) << gpu_err->what();
  EXPECT_STREQ(gpu_err->what(), cpu_err->what());
  std::printf("[ %-40s ] %s\n", name.c_str(), gpu_err->what());
}

}  // namespace

TEST(TokenSparseGpu, MatchesReference) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const auto bf = sa::DType::bf16, f16 = sa::DType::f16;
  const auto asc = Order::ascending, shuf = Order::shuffled;
  const auto vis = Draw::visible, any = Draw::anywhere;
  const std::vector<Case> cases = {
      // name, dtype, B, Lq, Lk, Hq, Hkv, D, causal, Kt[, order, draw, holes %, scale]
      {"G1 Kt=64", bf, 1, 300, 700, 1, 1, 128, false, 64},
      {"G2 B=2 Hkv=2 Kt=17 causal f16", f16, 2, 257, 513, 4, 2, 128, true, 17},
      {"G4 Kt=200 causal D=64", bf, 1, 500, 900, 4, 1, 64, true, 200},
      {"G8 B=2 Hkv=2 Kt=1", bf, 2, 130, 300, 16, 2, 128, false, 1},
      {"G8 Kt=1 causal visible f16", f16, 1, 300, 300, 8, 1, 128, true, 1, shuf, vis},
      {"G16 Kt=1000=Lk causal", bf, 1, 200, 1000, 16, 1, 128, true, 1000},
      {"G20 Kt=64 D=64 f16 scale 0.3", f16, 1, 150, 400, 20, 1, 64, false, 64, shuf, any, 25, 0.3f},
      {"G32 Hkv=2 Kt=200 causal", bf, 1, 100, 600, 64, 2, 128, true, 200},
      {"G32 B=2 Kt=17 D=64 f16", f16, 2, 64, 1500, 32, 1, 64, false, 17},
      {"Lq>Lk causal G2 Hkv=2 B=2 Kt=64 f16", f16, 2, 400, 250, 4, 2, 128, true, 64},
      {"Lq>Lk causal G16 D=64 visible", bf, 1, 300, 129, 16, 1, 64, true, 17, shuf, vis},
      {"Lq=1 B=2 G8 Kt=1000 Lk=1500 causal", bf, 2, 1, 1500, 8, 1, 128, true, 1000},
      {"Lq=17 G16 Kt=17 D=64 f16", f16, 1, 17, 260, 16, 1, 64, false, 17},
      {"Lq=17 B=2 G4 Hkv=2 Kt=200 causal", bf, 2, 17, 1000, 8, 2, 128, true, 200},
      {"every key ascending causal, one row -1", bf, 1, 300, 300, 2, 1, 128, true, 300, asc, any, 0},
      {"ascending B=2 G4 Hkv=2 Kt=200 D=64", f16, 2, 600, 1500, 8, 2, 64, false, 200, asc},
      {"ascending causal visible G8 Kt=64", bf, 1, 700, 800, 8, 1, 128, true, 64, asc, vis},
      {"G2 Kt=1000 Lq=1200 Lk=1500 causal f16", f16, 1, 1200, 1500, 2, 1, 128, true, 1000},
      {"G4 Kt=1000 Lq=Lk=1000 causal visible", bf, 1, 1000, 1000, 4, 1, 128, true, 1000, shuf, vis, 10},
      {"G1 B=2 Hkv=2 Kt=64 D=64 f16 no holes", f16, 2, 333, 777, 2, 2, 64, false, 64, shuf, any, 0},
      {"G16 Kt=200 75% holes", bf, 1, 257, 1100, 16, 1, 128, false, 200, shuf, any, 75},
  };
  std::uint64_t seed = 1000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const CaseData d = make_case(c, seed += 10);
    const Result r = run_gpu(c, d);
    check_result(c, reference_of(d), r);
  }
}

// Two checked runs and a trusted one on the same inputs agree bit for bit (out and lse); a run without
// lse gives the same attention.
TEST(TokenSparseGpu, TrustedAndDeterministic) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::vector<Case> cases = {
      {"det B=2 G8 Hkv=2 Kt=200 causal", sa::DType::bf16, 2, 700, 1000, 16, 2, 128, true, 200},
      {"det G20 Kt=64 D=64 f16", sa::DType::f16, 1, 300, 800, 20, 1, 64, false, 64},
      {"det G1 Hkv=2 Kt=1000 causal", sa::DType::bf16, 1, 1100, 1200, 2, 2, 128, true, 1000},
      {"det G32 Kt=17 Lq>Lk causal f16", sa::DType::f16, 1, 300, 200, 32, 1, 128, true, 17},
  };
  std::uint64_t seed = 2000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const CaseData d = make_case(c, seed += 10);
    const Result a = run_gpu(c, d), b = run_gpu(c, d), t = run_gpu(c, d, /*trusted=*/true);
    EXPECT_TRUE(st::all_finite(a.out)) << "out holds NaN/inf";
    EXPECT_TRUE(st::all_finite(a.lse, /*allow_neg_inf=*/true)) << "lse holds NaN or +inf";
    EXPECT_TRUE(same_bits(a.out, b.out)) << "out differs between two checked runs";
    EXPECT_TRUE(same_bits(a.lse, b.lse)) << "lse differs between two checked runs";
    EXPECT_TRUE(same_bits(a.out, t.out)) << "out of the trusted run differs from the checked run's";
    EXPECT_TRUE(same_bits(a.lse, t.lse)) << "lse of the trusted run differs from the checked run's";
    const Result n = run_gpu(c, d, false, /*with_lse=*/false);
    std::vector<double> a_out(static_cast<std::size_t>(a.out.numel()));
    for (std::int64_t e = 0; e < a.out.numel(); ++e) a_out[static_cast<std::size_t>(e)] = st::element(a.out, e);
    EXPECT_LE(st::rel_err(n.out, a_out), tolerance(c.dtype).rel) << "out without lse";
    std::printf("[ %-40s ] checked x2, trusted: same bits\n", c.name.c_str());
  }
}

// q, k, v and out as views into wider buffers (padding after each head, token and batch; q, k and v's
// padding NaN, out's never written) and lists with a row stride of Kt + 3 (the padding slots hold -7,
// which the validation would report if it read them), on a non-blocking stream of the caller; checked
// and trusted runs against the reference.
TEST(TokenSparseGpu, StridedViewsAndStream) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::vector<Case> cases = {
      {"strided B=2 G4 Hkv=2 Kt=50 causal", sa::DType::bf16, 2, 300, 700, 8, 2, 128, true, 50},
      {"strided G8 Kt=200 D=64 f16", sa::DType::f16, 1, 257, 900, 8, 1, 64, false, 200},
  };
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  struct Destroy {
    cudaStream_t s;
    ~Destroy() { cudaStreamDestroy(s); }
  } destroy{stream};
  std::uint64_t seed = 3000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const CaseData d = make_case(c, seed += 10);
    const st::Reference ref = reference_of(d);
    const std::vector<std::int64_t> out_shape{c.B, c.Lq, c.Hq, c.D};
    const Layout ql = padded_layout(d.q.shape(), {8, 16, 64});
    const Layout kvl = padded_layout(d.k.shape(), {8, 24, 0});
    const Layout ol = padded_layout(out_shape, {16, 8, 32});
    const sa::HostTensor wq = padded_copy(d.q, ql), wk = padded_copy(d.k, kvl), wv = padded_copy(d.v, kvl);
    sa::HostTensor wout(c.dtype, {ol.elems});
    st::poison(wout);
    const std::int64_t kt = c.kt, row_stride = kt + 3;
    sa::HostTensor widx(sa::DType::i32, {c.B, c.Hkv, c.Lq, row_stride});
    std::fill(widx.data<std::int32_t>(), widx.data<std::int32_t>() + widx.numel(), -7);
    for (std::int64_t r = 0; r < c.B * c.Hkv * c.Lq; ++r)
      std::memcpy(widx.data<std::int32_t>() + r * row_stride, d.idx.data<std::int32_t>() + r * kt,
                  static_cast<std::size_t>(kt) * 4);
    DeviceBuffer dq(wq), dk(wk), dv(wv), didx(widx), dout(wout);
    const sa::TensorView qv = padded_view(dq.ptr, c.dtype, d.q.shape(), ql);
    const sa::TensorView kv = padded_view(dk.ptr, c.dtype, d.k.shape(), kvl);
    const sa::TensorView vv = padded_view(dv.ptr, c.dtype, d.v.shape(), kvl);
    const sa::TensorView ov = padded_view(dout.ptr, c.dtype, out_shape, ol);
    sa::TensorView iv = didx.view;
    iv.shape[3] = kt;
    std::optional<Result> checked;
    for (bool trusted : {false, true}) {
      SCOPED_TRACE(trusted ? "trusted" : "checked");
      Result r = poisoned_result(c);
      DeviceBuffer dlse(r.lse);
      cuda_ok(cudaMemcpy(dout.ptr, wout.view().data, dout.bytes, cudaMemcpyHostToDevice), "poison out");
      sa::AttentionOptions opt = d.opt;
      opt.trusted = trusted;
      opt.stream = stream;
      sa::token_sparse(qv, kv, vv, sa::TokenLists{iv}, ov, dlse.view, opt);
      cuda_ok(cudaStreamSynchronize(stream), "token_sparse on the stream");
      sa::HostTensor got(c.dtype, {ol.elems});
      dout.download(got);
      dlse.download(r.lse);
      from_padded(got, r.out, ol);
      // The padding is untouched: with the poisoned rows put back, the buffer is the poisoned one.
      sa::HostTensor poisoned_rows(c.dtype, out_shape);
      st::poison(poisoned_rows);
      to_padded(poisoned_rows, got, ol);
      EXPECT_TRUE(same_bits(got, wout)) << "out's padding was written";
      check_result(c, ref, r);
      if (!checked) {
        checked = std::move(r);
      } else {
        EXPECT_TRUE(same_bits(checked->out, r.out)) << "out of the trusted run differs from the checked run's";
        EXPECT_TRUE(same_bits(checked->lse, r.lse)) << "lse of the trusted run differs from the checked run's";
      }
    }
  }
}

// Faulty lists: the device reports what the CPU reports (same argument and text): a position >= Lk, a
// value below -1, a repeated position (at its second occurrence), in the first faulty row in row-major
// (b, g, i) order and within it at the first faulty slot. Afterwards the valid lists run, checked and
// trusted, against the reference.
TEST(TokenSparseGpu, ErrorsAsOnTheCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  {
    const Case c{"errors Kt=6", sa::DType::bf16, 2, 600, 300, 4, 2, 128, false, 6};
    ASSERT_EQ(std::gcd(std::int64_t{37}, c.Lk), 1);
    CaseData d = make_case(c, 4000);
    d.idx = base_tokens(d.p, c.kt);
    auto row = [&](sa::HostTensor& t, std::int64_t b, std::int64_t g, std::int64_t i) {
      return t.data<std::int32_t>() + ((b * c.Hkv + g) * c.Lq + i) * c.kt;
    };
    auto set_row = [&](sa::HostTensor& t, std::int64_t b, std::int64_t g, std::int64_t i,
                       const std::array<std::int32_t, 6>& values) {
      std::copy(values.begin(), values.end(), row(t, b, g, i));
    };
    constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
    constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();
    {
      sa::HostTensor idx = d.idx;
      row(idx, 1, 0, 7)[2] = 300;
      expect_same_error("position = Lk", c, d, idx, "token position 300 at [1, 0, 7, 2] is out of range [0, 300)");
    }
    {
      sa::HostTensor idx = d.idx;
      row(idx, 0, 1, 599)[5] = kMax;
      expect_same_error("position INT32_MAX", c, d, idx,
                        "token position 2147483647 at [0, 1, 599, 5] is out of range [0, 300)");
    }
    {
      sa::HostTensor idx = d.idx;
      row(idx, 0, 1, 3)[1] = -5;
      expect_same_error("value -5", c, d, idx, "invalid value -5 at [0, 1, 3, 1] (only -1 may mark an empty slot)");
    }
    {
      sa::HostTensor idx = d.idx;
      row(idx, 1, 1, 599)[5] = kMin;  // the last slot of the last row
      expect_same_error("value INT32_MIN in the last slot", c, d, idx,
                        "invalid value -2147483648 at [1, 1, 599, 5] (only -1 may mark an empty slot)");
    }
    {
      sa::HostTensor idx = d.idx;
      set_row(idx, 1, 1, 300, {5, 9, -1, 5, 11, -1});
      expect_same_error("duplicate", c, d, idx, "duplicate token position 5 at [1, 1, 300, 3]");
    }
    {
      sa::HostTensor idx = d.idx;
      row(idx, 1, 0, 2)[0] = -5;                    // flat row 1202, slot 0
      row(idx, 0, 1, 450)[5] = 300;                 // flat row 1050, slot 5: reported
      set_row(idx, 1, 1, 0, {4, 4, -1, -1, -1, -1});  // flat row 1800
      expect_same_error("faults in three rows", c, d, idx, "token position 300 at [0, 1, 450, 5] is out of range");
    }
    {
      sa::HostTensor idx = d.idx;
      set_row(idx, 0, 0, 11, {1, 1, -1, -1, -1, -1});  // the later row's fault sits in an earlier slot
      set_row(idx, 0, 0, 10, {1, 2, 3, 4, 299, 300});
      expect_same_error("faults in adjacent rows", c, d, idx, "token position 300 at [0, 0, 10, 5] is out of range");
    }
    {
      sa::HostTensor idx = d.idx;
      set_row(idx, 0, 0, 42, {7, 8, 9, 1000, 10, 8});  // duplicate at slots 1 and 5, out of range at slot 3
      expect_same_error("duplicate around an out-of-range slot", c, d, idx,
                        "token position 1000 at [0, 0, 42, 3] is out of range [0, 300)");
    }
    {
      sa::HostTensor idx = d.idx;
      set_row(idx, 1, 0, 123, {20, -1, 20, 40, -5, 301});  // duplicate at slot 2 before -5 and 301
      expect_same_error("duplicate before an invalid value", c, d, idx,
                        "duplicate token position 20 at [1, 0, 123, 2]");
    }
    // The valid lists after the errors, checked and trusted.
    const st::Reference ref = reference_of(d);
    const Result checked = run_gpu(c, d), trusted = run_gpu(c, d, /*trusted=*/true);
    check_result(c, ref, checked);
    EXPECT_TRUE(same_bits(checked.out, trusted.out) && same_bits(checked.lse, trusted.lse)) << "trusted run differs";
  }
  {
    // Long rows (Kt = 200): faults past the first 128 slots.
    const Case c{"errors Kt=200 causal", sa::DType::f16, 1, 200, 1500, 8, 1, 64, true, 200};
    ASSERT_EQ(std::gcd(std::int64_t{37}, c.Lk), 1);
    CaseData d = make_case(c, 4100);
    d.idx = base_tokens(d.p, c.kt);
    auto row = [&](sa::HostTensor& t, std::int64_t i) { return t.data<std::int32_t>() + i * c.kt; };
    {
      sa::HostTensor idx = d.idx;
      std::int32_t* r = row(idx, 150);
      for (std::int64_t s = 0; s < c.kt; ++s) r[s] = static_cast<std::int32_t>(s);
      r[199] = 17;
      expect_same_error("duplicate in the last slot", c, d, idx, "duplicate token position 17 at [0, 0, 150, 199]");
    }
    {
      sa::HostTensor idx = d.idx;
      std::int32_t* r = row(idx, 20);
      for (std::int64_t s = 0; s < c.kt; ++s) r[s] = static_cast<std::int32_t>(1499 - s);
      r[180] = r[130];
      row(idx, 21)[3] = 1500;
      expect_same_error("duplicate past slot 128", c, d, idx, "duplicate token position 1369 at [0, 0, 20, 180]");
    }
    {
      sa::HostTensor idx = d.idx;
      row(idx, 199)[160] = -2;
      expect_same_error("value -2 past slot 128", c, d, idx,
                        "invalid value -2 at [0, 0, 199, 160] (only -1 may mark an empty slot)");
    }
    const st::Reference ref = reference_of(d);
    const Result checked = run_gpu(c, d), trusted = run_gpu(c, d, /*trusted=*/true);
    check_result(c, ref, checked);
    EXPECT_TRUE(same_bits(checked.out, trusted.out) && same_bits(checked.lse, trusted.lse)) << "trusted run differs";
  }
}

// Small enough for compute-sanitizer (memcheck, racecheck, synccheck): checked then trusted against the
// reference, both head dims and dtypes, causal with B = 2 and Hkv = 2; then one faulty list.
TEST(TokenSparseGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::vector<Case> cases = {
      {"small B=2 G2 Hkv=2 Kt=40 causal", sa::DType::bf16, 2, 200, 300, 4, 2, 128, true, 40},
      {"small G8 Kt=33 D=64 f16", sa::DType::f16, 1, 150, 200, 8, 1, 64, false, 33},
  };
  std::uint64_t seed = 5000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const CaseData d = make_case(c, seed += 10);
    const st::Reference ref = reference_of(d);
    const Result checked = run_gpu(c, d), trusted = run_gpu(c, d, /*trusted=*/true);
    check_result(c, ref, checked);
    check_result(c, ref, trusted);
    EXPECT_TRUE(same_bits(checked.out, trusted.out) && same_bits(checked.lse, trusted.lse)) << "trusted run differs";
  }
  const Case& c = cases[0];
  const CaseData d = make_case(c, 5100);
  sa::HostTensor idx = d.idx;
  idx.data<std::int32_t>()[(((1 * c.Hkv) + 1) * c.Lq + 77) * c.kt + 39] = 300;
  expect_same_error("small position = Lk", c, d, idx, "token position 300 at [1, 1, 77, 39] is out of range [0, 300)");
}
