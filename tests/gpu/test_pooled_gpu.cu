// GPU tests of the pooled R1 / R4 selector (src/cuda/selectors/pooled.cu) against its contract
// (docs/design.md §5.7): every list is a top-k of the CPU's float64 block scores up to the bound the
// kernel derives (cuda_backend::pooled_error_bound), forced blocks and causal candidates exactly as on
// the CPU, and two runs give the same bits. The exact scores and the bound per list are computed here
// from the inputs the way src/selectors/pooled.cpp computes its scores (float32 means of float64 sums,
// float64 dots). Cases:
// - random inputs over awkward shapes: Lq = 1, 17, 1013, Lk not a multiple of 128, GQA 1 to 32, B > 1,
//   r = 1 and 4, every forcing, causal and not, f32 / f16 / bf16, D from 30 to 264, strided and
//   misaligned views (the scalar load path), one and several chunks (CTAs) per tile, several slabs per
//   chunk and several query rounds;
// - planted near-ties: copies of a strong block scaled or nudged so that exact scores differ by less
//   than the bound and by more, and exact copies (ties to the lower id);
// - all-equal inputs (every score ties: the CPU's lists exactly), huge and tiny magnitudes, non-finite
//   inputs (the device rule: pairs with a non-finite mean are ignored);
// - that the bound is not vacuous (small against the score gaps at the top-k cut on random inputs) and
//   that few lists differ from the CPU's;
// - the scratch cached per (device, stream) and graph capture (the same bits as a plain call).
// Device outputs are poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/selector_contract.hpp"
#include "common/testing.hpp"
#include "cuda/selectors/backend.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/dtype.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::cuda_ok;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A [B, L, H, D] tensor stored inside a larger host buffer: rows of D + pad elements, starting `shift`
// elements in (shift or pad that break 16-byte alignment select the device's scalar load path).
struct Input {
  sa::DType dtype = sa::DType::bf16;
  std::int64_t B = 1, L = 1, H = 1, D = 1, pad = 0, shift = 0;
  sa::HostTensor buf;  // 1-d storage
  std::int64_t row() const { return D + pad; }
  std::int64_t index(std::int64_t b, std::int64_t l, std::int64_t h, std::int64_t d) const {
    return shift + ((b * L + l) * H + h) * row() + d;
  }
  sa::TensorView view_at(void* base, sa::Device dev) const {
    sa::TensorView v = sa::TensorView::contiguous(static_cast<char*>(base) + shift * sa::dtype_size(dtype), dtype,
                                                  {B, L, H, D}, dev, 0);
    v.stride[0] = L * H * row(), v.stride[1] = H * row(), v.stride[2] = row(), v.stride[3] = 1;
    return v;
  }
  float get(std::int64_t i) const {
    if (dtype == sa::DType::f32) return buf.data<float>()[i];
    const std::uint16_t h = buf.data<std::uint16_t>()[i];
    return dtype == sa::DType::bf16 ? sa::bf16_to_float(h) : sa::f16_to_float(h);
  }
  void set(std::int64_t i, float f) {
    if (dtype == sa::DType::f32) buf.data<float>()[i] = f;
    else buf.data<std::uint16_t>()[i] = dtype == sa::DType::bf16 ? sa::float_to_bf16(f) : sa::float_to_f16(f);
  }
  // The neighbouring representable value (one unit in the last place, away from zero when up).
  void nudge(std::int64_t i, bool up) {
    if (dtype == sa::DType::f32) {
      float& f = buf.data<float>()[i];
      f = std::nextafter(f, up ? (f < 0 ? -INFINITY : INFINITY) : 0.0f);
    } else {
      std::uint16_t& h = buf.data<std::uint16_t>()[i];
      h = static_cast<std::uint16_t>(up ? h + 1 : h - 1);  // magnitude bits; values here are normal and nonzero
    }
  }
};

Input make_input(sa::DType dtype, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t D, std::uint64_t seed,
                 std::int64_t pad = 0, std::int64_t shift = 0, float stddev = 1.0f) {
  Input x;
  x.dtype = dtype, x.B = B, x.L = L, x.H = H, x.D = D, x.pad = pad, x.shift = shift;
  x.buf = st::random_tensor(dtype, {shift + B * L * H * (D + pad)}, seed, stddev);
  return x;
}

// Copies tokens [sl, sl + n) of (b, sh) in src, times `factor`, onto tokens [dl, dl + n) of (b, dh) in dst.
void copy_tokens(Input& dst, std::int64_t b, std::int64_t dl, std::int64_t dh, const Input& src, std::int64_t sl,
                 std::int64_t sh, std::int64_t n, float factor = 1.0f) {
  for (std::int64_t i = 0; i < n && dl + i < dst.L && sl + i < src.L; ++i)
    for (std::int64_t d = 0; d < dst.D; ++d)
      dst.set(dst.index(b, dl + i, dh, d), src.get(src.index(b, sl + i, sh, d)) * factor);
}

struct Options {
  int r = 1, top_k = 4, kmax = 4;
  bool causal = false, force_local = true, force_block0 = false;
};

sa::PooledOptions pooled_options(const Options& opt) {
  sa::PooledOptions o;
  o.representatives = opt.r, o.top_k = opt.top_k, o.causal = opt.causal, o.force_local = opt.force_local,
  o.force_block0 = opt.force_block0;
  return o;
}

// ---- the contract's exact scores and bound, on the host -------------------------------------------------

// Per representative (b, h, tile, a): the CPU's float32 mean (as pooled.cpp: a float64 sum over the tokens
// in order, divided, rounded to float) and the mean of |x|, D values each as doubles; the token count.
struct HostReps {
  std::int64_t H = 0, T = 0, r = 1, D = 0;
  std::vector<double> mean, amean;
  std::vector<std::int32_t> count;
  std::vector<char> finite;  // every column of the mean is finite
  std::int64_t slot(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t a) const {
    return ((b * H + h) * T + t) * r + a;
  }
};

HostReps host_reps(const Input& x, int r) {
  HostReps p;
  p.H = x.H, p.T = sa::ceil_div(x.L, sa::kTileQ), p.r = r, p.D = x.D;
  const std::int64_t n_slots = x.B * x.H * p.T * r, span = sa::kTileQ / r;
  p.mean.assign(static_cast<std::size_t>(n_slots * x.D), 0.0);
  p.amean.assign(p.mean.size(), 0.0);
  p.count.assign(static_cast<std::size_t>(n_slots), 0);
  p.finite.assign(static_cast<std::size_t>(n_slots), 1);
  for (std::int64_t b = 0; b < x.B; ++b)
    for (std::int64_t h = 0; h < x.H; ++h)
      for (std::int64_t t = 0; t < p.T; ++t)
        for (std::int64_t a = 0; a < r; ++a) {
          const std::int64_t l0 = t * sa::kTileQ + a * span, l1 = std::min(x.L, l0 + span), s = p.slot(b, h, t, a);
          if (l1 <= l0) continue;
          const double n = static_cast<double>(l1 - l0);
          p.count[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(l1 - l0);
          for (std::int64_t d = 0; d < x.D; ++d) {
            double sum = 0.0, asum = 0.0;
            for (std::int64_t l = l0; l < l1; ++l) {
              const double v = x.get(x.index(b, l, h, d));
              sum += v;
              asum += std::abs(v);
            }
            const double m = static_cast<float>(sum / n);
            p.mean[static_cast<std::size_t>(s * x.D + d)] = m;
            p.amean[static_cast<std::size_t>(s * x.D + d)] = asum / n;
            if (!std::isfinite(m)) p.finite[static_cast<std::size_t>(s)] = 0;
          }
        }
  return p;
}

// Exact block scores of every list (row (b * Hkv + g) * Tq + t, candidates = blocks) and the contract's
// bound per list: twice the largest pair bound over the list's scored candidates. Forced blocks +inf,
// non-candidates -inf. A pair with a non-finite mean is ignored, as on the device (the CPU's own rule
// differs there; finite inputs have none); a candidate left without pairs scores -1e300 (the device's
// -inf, still a candidate).
struct Contract {
  st::ExactScores exact;
  std::vector<double> eps;
};

Contract pooled_contract(const Input& q, const Input& k, const Options& opt) {
  const int r = opt.r;
  const HostReps qr = host_reps(q, r), kr = host_reps(k, r);
  const std::int64_t B = q.B, Lq = q.L, Lk = k.L, D = q.D, Hkv = k.H, group = q.H / k.H;
  const std::int64_t Tq = qr.T, Tk = kr.T, span = sa::kTileQ / r, offset = Lk - Lq;
  const sa::cuda_backend::PooledErrorBound bound = sa::cuda_backend::pooled_error_bound(D, r);
  Contract c;
  c.exact.rows = B * Hkv * Tq, c.exact.candidates = Tk;
  c.exact.score.assign(static_cast<std::size_t>(c.exact.rows * Tk), -kInf);
  c.eps.assign(static_cast<std::size_t>(c.exact.rows), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < Hkv; ++g)
      for (std::int64_t t = 0; t < Tq; ++t) {
        const std::int64_t row = (b * Hkv + g) * Tq + t;
        const std::int64_t i_first = t * sa::kTileQ, i_last = std::min(Lq, i_first + sa::kTileQ) - 1;
        const std::int64_t n_cand =
            opt.causal ? std::clamp<std::int64_t>(sa::ceil_div(i_last + offset + 1, sa::kBlockK), 0, Tk) : Tk;
        std::vector<char> forced(static_cast<std::size_t>(Tk), 0);
        if (n_cand > 0) {
          if (opt.force_block0) forced[0] = 1;
          if (opt.force_local) {
            if (opt.causal) {
              for (std::int64_t j = std::max<std::int64_t>(i_first + offset, 0) / sa::kBlockK;
                   j <= (i_last + offset) / sa::kBlockK; ++j)
                forced[static_cast<std::size_t>(j)] = 1;
            } else {
              forced[static_cast<std::size_t>(std::min(i_first * Lk / Lq / sa::kBlockK, Tk - 1))] = 1;
            }
          }
        }
        double emax = 0.0;
        for (std::int64_t j = 0; j < n_cand; ++j) {
          if (forced[static_cast<std::size_t>(j)]) {
            c.exact.at(row, j) = kInf;
            continue;
          }
          double best = -kInf, e = 0.0;
          for (std::int64_t a = 0; a < r; ++a) {
            const std::int32_t qn = qr.count[static_cast<std::size_t>(qr.slot(b, g * group, t, a))];
            if (qn == 0) continue;
            const std::int64_t q_last = i_first + a * span + qn - 1;
            for (std::int64_t cg = 0; cg < r; ++cg) {
              const std::int64_t ks = kr.slot(b, g, j, cg);
              if (kr.count[static_cast<std::size_t>(ks)] == 0) continue;
              if (opt.causal && j * sa::kBlockK + cg * span > q_last + offset) continue;
              for (std::int64_t h = 0; h < group; ++h) {
                const std::int64_t qs = qr.slot(b, g * group + h, t, a);
                if (!qr.finite[static_cast<std::size_t>(qs)] || !kr.finite[static_cast<std::size_t>(ks)]) continue;
                const double* cq = qr.mean.data() + qs * D;
                const double* ck = kr.mean.data() + ks * D;
                double s = 0.0;
                for (std::int64_t d = 0; d < D; ++d) s += cq[d] * ck[d];
                best = std::max(best, s);
                e = std::max(e, bound.pair(cq, qr.amean.data() + qs * D, ck, kr.amean.data() + ks * D, D));
              }
            }
          }
          c.exact.at(row, j) = best > -kInf ? best : -1e300;
          emax = std::max(emax, e);
        }
        c.eps[static_cast<std::size_t>(row)] = 2.0 * emax;
      }
  return c;
}

// ---- device calls ------------------------------------------------------------------------------------------

struct DevCopy {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DevCopy(const sa::HostTensor& h) : bytes(static_cast<std::size_t>(h.numel()) * sa::dtype_size(h.dtype())) {
    cuda_ok(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
    cuda_ok(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), "upload");
  }
  DevCopy(const DevCopy&) = delete;
  DevCopy& operator=(const DevCopy&) = delete;
  ~DevCopy() {
    if (ptr) cudaFree(ptr);
  }
  void download(sa::HostTensor& h) const {
    cuda_ok(cudaMemcpy(h.view().data, ptr, bytes, cudaMemcpyDeviceToHost), "download");
  }
};

// Poisoned device lists [B, Hkv, Tq, kmax] and counts for one call; launch() queues the public selector
// on o.stream, fetch() downloads (after the caller's synchronisation).
struct GpuCall {
  sa::HostTensor idx, cnt;
  std::unique_ptr<DevCopy> didx, dcnt;
  GpuCall(const Input& q, const Input& k, int kmax) {
    const std::int64_t Tq = sa::ceil_div(q.L, sa::kTileQ);
    idx = st::poisoned_i32({q.B, k.H, Tq, kmax});
    cnt = st::poisoned_i32({q.B, k.H, Tq});
    didx = std::make_unique<DevCopy>(idx);
    dcnt = std::make_unique<DevCopy>(cnt);
  }
  void launch(const Input& q, const Input& k, const DevCopy& dq, const DevCopy& dk, const sa::PooledOptions& o) {
    const sa::TileLists out{sa::TensorView::contiguous(didx->ptr, sa::DType::i32, idx.shape(), sa::Device::cuda, 0),
                            sa::TensorView::contiguous(dcnt->ptr, sa::DType::i32, cnt.shape(), sa::Device::cuda, 0)};
    sa::pooled_select(q.view_at(dq.ptr, sa::Device::cuda), k.view_at(dk.ptr, sa::Device::cuda), out, o);
  }
  void fetch() {
    didx->download(idx);
    dcnt->download(cnt);
  }
};

bool same_bits(const sa::HostTensor& a, const sa::HostTensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.view().data, b.view().data,
                                               static_cast<std::size_t>(a.numel()) * sa::dtype_size(a.dtype())) == 0;
}

// Checks a call's lists (fetched) against the contract.
st::ContractReport check_lists(const std::string& name, const GpuCall& call, const Contract& c, const Options& opt) {
  return st::expect_top_k_within(
      c.exact, call.idx.data<std::int32_t>(), opt.kmax, opt.kmax, call.cnt.data<std::int32_t>(), opt.top_k,
      [&](std::int64_t row) { return c.eps[static_cast<std::size_t>(row)]; }, name);
}

// Two calls of the public selector on the same inputs: both meet the contract and give the same bits.
st::ContractReport expect_contract(const std::string& name, const Input& q, const Input& k, const Options& opt,
                                   const Contract* given = nullptr) {
  SCOPED_TRACE(name);
  DevCopy dq(q.buf), dk(k.buf);
  GpuCall first(q, k, opt.kmax), second(q, k, opt.kmax);
  const sa::PooledOptions o = pooled_options(opt);
  first.launch(q, k, dq, dk, o);
  second.launch(q, k, dq, dk, o);
  cuda_ok(cudaDeviceSynchronize(), "pooled_select");
  first.fetch();
  second.fetch();
  EXPECT_TRUE(same_bits(first.idx, second.idx) && same_bits(first.cnt, second.cnt)) << name << ": two runs differ";
  const Contract own = given != nullptr ? Contract{} : pooled_contract(q, k, opt);
  return check_lists(name, first, given != nullptr ? *given : own, opt);
}

// ---- the checker's inputs on the host (no GPU needed) --------------------------------------------------------

// The CPU selector's own lists meet the contract with eps = 0 and are the float64 top-k: the host
// scores above are the CPU's.
TEST(PooledContract, CpuListsAreTheExactTopK) {
  std::uint64_t seed = 3000;
  for (int r : {1, 4}) {
    for (bool causal : {false, true}) {
      const Input q = make_input(sa::DType::bf16, 2, 1013, 4, 64, seed++),
                  k = make_input(sa::DType::bf16, 2, 1500, 2, 64, seed++);
      const Options opt{r, 5, 6, causal, true, true};
      sa::HostTensor idx(sa::DType::i32, {2, 2, 8, 6}), cnt(sa::DType::i32, {2, 2, 8});
      sa::pooled_select(q.view_at(q.buf.view().data, sa::Device::cpu), k.view_at(k.buf.view().data, sa::Device::cpu),
                        sa::TileLists{idx.view(), cnt.view()}, pooled_options(opt));
      const Contract c = pooled_contract(q, k, opt);
      const st::ContractReport rep = st::expect_top_k_within(
          c.exact, idx.data<std::int32_t>(), 6, 6, cnt.data<std::int32_t>(), opt.top_k,
          [](std::int64_t) { return 0.0; }, "CPU lists");
      EXPECT_EQ(rep.rows_checked, 32);
      EXPECT_EQ(rep.rows_differing, 0) << "R" << r << (causal ? " causal" : "");
      for (double e : c.eps) EXPECT_GT(e, 0.0);
    }
  }
}

// The bound is not vacuous: on random inputs at the tile16 shape (Lk = 8K) it is below the gap between
// the k-th and the (k+1)-th exact score in most lists (about 97 % of them for either r).
TEST(PooledContract, BoundIsSmallAgainstTheScoreGaps) {
  for (int r : {1, 4}) {
    const Input q = make_input(sa::DType::bf16, 2, 4096, 16, 128, 3100 + r),
                k = make_input(sa::DType::bf16, 2, 8192, 1, 128, 3200 + r);
    const Options opt{r, 16, 16, false, true, false};
    const Contract c = pooled_contract(q, k, opt);
    std::int64_t small = 0;
    for (std::int64_t row = 0; row < c.exact.rows; ++row) {
      std::vector<double> s(c.exact.score.begin() + row * c.exact.candidates,
                            c.exact.score.begin() + (row + 1) * c.exact.candidates);
      std::sort(s.begin(), s.end(), std::greater<>());
      small += c.eps[static_cast<std::size_t>(row)] < s[opt.top_k - 1] - s[opt.top_k] ? 1 : 0;
    }
    EXPECT_GE(small, c.exact.rows * 3 / 4) << "R" << r << ": the bound is below the top-k gap in " << small << " of "
                                           << c.exact.rows << " lists";
  }
}

// ---- device ---------------------------------------------------------------------------------------------------

TEST(PooledGpu, RandomShapesMeetContract) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const auto bf16 = sa::DType::bf16, f16 = sa::DType::f16, f32 = sa::DType::f32;
  std::uint64_t seed = 1000;
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    auto run = [&](const std::string& name, sa::DType dt, std::int64_t B, std::int64_t Lq, std::int64_t Hq,
                   std::int64_t Lk, std::int64_t Hkv, std::int64_t D, Options opt, std::int64_t pad = 0,
                   std::int64_t shift = 0) {
      opt.r = r;
      const Input q = make_input(dt, B, Lq, Hq, D, seed++, pad, shift),
                  k = make_input(dt, B, Lk, Hkv, D, seed++, pad, shift);
      expect_contract(R + name, q, k, opt);
    };
    for (bool causal : {false, true}) {
      const std::string c = causal ? " causal" : "";
      run("GQA16 Lq=1000 Lk=3000" + c, bf16, 2, 1000, 16, 3000, 1, 128, {r, 5, 7, causal, true, true});
      run("Lq=1" + c, bf16, 1, 1, 1, 300, 1, 128, {r, 3, 4, causal, true, false});
      run("Lq=17 GQA16" + c, bf16, 1, 17, 16, 1000, 1, 128, {r, 4, 6, causal, true, false});
      run("Lq=1013 B=2 GQA2 block0" + c, bf16, 2, 1013, 4, 1013, 2, 128, {r, 5, 5, causal, true, true});
      run("Lq>Lk" + c, f16, 2, 900, 2, 300, 1, 64, {r, 2, 2, causal, true, true});
      run("one tile, long Lk (several chunks per tile)" + c, bf16, 1, 128, 2, 1100 * 128 - 3, 1, 64,
          {r, 8, 8, causal, true, true});
    }
    run("Hq=Hkv=4 B=3 no forcing", bf16, 3, 333, 4, 1290, 4, 128, {r, 3, 3, false, false, false});
    run("Lq<Lk causal", bf16, 2, 300, 16, 2000, 1, 128, {r, 4, 7, true, true, false});
    run("top_k above the candidates, f16 D=64", f16, 1, 260, 2, 390, 1, 64, {r, 16, 16, true, true, true});
    run("f32 D=80 GQA2", f32, 2, 260, 6, 650, 3, 80, {r, 9, 9, true, true, true});
    run("f32 D=200 (32 query and key rows staged)", f32, 1, 140, 2, 1100, 1, 200, {r, 4, 5, false, true, false});
    run("D=30", bf16, 1, 300, 4, 777, 2, 30, {r, 3, 3, true, true, false});
    run("misaligned padded views", bf16, 2, 257, 4, 900, 1, 128, {r, 4, 4, false, true, true}, 3, 1);
    run("strided views (packed qkv)", f16, 1, 200, 2, 640, 2, 64, {r, 2, 3, true, false, true}, 64, 0);
    run("bf16 D=256", bf16, 1, 260, 8, 1400, 2, 256, {r, 4, 4, true, true, false});
    run("f16 D=96", f16, 2, 140, 4, 1000, 4, 96, {r, 3, 4, true, false, false});
    run("bf16 D=264 (16 rows staged)", bf16, 1, 129, 2, 700, 1, 264, {r, 2, 3, false, true, false});
    run("GQA32 (several query rounds)", bf16, 1, 300, 32, 1500, 1, 64, {r, 4, 4, true, true, false});
    run("GQA24", bf16, 2, 129, 24, 2000, 1, 64, {r, 6, 6, false, true, true});
    run("top_k 200 of 300 blocks", bf16, 1, 256, 2, 300 * 128, 1, 64, {r, 200, 210, false, true, true});
  }
}

// Many tiles per call and several slabs of 128 key rows per CTA.
TEST(PooledGpu, ManyTilesSeveralKeyPasses) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const Input q = make_input(sa::DType::bf16, 1, 600 * 128 - 50, 2, 32, 51 + r);
    const Input k = make_input(sa::DType::bf16, 1, 40 * 128 - 7, 2, 32, 61 + r);
    expect_contract("R" + std::to_string(r) + " 1200 tiles, 40 blocks", q, k, {r, 6, 6, false, true, false});
    const Input kl = make_input(sa::DType::bf16, 1, 600 * 128, 2, 32, 71 + r);
    expect_contract("R" + std::to_string(r) + " 1200 tiles causal Lk=Lq+50", q, kl, {r, 6, 8, true, true, true});
  }
}

// Block `src` of every (b, kv head) takes the tokens of query tile `tile` of the group's first head (a
// strong match); each (block, factor) of `scaled` becomes src times the factor (rounded to the dtype;
// factor 1: an exact copy, a tie for the lower id); each block of `nudged` becomes src with one element
// moved by one unit in the last place. For R4 the key groups of src are nudged copies of its first.
void plant_twins(const Input& q, Input& k, std::int64_t group, std::int64_t src, std::int64_t tile,
                 const std::vector<std::pair<std::int64_t, float>>& scaled, const std::vector<std::int64_t>& nudged,
                 int r, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::int64_t span = sa::kBlockK / r, K = sa::kBlockK;
  for (std::int64_t b = 0; b < k.B; ++b) {
    for (std::int64_t h = 0; h < k.H; ++h) {
      copy_tokens(k, b, src * K, h, q, tile * sa::kTileQ, h * group, K);
      for (int c = 1; c < r; ++c) {
        copy_tokens(k, b, src * K + c * span, h, k, src * K, h, span);
        k.nudge(k.index(b, src * K + c * span + static_cast<std::int64_t>(rng() % span), h,
                        static_cast<std::int64_t>(rng() % k.D)),
                c % 2 == 1);
      }
      for (const auto& [j, factor] : scaled) copy_tokens(k, b, j * K, h, k, src * K, h, K, factor);
      for (std::size_t i = 0; i < nudged.size(); ++i) {
        copy_tokens(k, b, nudged[i] * K, h, k, src * K, h, K);
        k.nudge(
            k.index(b, nudged[i] * K + static_cast<std::int64_t>(rng() % K), h, static_cast<std::int64_t>(rng() % k.D)),
            i % 2 == 0);
      }
    }
  }
}

// Near-ties at the top-k cut: copies of a strong block whose exact scores differ from it by less than the
// bound (nudged, scaled by 1 +- 2^-20, exact copies) and by more (scaled by 1 +- 2^-6 and more); the
// contract must hold, and both kinds must be present among the lists' candidates.
TEST(PooledGpu, NearTiesMeetContract) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 2000;
  for (auto dtype : {sa::DType::bf16, sa::DType::f32, sa::DType::f16}) {
    for (int r : {1, 4}) {
      for (bool causal : {false, true}) {
        const std::string name =
            std::string(sa::dtype_name(dtype)) + " R" + std::to_string(r) + (causal ? " causal" : "");
        Input q = make_input(dtype, 2, 512, 16, 128, seed++);
        Input k = make_input(dtype, 2, 24 * 128 - 40, 1, 128, seed++);
        const std::vector<std::pair<std::int64_t, float>> scaled = {
            {3, 1.0f}, {5, 1.0f + 0x1p-20f}, {6, 1.0f - 0x1p-20f}, {8, 1.0f + 0x1p-6f}, {9, 1.0f - 0x1p-6f},
            {11, 1.0f + 0x1p-4f}, {13, 1.0f - 0x1p-4f}, {14, 1.0f + 0x1p-12f}};
        const std::vector<std::int64_t> nudged = {17, 19, 20, 22};
        plant_twins(q, k, 16, 2, 1, scaled, nudged, r, seed++);
        for (const Options& opt : {Options{r, 5, 5, causal, false, false}, Options{r, 7, 8, causal, true, true}}) {
          const Contract c = pooled_contract(q, k, opt);
          expect_contract(name + (opt.force_local ? " forced" : ""), q, k, opt, &c);
          // Twins closer to src than the list's bound, and farther.
          int below = 0, above = 0;
          for (std::int64_t row = 0; row < c.exact.rows; ++row) {
            const double s0 = c.exact.at(row, 2), e = c.eps[static_cast<std::size_t>(row)];
            if (!std::isfinite(s0)) continue;
            for (std::int64_t j = 3; j < 23; ++j) {
              const double s = c.exact.at(row, j);
              if (!std::isfinite(s)) continue;
              below += std::abs(s - s0) < e ? 1 : 0;
              above += std::abs(s - s0) > e ? 1 : 0;
            }
          }
          EXPECT_GT(below, 0) << name;
          EXPECT_GT(above, 0) << name;
        }
      }
    }
  }
}

// Every query and every key equal: every score ties, on the device too (equal means, equal dots), so the
// lists are the CPU's exactly (the lower ids).
TEST(PooledGpu, AllEqualInputsTieToLowerIds) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    for (std::int64_t Lk : {4096, 300 * 128}) {  // 32 blocks (ranked by counting), 300 (by the radix select)
      Input q = make_input(sa::DType::bf16, 1, 1024, 16, 128, 31), k = make_input(sa::DType::bf16, 1, Lk, 1, 128, 32);
      for (std::int64_t i = 0; i < q.buf.numel(); ++i) q.set(i, 0.5f);
      for (std::int64_t i = 0; i < k.buf.numel(); ++i) k.set(i, -0.25f);
      for (const Options& opt : {Options{r, 5, 6, false, true, false}, Options{r, 5, 6, true, false, true}}) {
        const std::string name =
            "R" + std::to_string(r) + " Lk " + std::to_string(Lk) + " all equal" + (opt.causal ? " causal" : "");
        expect_contract(name, q, k, opt);
        DevCopy dq(q.buf), dk(k.buf);
        GpuCall call(q, k, opt.kmax);
        call.launch(q, k, dq, dk, pooled_options(opt));
        cuda_ok(cudaDeviceSynchronize(), "pooled_select");
        call.fetch();
        sa::HostTensor idx(sa::DType::i32, call.idx.shape()), cnt(sa::DType::i32, call.cnt.shape());
        sa::pooled_select(q.view_at(q.buf.view().data, sa::Device::cpu),
                          k.view_at(k.buf.view().data, sa::Device::cpu), sa::TileLists{idx.view(), cnt.view()},
                          pooled_options(opt));
        st::expect_equal_i32(call.idx, idx, name + " idx");
        st::expect_equal_i32(call.cnt, cnt, name + " cnt");
      }
    }
  }
}

// Inputs scaled by 1e4 and 1e12 (bf16) and by 1e-18 (f32: products near float32's underflow, where the
// bound's absolute term takes over).
TEST(PooledGpu, HugeAndTinyMagnitudes) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4000;
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    for (float scale : {1e4f, 1e12f}) {
      Input q = make_input(sa::DType::bf16, 2, 500, 8, 128, seed++, 0, 0, scale);
      Input k = make_input(sa::DType::bf16, 2, 3000, 1, 128, seed++, 0, 0, scale);
      plant_twins(q, k, 8, 4, 1, {{6, 1.0f}, {9, 1.0f + 0x1p-6f}}, {11, 12}, r, seed++);
      expect_contract(R + "bf16 x" + std::to_string(scale), q, k, {r, 4, 4, false, true, false});
      expect_contract(R + "bf16 x" + std::to_string(scale) + " causal", q, k, {r, 4, 5, true, true, true});
    }
    const Input qt = make_input(sa::DType::f32, 1, 300, 2, 128, seed++, 0, 0, 1e-18f);
    const Input kt = make_input(sa::DType::f32, 1, 1500, 1, 128, seed++, 0, 0, 1e-18f);
    expect_contract(R + "tiny f32", qt, kt, {r, 4, 4, true, true, false});
  }
}

// NaN and infinities: a pair with a non-finite mean is ignored on the device (NaN ranks as -inf), the
// rest of the lists meet the contract over the finite pairs.
TEST(PooledGpu, NonFiniteInputs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    Input q = make_input(sa::DType::bf16, 2, 500, 4, 64, 41), k = make_input(sa::DType::bf16, 2, 2000, 2, 64, 42);
    q.set(q.index(0, 5, 1, 3), NAN);           // tile 0 of head 1
    k.set(k.index(0, 300, 0, 7), INFINITY);    // block 2
    k.set(k.index(1, 1000, 1, 9), -INFINITY);  // block 7
    k.set(k.index(1, 1001, 1, 9), INFINITY);   // block 7 again: inf - inf = NaN in its mean
    q.set(q.index(1, 260, 2, 0), INFINITY);    // tile 2 of head 2
    for (std::int64_t l = 0; l < 128; ++l) k.set(k.index(1, 1280 + l, 0, 0), NAN);  // every pair of block 10
    expect_contract(R + "NaN / inf", q, k, {r, 6, 6, false, true, false});
    expect_contract(R + "NaN / inf causal", q, k, {r, 6, 6, true, false, true});
  }
}

// Few lists differ from the CPU's on random inputs at the tile16 shape (Lk = 8K): the bound covers what
// rounding could do, the actual errors are far smaller.
TEST(PooledGpu, FewListsDifferFromCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const Input q = make_input(sa::DType::bf16, 2, 4096, 16, 128, 3100 + r),
                k = make_input(sa::DType::bf16, 2, 8192, 1, 128, 3200 + r);
    const st::ContractReport rep =
        expect_contract("R" + std::to_string(r) + " tile16 Lk=8K", q, k, {r, 16, 16, false, true, false});
    EXPECT_LE(rep.rows_differing, rep.rows_checked / 10) << "R" << r;
  }
}

// The scratch is cached per (device, stream): calls queued back to back on one stream with growing and
// shrinking shapes (the growth waits for the earlier calls), and calls on two streams at once, each give
// the same bits as a call alone and meet the contract.
TEST(PooledGpu, ScratchAcrossShapesAndStreams) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  cudaStream_t s1 = nullptr, s2 = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_ok(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "cudaStreamCreate");
  const Input qa = make_input(sa::DType::bf16, 1, 300, 4, 64, 301),
              ka = make_input(sa::DType::bf16, 1, 700, 1, 64, 302);
  const Input qb = make_input(sa::DType::bf16, 2, 900, 8, 128, 303),
              kb = make_input(sa::DType::bf16, 2, 9000, 2, 128, 304);
  const Input qc = make_input(sa::DType::f16, 1, 200, 2, 64, 305), kc = make_input(sa::DType::f16, 1, 500, 2, 64, 306);
  DevCopy dqa(qa.buf), dka(ka.buf), dqb(qb.buf), dkb(kb.buf), dqc(qc.buf), dkc(kc.buf);
  for (int r : {1, 4}) {
    const Options opt{r, 4, 4, false, true, false};
    sa::PooledOptions o = pooled_options(opt);
    const std::string R = "R" + std::to_string(r) + " ";
    // Alone, on the legacy stream.
    GpuCall ra(qa, ka, 4), rb(qb, kb, 4), rc(qc, kc, 4);
    ra.launch(qa, ka, dqa, dka, o), rb.launch(qb, kb, dqb, dkb, o), rc.launch(qc, kc, dqc, dkc, o);
    cuda_ok(cudaDeviceSynchronize(), "reference calls");
    ra.fetch(), rb.fetch(), rc.fetch();
    check_lists(R + "small", ra, pooled_contract(qa, ka, opt), opt);
    check_lists(R + "large", rb, pooled_contract(qb, kb, opt), opt);
    check_lists(R + "small f16", rc, pooled_contract(qc, kc, opt), opt);
    o.stream = s1;
    GpuCall a(qa, ka, 4), b(qb, kb, 4), c(qc, kc, 4);
    a.launch(qa, ka, dqa, dka, o), b.launch(qb, kb, dqb, dkb, o), c.launch(qc, kc, dqc, dkc, o);
    o.stream = s2;
    GpuCall b2(qb, kb, 4), a2(qa, ka, 4);
    b2.launch(qb, kb, dqb, dkb, o), a2.launch(qa, ka, dqa, dka, o);
    cuda_ok(cudaDeviceSynchronize(), "queued calls");
    for (GpuCall* g : {&a, &b, &c, &b2, &a2}) g->fetch();
    const std::pair<const GpuCall*, const GpuCall*> same[] = {{&a, &ra}, {&b, &rb}, {&c, &rc}, {&b2, &rb}, {&a2, &ra}};
    const char* names[] = {"small on s1", "large on s1 (growth)", "small again on s1", "large on s2", "small on s2"};
    for (int i = 0; i < 5; ++i)
      EXPECT_TRUE(same_bits(same[i].first->idx, same[i].second->idx) &&
                  same_bits(same[i].first->cnt, same[i].second->cnt))
          << R << names[i];
  }
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

// Captured into a CUDA graph (the call takes stream-ordered memory inside the capture, so the graph owns its
// scratch) on a stream without cached scratch and on one with it; replayed twice, the second time after a
// larger call on the same stream has grown (freed and replaced) the stream's cached scratch. Each replay
// gives the bits of a plain call.
TEST(PooledGpu, GraphCapture) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Input q = make_input(sa::DType::bf16, 2, 500, 8, 128, 401),
              k = make_input(sa::DType::bf16, 2, 3000, 2, 128, 402);
  const Input qbig = make_input(sa::DType::bf16, 2, 2000, 8, 128, 403),
              kbig = make_input(sa::DType::bf16, 2, 12000, 2, 128, 404);
  DevCopy dq(q.buf), dk(k.buf), dqbig(qbig.buf), dkbig(kbig.buf);
  for (int round = 0; round < 2; ++round) {
    const Options opt{round == 0 ? 4 : 1, 5, 5, false, true, false};
    GpuCall plain(q, k, 5);
    plain.launch(q, k, dq, dk, pooled_options(opt));
    cuda_ok(cudaDeviceSynchronize(), "plain call");
    plain.fetch();
    check_lists("plain call", plain, pooled_contract(q, k, opt), opt);
    cudaStream_t s = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    sa::PooledOptions o = pooled_options(opt);
    o.stream = s;
    if (round == 1) {  // the stream's scratch exists before the capture
      GpuCall warm(q, k, 5);
      warm.launch(q, k, dq, dk, o);
      cuda_ok(cudaStreamSynchronize(s), "warm call");
    }
    GpuCall call(q, k, 5);
    cudaGraph_t graph = nullptr;
    cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    call.launch(q, k, dq, dk, o);
    cuda_ok(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int rep = 0; rep < 2; ++rep) {
      cuda_ok(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
      cuda_ok(cudaStreamSynchronize(s), "graph");
      call.fetch();
      EXPECT_TRUE(same_bits(call.idx, plain.idx) && same_bits(call.cnt, plain.cnt))
          << (round == 0 ? "captured without scratch" : "captured with scratch") << ", replay " << rep;
      std::vector<std::int32_t> poison(static_cast<std::size_t>(call.idx.numel()), 0x5a5a5a5a);
      cuda_ok(cudaMemcpy(call.didx->ptr, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice), "re-poison");
      if (rep == 0) {  // grows the stream's cached scratch
        GpuCall big(qbig, kbig, 5);
        big.launch(qbig, kbig, dqbig, dkbig, o);
        cuda_ok(cudaStreamSynchronize(s), "larger call");
        big.fetch();
        check_lists("larger call after the capture", big, pooled_contract(qbig, kbig, opt), opt);
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// Small enough for compute-sanitizer (scripts/gpu_run.sh runs '*SanitizerSmall*'): both r, both load
// paths, several query rounds, several chunks per tile, near-ties, all-equal scores and empty causal slabs.
TEST(PooledGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    Input q = make_input(sa::DType::bf16, 2, 200, 4, 64, 81), k = make_input(sa::DType::bf16, 2, 700, 2, 64, 82);
    plant_twins(q, k, 2, 1, 0, {{2, 1.0f}, {3, 1.0f + 0x1p-6f}}, {4}, r, 83);
    expect_contract(R + "sanitizer near-ties", q, k, {r, 3, 4, true, true, true});
    const Input q2 = make_input(sa::DType::f16, 1, 130, 24, 36, 84, 2, 1),
                k2 = make_input(sa::DType::f16, 1, 390, 1, 36, 85);
    expect_contract(R + "sanitizer GQA24 scalar", q2, k2, {r, 2, 2, false, true, false});
    Input q3 = make_input(sa::DType::bf16, 1, 256, 16, 32, 86), k3 = make_input(sa::DType::bf16, 1, 1024, 1, 32, 87);
    for (std::int64_t i = 0; i < q3.buf.numel(); ++i) q3.set(i, 1.0f);
    for (std::int64_t i = 0; i < k3.buf.numel(); ++i) k3.set(i, 1.0f);
    expect_contract(R + "sanitizer all equal", q3, k3, {r, 3, 3, false, true, false});
    const Input q4 = make_input(sa::DType::bf16, 1, 9000, 2, 32, 88),
                k4 = make_input(sa::DType::bf16, 1, 9000, 1, 32, 89);
    expect_contract(R + "sanitizer causal, empty slabs", q4, k4, {r, 4, 4, true, true, false});
    const Input q5 = make_input(sa::DType::bf16, 1, 128, 2, 64, 90),
                k5 = make_input(sa::DType::bf16, 1, 300 * 128 - 5, 1, 64, 91);
    expect_contract(R + "sanitizer chunks", q5, k5, {r, 5, 6, false, true, true});
  }
}

}  // namespace
