// GPU tests of the Hopper Q-centric kernel behind dense and tile_sparse: every result against the
// float64 CPU reference with the selection applied as an explicit mask (docs/design.md §6), on awkward shapes,
// with poisoned outputs, both dtypes, causal and not, per-group and per-head lists, strided inputs,
// and the deferred validation of TileLists (faulty tiles, fault reports, CUDA graph capture).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.hpp"
#include "cuda/backend.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

void cuda_ok(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

// A device copy of a host tensor; the view keeps the host shape (dense strides) unless replaced.
struct DeviceTensor {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  sa::TensorView view;
  DeviceTensor() = default;
  explicit DeviceTensor(const sa::HostTensor& h) {
    bytes = static_cast<std::size_t>(h.numel()) * sa::dtype_size(h.dtype());
    cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc");
    cuda_ok(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), "upload");
    view = sa::TensorView::contiguous(ptr, h.dtype(), h.shape(), sa::Device::cuda, 0);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (ptr) cudaFree(ptr);
  }
  void download(sa::HostTensor& h) const {
    cuda_ok(cudaMemcpy(h.view().data, ptr, bytes, cudaMemcpyDeviceToHost), "download");
  }
};

struct Case {
  std::string name;
  sa::DType dtype = sa::DType::bf16;
  std::int64_t B = 1, Lq = 128, Lk = 128, Hq = 1, Hkv = 1;
  bool causal = false;
  bool dense = false;
  bool per_head = false;  // G = Hq instead of Hkv
  int kmax = 4;           // list capacity per tile
  float scale = 0.0f;     // 0: default 1 / sqrt(D)
  std::int64_t D = 128;
};

constexpr std::int64_t kD = 128;

// The backend entry points with a tuning, called with the arguments as the front end resolves them
// (detail::resolve_call; the selection's structure is not checked here). PublicOperatorsDispatchToCuda
// covers the public operators' whole path.
void gpu_dense(const sa::TensorView& q, const sa::TensorView& k, const sa::TensorView& v, const sa::TensorView& out,
               const std::optional<sa::TensorView>& lse = std::nullopt, const sa::AttentionOptions& opt = {},
               const sa::detail::AttentionTuning& tuning = {}) {
  sa::cuda_backend::dense(sa::detail::resolve_call("dense", q, k, v, out, lse, opt), tuning);
}

void gpu_tile_sparse(const sa::TensorView& q, const sa::TensorView& k, const sa::TensorView& v,
                     const sa::TileLists& tiles, const sa::TensorView& out,
                     const std::optional<sa::TensorView>& lse = std::nullopt, const sa::AttentionOptions& opt = {},
                     const sa::detail::AttentionTuning& tuning = {}) {
  sa::cuda_backend::tile_sparse(sa::detail::resolve_call("tile_sparse", q, k, v, out, lse, opt),
                                {tiles, tiles.idx.shape[1], tiles.idx.shape[3]}, tuning);
}

// At most `ctas` CTAs in the persistent grid (and the split tail as `split`).
sa::detail::AttentionTuning grid_of(int ctas, sa::detail::SplitTail split = sa::detail::SplitTail::automatic) {
  sa::detail::AttentionTuning t;
  t.max_ctas = ctas;
  t.split = split;
  return t;
}

// Random ascending distinct lists; every batch gets different lists and tile 1 (when present) of
// every (b, g) is left empty.
void make_lists(const Case& c, const sa::ProblemShape& p, std::uint64_t seed, sa::HostTensor& idx, sa::HostTensor& cnt) {
  const std::int64_t G = c.per_head ? p.Hq : p.Hkv;
  idx = sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq(), c.kmax});
  cnt = sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq()});
  std::mt19937_64 rng(seed);
  std::vector<int> all(static_cast<std::size_t>(p.Tk()));
  std::iota(all.begin(), all.end(), 0);
  auto* ip = idx.data<std::int32_t>();
  auto* cp = cnt.data<std::int32_t>();
  std::fill(ip, ip + idx.numel(), -1);
  for (std::int64_t row = 0; row < p.B * G * p.Tq(); ++row) {
    const std::int64_t t = row % p.Tq();
    const int cap = static_cast<int>(std::min<std::int64_t>(c.kmax, p.Tk()));
    int n = t == 1 ? 0 : 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(cap));
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int> pick(all.begin(), all.begin() + n);
    std::sort(pick.begin(), pick.end());
    cp[row] = n;
    for (int s = 0; s < n; ++s) ip[row * c.kmax + s] = pick[static_cast<std::size_t>(s)];
  }
}

struct Tolerance {
  double rel, max_abs_frac, lse_abs;
};

// A plain same-precision implementation lands near 3e-3 (bf16) / 4e-4 (f16) relative error: the P
// operand and the output are rounded to the 16-bit type. The bounds allow 2x that plus a small
// absolute term, and bound the worst element to a few units in the last place of the largest output.
Tolerance tolerance(sa::DType d) {
  if (d == sa::DType::bf16) return {2 * 3e-3 + 1e-4, 4 * std::ldexp(1.0, -8), 1e-3};
  return {2 * 4e-4 + 1e-5, 4 * std::ldexp(1.0, -11), 1e-3};
}

void check_against_reference(const Case& c, const sa::HostTensor& q, const sa::HostTensor& k, const sa::HostTensor& v,
                             const sa::Selection& sel, const sa::ProblemShape& p, const sa::HostTensor& out,
                             const sa::HostTensor& lse, double scale) {
  const st::Reference ref = st::reference_attention(q.view(), k.view(), v.view(), sel, p, scale);
  // Every case must exercise the kernel: at least one query sees at least one key.
  ASSERT_TRUE(std::any_of(ref.lse.begin(), ref.lse.end(), [](double x) { return std::isfinite(x); }))
      << c.name << ": degenerate case, no query sees any key";
  const Tolerance tol = tolerance(c.dtype);
  EXPECT_TRUE(st::all_finite(out)) << c.name << ": out holds NaN/inf (unwritten or broken)";
  const double rel = st::rel_err(out, ref.out);
  double ref_max = 1.0;
  for (double x : ref.out) ref_max = std::max(ref_max, std::abs(x));
  const double max_abs = st::max_abs_err(out, ref.out);
  const double lse_err = st::lse_max_err(lse, ref.lse);
  EXPECT_LE(rel, tol.rel) << c.name << ": relative error";
  EXPECT_LE(max_abs, tol.max_abs_frac * ref_max) << c.name << ": max element error (max |ref| " << ref_max << ")";
  EXPECT_LE(lse_err, tol.lse_abs) << c.name << ": lse error";
  // Queries that see nothing: exactly 0 and -inf.
  for (std::int64_t i = 0; i < lse.numel(); ++i)
    if (std::isinf(ref.lse[static_cast<std::size_t>(i)])) {
      ASSERT_TRUE(std::isinf(st::element(lse, i)) && st::element(lse, i) < 0) << c.name << ": lse[" << i << "]";
    }
  std::printf("[ %-34s ] relerr %.3e  max_abs %.3e  lse_err %.3e\n", c.name.c_str(), rel, max_abs, lse_err);
}

// A case's inputs: random q, k, v (and lists unless dense) from the seed.
struct CaseData {
  sa::ProblemShape p;
  sa::HostTensor q, k, v, idx, cnt;
  sa::AttentionOptions opt;
  double scale = 0.0;
};

CaseData make_case(const Case& c, std::uint64_t seed) {
  CaseData d;
  d.p.B = c.B, d.p.Lq = c.Lq, d.p.Lk = c.Lk, d.p.Hq = c.Hq, d.p.Hkv = c.Hkv, d.p.D = c.D, d.p.causal = c.causal;
  d.q = st::random_tensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}, seed);
  d.k = st::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed + 1);
  d.v = st::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed + 2);
  if (!c.dense) make_lists(c, d.p, seed + 3, d.idx, d.cnt);
  d.opt.causal = c.causal;
  if (c.scale > 0) d.opt.softmax_scale = c.scale;
  d.scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.D));
  return d;
}

sa::Selection selection_of(const Case& c, const CaseData& d) {
  if (c.dense) return sa::AllBlocks{};
  return sa::TileLists{d.idx.view(), d.cnt.view()};
}

// One GPU call on the case's inputs, into poisoned outputs: (out, lse).
std::pair<sa::HostTensor, sa::HostTensor> run_gpu(const Case& c, const CaseData& d,
                                                  const sa::detail::AttentionTuning& tuning = {}) {
  sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D});
  sa::HostTensor lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
  st::poison(out);
  st::poison(lse);
  DeviceTensor dq(d.q), dk(d.k), dv(d.v), dout(out), dlse(lse);
  if (c.dense) {
    gpu_dense(dq.view, dk.view, dv.view, dout.view, dlse.view, d.opt, tuning);
  } else {
    DeviceTensor didx(d.idx), dcnt(d.cnt);
    gpu_tile_sparse(dq.view, dk.view, dv.view, sa::TileLists{didx.view, dcnt.view}, dout.view, dlse.view, d.opt,
                    tuning);
    cuda_ok(cudaDeviceSynchronize(), "kernel");
  }
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  dout.download(out);
  dlse.download(lse);
  return {std::move(out), std::move(lse)};
}

void run_case(const Case& c, std::uint64_t seed, const sa::detail::AttentionTuning& tuning = {}) {
  const CaseData d = make_case(c, seed);
  const auto [out, lse] = run_gpu(c, d, tuning);
  check_against_reference(c, d.q, d.k, d.v, selection_of(c, d), d.p, out, lse, d.scale);
}

}  // namespace

TEST(TileAttentionGpu, SparseShapes) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 1000;
  // Lq = 1013 / 17 / 1: partial last Q tile; Lk = 1500: partial last KV block (Tk = 12).
  run_case({"bf16 gqa1 lists per group", sa::DType::bf16, 2, 1013, 1500, 2, 2, false, false, false, 5}, seed += 10);
  run_case({"bf16 causal per-head Hq=2Hkv", sa::DType::bf16, 2, 1013, 1500, 4, 2, true, false, true, 6}, seed += 10);
  run_case({"bf16 causal Lq=1 Hq=16Hkv", sa::DType::bf16, 1, 1, 700, 16, 1, true, false, false, 3}, seed += 10);
  run_case({"f16 Lq=17 Hq=16Hkv scale=0.05", sa::DType::f16, 2, 17, 260, 16, 1, false, false, false, 3, 0.05f},
           seed += 10);
  run_case({"f16 causal Lq>Lk per group", sa::DType::f16, 2, 400, 333, 4, 1, true, false, false, 3}, seed += 10);
  // Head dim 64: one 64-column half per tile, P V on m64n64 wgmmas.
  run_case({"D=64 bf16 causal per-head", sa::DType::bf16, 2, 1013, 1500, 4, 2, true, false, true, 5, 0.0f, 64},
           seed += 10);
  run_case({"D=64 f16 Lq=17 Hq=16Hkv", sa::DType::f16, 1, 17, 700, 16, 1, false, false, false, 3, 0.0f, 64},
           seed += 10);
}

TEST(TileAttentionGpu, DenseShapes) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 2000;
  run_case({"dense bf16 causal Lq=Lk=1013", sa::DType::bf16, 2, 1013, 1013, 2, 1, true, true}, seed += 10);
  run_case({"dense f16 Lq=300 Lk=1100", sa::DType::f16, 1, 300, 1100, 2, 2, false, true}, seed += 10);
  // Bottom-right causal with Lq > Lk: the first Lq - Lk queries see no key (out 0, lse -inf).
  run_case({"dense bf16 causal Lq=400 Lk=200", sa::DType::bf16, 2, 400, 200, 2, 2, true, true}, seed += 10);
  run_case({"dense bf16 Lq=1 Lk=129", sa::DType::bf16, 1, 1, 129, 16, 1, false, true}, seed += 10);
  run_case({"dense D=64 bf16 causal", sa::DType::bf16, 2, 777, 1100, 4, 1, true, true, false, 4, 0.0f, 64},
           seed += 10);
}

// A small case for the compute-sanitizer runs (memcheck, racecheck, synccheck).
TEST(TileAttentionGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  run_case({"small causal lists", sa::DType::bf16, 2, 300, 520, 2, 1, true, false, false, 3}, 3000);
  run_case({"small dense", sa::DType::f16, 1, 200, 200, 1, 1, false, true}, 3010);
  // Non-causal, so tile 0's list (never empty) is visible whatever blocks it drew.
  run_case({"small D=64 lists", sa::DType::bf16, 1, 200, 300, 2, 1, false, false, false, 3, 0.0f, 64}, 3020);
  // Two CTAs for 24 work items (some with empty lists): every ring wraps, both Q buffers are reused,
  // items chain into one another.
  run_case({"small lists, 2 CTAs", sa::DType::bf16, 2, 700, 520, 4, 2, false, false, true, 3}, 3030, grid_of(2));
  run_case({"small causal dense, 2 CTAs", sa::DType::bf16, 1, 520, 520, 4, 1, true, true}, 3040, grid_of(2));
}

// Many work items per CTA on a problem larger than one wave: 512 items over 3 CTAs and over the full
// grid, per-group lists with empty tiles, against the reference.
TEST(TileAttentionGpu, ManyItemsPerCta) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"bf16 512 items Hq=16Hkv", sa::DType::bf16, 2, 1024, 1100, 32, 2, false, false, false, 3};
  run_case(c, 3100);
  run_case({"bf16 512 items, 3 CTAs", sa::DType::bf16, 2, 1024, 1100, 32, 2, false, false, false, 3}, 3110,
           grid_of(3));
  run_case({"bf16 causal dense, 3 CTAs", sa::DType::bf16, 1, 900, 900, 8, 2, true, true}, 3120, grid_of(3));
}

// Non-causal units of the last, partial wave are computed in pieces by several CTAs and combined by
// the last piece to arrive (scheduler.cuh; store_piece, arrive_piece and combine_pieces in
// epilogue.cuh). The launcher splits only where its cost model expects a gain; SplitTail::force splits
// wherever one is possible, so these small cases exercise it. Each case is checked against the
// reference, run twice (bit for bit the same: the arrival counters reset themselves and the combine
// order is fixed), and with the split off (the same values up to the order of the sums). Grid caps set up the tails: one unit in four pieces (7 CTAs),
// four units over five CTAs with short and empty lists (empty pieces), and below one wave on the full
// grid, where every unit is cut into several pieces.
TEST(TileAttentionGpu, SplitTail) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  struct Setting {
    int ctas;  // AttentionTuning::max_ctas (0: the full grid)
    Case c;
  };
  const Setting settings[] = {
      {7, {"split: 64 dense units on 7 CTAs", sa::DType::bf16, 2, 900, 1100, 4, 2, false, true}},
      {5, {"split: 64 list units on 5 CTAs", sa::DType::bf16, 2, 900, 1100, 4, 2, false, false, false, 9}},
      {0, {"split: 24 dense units, full grid", sa::DType::f16, 1, 700, 2000, 4, 1, false, true}},
      {0, {"split: D=64 per-head lists, full grid", sa::DType::bf16, 1, 300, 3000, 8, 2, false, false, true, 24, 0.0f,
           64}},
  };
  std::uint64_t seed = 6000;
  for (const Setting& setting : settings) {
    const Case& c = setting.c;
    const sa::detail::AttentionTuning force = grid_of(setting.ctas, sa::detail::SplitTail::force);
    const CaseData d = make_case(c, seed += 10);
    const auto [out, lse] = run_gpu(c, d, force);
    check_against_reference(c, d.q, d.k, d.v, selection_of(c, d), d.p, out, lse, d.scale);
    const auto same_bits = [&](const std::pair<sa::HostTensor, sa::HostTensor>& again, const std::string& what) {
      EXPECT_EQ(0, std::memcmp(out.view().data, again.first.view().data, out.numel() * sa::dtype_size(c.dtype)))
          << c.name << ": out differs " << what;
      EXPECT_EQ(0, std::memcmp(lse.view().data, again.second.view().data, lse.numel() * 4))
          << c.name << ": lse differs " << what;
    };
    same_bits(run_gpu(c, d, force), "between two runs");
    const auto whole = run_gpu(c, d, grid_of(setting.ctas, sa::detail::SplitTail::off));
    check_against_reference(c, d.q, d.k, d.v, selection_of(c, d), d.p, whole.first, whole.second, d.scale);
    // Each piece rounds its P to the 16-bit type against its own running max, so the two differ by
    // about the rounding error of P: bounded as the reference comparison bounds it, with the whole
    // walk's output as the reference.
    const Tolerance tol = tolerance(c.dtype);
    std::vector<double> whole_out(static_cast<std::size_t>(out.numel()));
    double whole_max = 1.0, worst_lse = 0.0;
    for (std::int64_t i = 0; i < out.numel(); ++i) {
      whole_out[static_cast<std::size_t>(i)] = st::element(whole.first, i);
      whole_max = std::max(whole_max, std::abs(whole_out[static_cast<std::size_t>(i)]));
    }
    for (std::int64_t i = 0; i < lse.numel(); ++i) {
      const double a = st::element(lse, i), b = st::element(whole.second, i);
      if (std::isinf(b)) {
        EXPECT_EQ(a, b) << c.name << ": lse[" << i << "] split " << a << ", whole " << b;
        continue;
      }
      worst_lse = std::max(worst_lse, std::abs(a - b));
    }
    EXPECT_LE(st::rel_err(out, whole_out), tol.rel) << c.name << ": split against whole, relative";
    EXPECT_LE(st::max_abs_err(out, whole_out), tol.max_abs_frac * whole_max) << c.name << ": split against whole, max";
    EXPECT_LE(worst_lse, 1e-5) << c.name << ": split and whole lse";
  }
}

// The split tail's workspace is allocated on a stream's first split; a call captured into a CUDA graph
// on a stream that has none yet must not allocate (it runs unsplit), and once the stream has one a
// captured call splits like an eager one: same bits.
TEST(TileAttentionGpu, GraphCaptureOfSplitProblems) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // 12 units, far below one wave: the launcher splits them (dense, non-causal).
  const Case c{"graph capture", sa::DType::bf16, 1, 700, 2000, 2, 1, false, true};
  const CaseData d = make_case(c, 8000);
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  sa::AttentionOptions opt = d.opt;
  opt.stream = stream;
  DeviceTensor dq(d.q), dk(d.k), dv(d.v);
  const auto run = [&](bool capture, const sa::detail::AttentionTuning& tuning = {}) {
    sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D}), lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
    st::poison(out);
    st::poison(lse);
    DeviceTensor dout(out), dlse(lse);
    if (capture) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
      gpu_dense(dq.view, dk.view, dv.view, dout.view, dlse.view, opt);
      cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
      cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
      cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
      cuda_ok(cudaStreamSynchronize(stream), "graph");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    } else {
      gpu_dense(dq.view, dk.view, dv.view, dout.view, dlse.view, opt, tuning);
      cuda_ok(cudaStreamSynchronize(stream), "kernel");
    }
    dout.download(out);
    dlse.download(lse);
    check_against_reference(c, d.q, d.k, d.v, selection_of(c, d), d.p, out, lse, d.scale);
    return std::make_pair(std::move(out), std::move(lse));
  };
  const auto fresh = run(true);   // captured before the stream has a workspace: unsplit
  const auto eager = run(false);  // allocates, splits
  const auto again = run(true);   // captured with the workspace in place: split
  EXPECT_EQ(0, std::memcmp(eager.first.view().data, again.first.view().data, eager.first.numel() * 2))
      << "a captured split call differs from the eager one";
  const auto whole = run(false, grid_of(0, sa::detail::SplitTail::off));
  EXPECT_EQ(0, std::memcmp(fresh.first.view().data, whole.first.view().data, fresh.first.numel() * 2))
      << "the call captured on a fresh stream is not the unsplit one";
  cudaStreamDestroy(stream);
}

// TileLists whose slots are not adjacent (idx stride 3 = 2, the other slots holding valid but wrong
// ids): the kernel must read the slots the strides name, as the validation and the reference do.
TEST(TileAttentionGpu, StridedListSlots) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (const bool causal : {false, true}) {
    const Case c{causal ? "strided slots, causal" : "strided slots", sa::DType::bf16, 2, 700, 900, 4, 2, causal,
                 false, false, 5};
    const CaseData d = make_case(c, causal ? 7100 : 7000);
    const sa::HostTensor& idx = d.idx;
    const std::int64_t rows = idx.numel() / c.kmax, Tk = d.p.Tk();
    sa::HostTensor wide(sa::DType::i32, {idx.shape()[0], idx.shape()[1], idx.shape()[2], 2 * c.kmax});
    for (std::int64_t r = 0; r < rows; ++r)
      for (int s = 0; s < c.kmax; ++s) {
        const std::int32_t j = idx.data<std::int32_t>()[r * c.kmax + s];
        wide.data<std::int32_t>()[r * 2 * c.kmax + 2 * s] = j;
        wide.data<std::int32_t>()[r * 2 * c.kmax + 2 * s + 1] = static_cast<std::int32_t>((std::max(j, 0) + 1) % Tk);
      }
    sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D}), lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
    st::poison(out);
    st::poison(lse);
    DeviceTensor dq(d.q), dk(d.k), dv(d.v), dwide(wide), dcnt(d.cnt), dout(out), dlse(lse);
    sa::TensorView strided = sa::TensorView::contiguous(dwide.ptr, sa::DType::i32, idx.shape(), sa::Device::cuda, 0);
    strided.stride = {idx.shape()[1] * idx.shape()[2] * 2 * c.kmax, idx.shape()[2] * 2 * c.kmax, 2 * c.kmax, 2};
    gpu_tile_sparse(dq.view, dk.view, dv.view, sa::TileLists{strided, dcnt.view}, dout.view, dlse.view, d.opt);
    cuda_ok(cudaDeviceSynchronize(), "kernel");
    dout.download(out);
    dlse.download(lse);
    check_against_reference(c, d.q, d.k, d.v, selection_of(c, d), d.p, out, lse, d.scale);
  }
}

// q, k, v as views into one packed [B, L, 3, H, D] buffer (strides l = 3HD, h = D), as a fused QKV
// projection produces them.
TEST(TileAttentionGpu, PackedQkvStrides) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::int64_t B = 2, L = 517, H = 2;
  const sa::HostTensor qkv = st::random_tensor(sa::DType::bf16, {B, L, 3, H, kD}, 4000);
  sa::HostTensor q(sa::DType::bf16, {B, L, H, kD}), k(q), v(q);
  const auto* src = qkv.data<std::uint16_t>();
  for (std::int64_t bl = 0; bl < B * L; ++bl)
    for (int part = 0; part < 3; ++part) {
      sa::HostTensor& dst = part == 0 ? q : (part == 1 ? k : v);
      std::memcpy(dst.data<std::uint16_t>() + bl * H * kD, src + (bl * 3 + part) * H * kD, H * kD * 2);
    }
  DeviceTensor dqkv(qkv);
  auto part_view = [&](int part) {
    sa::TensorView t = sa::TensorView::contiguous(static_cast<std::uint16_t*>(dqkv.ptr) + part * H * kD,
                                                  sa::DType::bf16, {B, L, H, kD}, sa::Device::cuda, 0);
    t.stride = {L * 3 * H * kD, 3 * H * kD, kD, 1};
    return t;
  };
  sa::HostTensor out(sa::DType::bf16, {B, L, H, kD}), lse(sa::DType::f32, {B, H, L});
  st::poison(out);
  st::poison(lse);
  DeviceTensor dout(out), dlse(lse);
  Case c{"packed qkv causal lists", sa::DType::bf16, B, L, L, H, H, true, false, false, 3};
  sa::ProblemShape p;
  p.B = B, p.Lq = L, p.Lk = L, p.Hq = H, p.Hkv = H, p.D = kD, p.causal = true;
  sa::HostTensor idx, cnt;
  make_lists(c, p, 4001, idx, cnt);
  DeviceTensor didx(idx), dcnt(cnt);
  sa::AttentionOptions opt;
  opt.causal = true;
  gpu_tile_sparse(part_view(0), part_view(1), part_view(2), sa::TileLists{didx.view, dcnt.view}, dout.view, dlse.view,
                  opt);
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  dout.download(out);
  dlse.download(lse);
  check_against_reference(c, q, k, v, sa::TileLists{idx.view(), cnt.view()}, p, out, lse, 1.0 / std::sqrt(double(kD)));
}

// tile_sparse with every block listed walks the same blocks in the same order as dense: the outputs
// must be identical, and two runs of the persistent kernel must agree bit for bit (a race would not).
TEST(TileAttentionGpu, AllBlocksEqualsDenseAndIsDeterministic) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::int64_t B = 2, L = 1900, Hq = 8, Hkv = 2;
  sa::ProblemShape p;
  p.B = B, p.Lq = L, p.Lk = L, p.Hq = Hq, p.Hkv = Hkv, p.D = kD, p.causal = true;
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {B, L, Hq, kD}, 5000);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 5001);
  const sa::HostTensor v = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 5002);
  const std::int64_t Tq = p.Tq(), Tk = p.Tk();
  sa::HostTensor idx(sa::DType::i32, {B, Hkv, Tq, Tk}), cnt(sa::DType::i32, {B, Hkv, Tq});
  for (std::int64_t r = 0; r < B * Hkv * Tq; ++r) {
    cnt.data<std::int32_t>()[r] = static_cast<std::int32_t>(Tk);
    for (std::int64_t j = 0; j < Tk; ++j) idx.data<std::int32_t>()[r * Tk + j] = static_cast<std::int32_t>(j);
  }
  sa::HostTensor out_a(sa::DType::bf16, {B, L, Hq, kD}), out_b(out_a), out_c(out_a);
  st::poison(out_a);
  DeviceTensor dq(q), dk(k), dv(v), didx(idx), dcnt(cnt), da(out_a), db(out_a), dc(out_a);
  sa::AttentionOptions opt;
  opt.causal = true;
  gpu_dense(dq.view, dk.view, dv.view, da.view, std::nullopt, opt);
  gpu_tile_sparse(dq.view, dk.view, dv.view, sa::TileLists{didx.view, dcnt.view}, db.view, std::nullopt, opt);
  gpu_dense(dq.view, dk.view, dv.view, dc.view, std::nullopt, opt);
  da.download(out_a);
  db.download(out_b);
  dc.download(out_c);
  ASSERT_TRUE(st::all_finite(out_a));
  EXPECT_EQ(0, std::memcmp(out_a.view().data, out_b.view().data, da.bytes)) << "dense and all-blocks tile_sparse differ";
  EXPECT_EQ(0, std::memcmp(out_a.view().data, out_c.view().data, da.bytes)) << "two dense runs differ";
  // And so must a grid of 3 CTAs, each walking ~43 work items.
  sa::HostTensor out_d(out_a);
  DeviceTensor dd(out_a);
  gpu_dense(dq.view, dk.view, dv.view, dd.view, std::nullopt, opt, grid_of(3));
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  dd.download(out_d);
  EXPECT_EQ(0, std::memcmp(out_a.view().data, out_d.view().data, da.bytes)) << "a grid of 3 CTAs changes the output";
}

// An output TMA cannot address (head stride 130 elements: not a multiple of 8) is written from
// registers: same bounds against the reference, the padding between heads never touched, and the same
// bits as a contiguous output, which the TMA store writes.
TEST(TileAttentionGpu, OutputOffTheTmaGrid) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::int64_t B = 2, L = 333, Hq = 4, Hkv = 2, Dpad = kD + 2;
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {B, L, Hq, kD}, 5500);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 5501);
  const sa::HostTensor v = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 5502);
  sa::HostTensor padded(sa::DType::bf16, {B, L, Hq, Dpad}), lse(sa::DType::f32, {B, Hq, L});
  st::poison(padded);
  st::poison(lse);
  const sa::HostTensor poisoned = padded;
  DeviceTensor dq(q), dk(k), dv(v), dpad(padded), dlse(lse);
  sa::TensorView out_view = sa::TensorView::contiguous(dpad.ptr, sa::DType::bf16, {B, L, Hq, kD}, sa::Device::cuda, 0);
  out_view.stride = {L * Hq * Dpad, Hq * Dpad, Dpad, 1};
  sa::AttentionOptions opt;
  opt.causal = true;
  gpu_dense(dq.view, dk.view, dv.view, out_view, dlse.view, opt);
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  dpad.download(padded);
  dlse.download(lse);
  sa::HostTensor out(sa::DType::bf16, {B, L, Hq, kD});
  const auto* src = padded.data<std::uint16_t>();
  const auto* before = poisoned.data<std::uint16_t>();
  for (std::int64_t row = 0; row < B * L * Hq; ++row) {
    std::memcpy(out.data<std::uint16_t>() + row * kD, src + row * Dpad, kD * 2);
    for (std::int64_t c = kD; c < Dpad; ++c)
      ASSERT_EQ(before[row * Dpad + c], src[row * Dpad + c]) << "padding element " << c << " of row " << row << " written";
  }
  sa::ProblemShape p;
  p.B = B, p.Lq = L, p.Lk = L, p.Hq = Hq, p.Hkv = Hkv, p.D = kD, p.causal = true;
  const Case c{"dense causal, out head stride 130", sa::DType::bf16, B, L, L, Hq, Hkv, true, true};
  check_against_reference(c, q, k, v, sa::AllBlocks{}, p, out, lse, 1.0 / std::sqrt(double(kD)));
  sa::HostTensor stored(out);
  st::poison(stored);
  DeviceTensor dstored(stored);
  gpu_dense(dq.view, dk.view, dv.view, dstored.view, std::nullopt, opt);
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  dstored.download(stored);
  EXPECT_EQ(0, std::memcmp(out.view().data, stored.view().data, dstored.bytes))
      << "the register store and the TMA store write different outputs";
}

// Validated lists with every kind of fault (the CPU's order and messages), read where they surface.
namespace faults {

constexpr std::int64_t B = 2, L = 600, Hq = 4, Hkv = 2, Tq = 5, Kmax = 3;  // Tq = Tk = 5; lists per KV head
constexpr std::int64_t kFaultyRow = 12;  // (b, g, t) = (1, 0, 2): flat row 1 * 10 + 0 * 5 + 2

// Every row: ids {0, 3}, count 2, -1 in the spare slot.
void valid_lists(sa::HostTensor& idx, sa::HostTensor& cnt) {
  idx = sa::HostTensor(sa::DType::i32, {B, Hkv, Tq, Kmax});
  cnt = sa::HostTensor(sa::DType::i32, {B, Hkv, Tq});
  for (std::int64_t r = 0; r < B * Hkv * Tq; ++r) {
    cnt.data<std::int32_t>()[r] = 2;
    idx.data<std::int32_t>()[r * Kmax + 0] = 0;
    idx.data<std::int32_t>()[r * Kmax + 1] = 3;
    idx.data<std::int32_t>()[r * Kmax + 2] = -1;
  }
}

struct Fault {
  const char* what;
  void (*mutate)(std::int32_t* idx, std::int32_t* cnt);
  const char* arg;
  const char* message;  // the CPU's, after "tile_sparse: argument '<arg>': "
  std::int64_t row;     // the faulty tile (flat b, g, t) that is reported: the first
  std::int64_t also = -1;  // a second faulty tile, or -1
  std::vector<std::int64_t> rows() const { return also < 0 ? std::vector<std::int64_t>{row} : std::vector<std::int64_t>{row, also}; }
};

const Fault kFaults[] = {
    {"id out of range", [](std::int32_t* i, std::int32_t*) { i[kFaultyRow * Kmax + 1] = 5; }, "tiles.idx",
     "block id 5 at [1, 0, 2, 1] is out of range [0, 5)", kFaultyRow},
    {"negative id", [](std::int32_t* i, std::int32_t*) { i[kFaultyRow * Kmax] = -2; }, "tiles.idx",
     "block id -2 at [1, 0, 2, 0] is out of range [0, 5)", kFaultyRow},
    {"repeated id", [](std::int32_t* i, std::int32_t*) { i[kFaultyRow * Kmax + 1] = 0; }, "tiles.idx",
     "duplicate block id 0 at [1, 0, 2, 1]", kFaultyRow},
    {"descending ids",
     [](std::int32_t* i, std::int32_t*) {
       i[kFaultyRow * Kmax] = 3;
       i[kFaultyRow * Kmax + 1] = 1;
     },
     "tiles.idx", "block ids must be strictly ascending: 1 at [1, 0, 2, 1] follows 3", kFaultyRow},
    // Two faulty tiles: the first in row-major order is reported.
    {"count over capacity",
     [](std::int32_t*, std::int32_t* c) {
       c[kFaultyRow] = 4;
       c[kFaultyRow + 5] = -1;
     },
     "tiles.cnt", "count 4 at [1, 0, 2] exceeds the list capacity Kmax = 3", kFaultyRow, kFaultyRow + 5},
    {"negative count", [](std::int32_t*, std::int32_t* c) { c[kFaultyRow + 5] = -1; }, "tiles.cnt",
     "negative count -1 at [1, 1, 2]", kFaultyRow + 5},
};

// The CPU's message for lists that `f` made faulty (the device reports the same, plus a note).
std::string cpu_message(const Fault& f, const sa::HostTensor& q, const sa::HostTensor& k, const sa::HostTensor& v,
                        const sa::HostTensor& idx, const sa::HostTensor& cnt, bool causal) {
  sa::HostTensor out(sa::DType::bf16, {B, L, Hq, kD});
  sa::AttentionOptions opt;
  opt.causal = causal;
  try {
    sa::tile_sparse(q.view(), k.view(), v.view(), sa::TileLists{idx.view(), cnt.view()}, out.view(), std::nullopt, opt);
  } catch (const sa::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << f.what << ": the CPU accepted the lists";
  return {};
}

// The error of a deferred fault: the CPU's operator, argument and message, then a note naming `where`.
void expect_fault(const sa::Error& e, const Fault& f, const std::string& cpu, const std::string& where) {
  const std::string msg = e.what();
  EXPECT_EQ(e.op(), "tile_sparse") << f.what;
  EXPECT_EQ(e.argument(), f.arg) << f.what;
  EXPECT_EQ(msg.rfind(cpu, 0), 0u) << f.what << ": " << msg << "\nCPU: " << cpu;
  EXPECT_NE(msg.find(std::string("tile_sparse: argument '") + f.arg + "': " + f.message), std::string::npos) << msg;
  EXPECT_NE(msg.find("earlier validated tile_sparse call"), std::string::npos) << msg;
  EXPECT_NE(msg.find(where), std::string::npos) << msg;
}

// Fills a 16-bit output with a finite value no kernel writes by chance.
void fill_sentinel(sa::HostTensor& t) { std::memset(t.view().data, 0x3f, static_cast<std::size_t>(t.numel()) * sa::dtype_size(t.dtype())); }

// The rows of each tile of `rows` hold NaN in out and lse, for every query head that shares the list;
// every other element equals `trusted`'s bit for bit.
void expect_nan_tile_only(const sa::HostTensor& out, const sa::HostTensor& lse, const sa::HostTensor& trusted_out,
                          const sa::HostTensor& trusted_lse, const std::vector<std::int64_t>& rows,
                          const std::string& what) {
  const auto faulty = [&](std::int64_t b, std::int64_t i, std::int64_t h) {
    for (const std::int64_t row : rows)
      if (b == row / (Hkv * Tq) && h / (Hq / Hkv) == row / Tq % Hkv && i / sa::kTileQ == row % Tq) return true;
    return false;
  };
  const auto* o = static_cast<const std::uint16_t*>(out.view().data);
  const auto* to = static_cast<const std::uint16_t*>(trusted_out.view().data);
  std::int64_t nan_rows = 0, wrong = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t h = 0; h < Hq; ++h) {
        const std::int64_t base = ((b * L + i) * Hq + h) * kD;
        const float l = lse.data<float>()[(b * Hq + h) * L + i];
        if (faulty(b, i, h)) {
          bool all_nan = std::isnan(l);
          for (std::int64_t d = 0; d < kD; ++d) all_nan = all_nan && std::isnan(st::element(out, base + d));
          nan_rows += all_nan;
          continue;
        }
        const float tl = trusted_lse.data<float>()[(b * Hq + h) * L + i];
        wrong += std::memcmp(o + base, to + base, kD * 2) != 0 || std::memcmp(&l, &tl, 4) != 0;
      }
  std::int64_t expected = 0;
  for (const std::int64_t row : rows) expected += (Hq / Hkv) * std::min<std::int64_t>(sa::kTileQ, L - row % Tq * sa::kTileQ);
  EXPECT_EQ(nan_rows, expected) << what << ": rows of the faulty tiles that are NaN in out and lse";
  EXPECT_EQ(wrong, 0) << what << ": rows outside the faulty tiles that differ from the trusted call";
}

}  // namespace faults

// Validated calls check the lists inside the kernel and return without waiting: a faulty tile gets
// NaN rows (all heads that share its list) and nothing else changes; the first fault surfaces as the
// CPU's error at check_device_faults, or at the start of the next operator on the device, once.
// Valid lists give the trusted call's output bit for bit. Causal (whole units) and not (a split tail:
// 40 units on a full GPU).
TEST(TileAttentionGpu, ValidationIsDeferredAndMarksTheFaultyTile) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using namespace faults;
  ASSERT_NO_THROW(sa::check_device_faults());
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {B, L, Hq, kD}, 6000);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 6001);
  const sa::HostTensor v = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 6002);
  DeviceTensor dq(q), dk(k), dv(v);
  for (const bool causal : {false, true}) {
    sa::AttentionOptions checked, trusted;
    checked.causal = trusted.causal = causal;
    trusted.trusted = true;
    // One call into sentinel-filled outputs: (out, lse).
    const auto call = [&](const sa::HostTensor& idx, const sa::HostTensor& cnt, const sa::AttentionOptions& opt) {
      sa::HostTensor out(sa::DType::bf16, {B, L, Hq, kD}), lse(sa::DType::f32, {B, Hq, L});
      fill_sentinel(out);
      std::memset(lse.view().data, 0x3f, static_cast<std::size_t>(lse.numel()) * 4);
      DeviceTensor didx(idx), dcnt(cnt), dout(out), dlse(lse);
      sa::tile_sparse(dq.view, dk.view, dv.view, sa::TileLists{didx.view, dcnt.view}, dout.view, dlse.view, opt);
      cuda_ok(cudaDeviceSynchronize(), "tile_sparse");
      dout.download(out);
      dlse.download(lse);
      return std::make_pair(std::move(out), std::move(lse));
    };
    sa::HostTensor idx, cnt;
    valid_lists(idx, cnt);
    {
      const auto [out, lse] = call(idx, cnt, checked);
      const auto [tout, tlse] = call(idx, cnt, trusted);
      EXPECT_TRUE(st::all_finite(out, true));
      EXPECT_EQ(0, std::memcmp(out.view().data, tout.view().data, static_cast<std::size_t>(out.numel()) * 2))
          << "valid lists: validated and trusted outputs differ";
      EXPECT_EQ(0, std::memcmp(lse.view().data, tlse.view().data, static_cast<std::size_t>(lse.numel()) * 4));
      ASSERT_NO_THROW(sa::check_device_faults(0)) << "valid lists recorded a fault";
    }
    for (const Fault& f : kFaults) {
      const std::string what = std::string(f.what) + (causal ? ", causal" : "");
      SCOPED_TRACE(what);
      sa::HostTensor bad_idx, bad_cnt;
      valid_lists(bad_idx, bad_cnt);
      f.mutate(bad_idx.data<std::int32_t>(), bad_cnt.data<std::int32_t>());
      const std::string cpu = cpu_message(f, q, k, v, bad_idx, bad_cnt, causal);
      // Trusted: nothing checked, nothing reported (the count is clamped, ids out of range skipped).
      const auto [tout, tlse] = call(bad_idx, bad_cnt, trusted);
      // The validated call returns; the fault waits on the device.
      std::pair<sa::HostTensor, sa::HostTensor> got;
      ASSERT_NO_THROW(got = call(bad_idx, bad_cnt, checked));
      expect_nan_tile_only(got.first, got.second, tout, tlse, f.rows(), what);
      try {
        sa::check_device_faults(0);
        ADD_FAILURE() << "check_device_faults found no fault";
      } catch (const sa::Error& e) {
        expect_fault(e, f, cpu, "reported by check_device_faults");
      }
      EXPECT_NO_THROW(sa::check_device_faults()) << "a fault is reported once";
      // At the start of the next operator on the device, before it runs.
      ASSERT_NO_THROW(call(bad_idx, bad_cnt, checked));
      sa::HostTensor out(sa::DType::bf16, {B, L, Hq, kD});
      DeviceTensor dout(out);
      try {
        sa::dense(dq.view, dk.view, dv.view, dout.view, std::nullopt, trusted);
        ADD_FAILURE() << "the next call found no fault";
      } catch (const sa::Error& e) {
        expect_fault(e, f, cpu, "at the start of dense");
      }
      EXPECT_NO_THROW(sa::dense(dq.view, dk.view, dv.view, dout.view, std::nullopt, trusted));
      cuda_ok(cudaDeviceSynchronize(), "dense");
      EXPECT_NO_THROW(sa::check_device_faults(0));
    }
  }
}

// A validated tile_sparse call captured into a CUDA graph: the replay equals the eager call bit for
// bit, and a replay over lists made faulty after the capture records the fault.
TEST(TileAttentionGpu, ValidatedCallsCaptureIntoGraphs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using namespace faults;
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {B, L, Hq, kD}, 6100);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 6101);
  const sa::HostTensor v = st::random_tensor(sa::DType::bf16, {B, L, Hkv, kD}, 6102);
  sa::HostTensor idx, cnt;
  valid_lists(idx, cnt);
  sa::HostTensor out(sa::DType::bf16, {B, L, Hq, kD}), lse(sa::DType::f32, {B, Hq, L});
  st::poison(out);
  st::poison(lse);
  DeviceTensor dq(q), dk(k), dv(v), didx(idx), dcnt(cnt), dout(out), dlse(lse), gout(out), glse(lse);
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  sa::AttentionOptions opt;  // validated
  opt.stream = stream;
  const sa::TileLists tiles{didx.view, dcnt.view};
  // Eager first: the stream gets its split-tail workspace, so the captured call splits alike.
  sa::tile_sparse(dq.view, dk.view, dv.view, tiles, dout.view, dlse.view, opt);
  cuda_ok(cudaStreamSynchronize(stream), "eager");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  sa::tile_sparse(dq.view, dk.view, dv.view, tiles, gout.view, glse.view, opt);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cuda_ok(cudaGraphLaunch(exec, stream), "replay");
  cuda_ok(cudaStreamSynchronize(stream), "replay");
  sa::HostTensor eager_out = out, eager_lse = lse, graph_out = out, graph_lse = lse;
  dout.download(eager_out);
  dlse.download(eager_lse);
  gout.download(graph_out);
  glse.download(graph_lse);
  ASSERT_TRUE(st::all_finite(eager_out));
  EXPECT_EQ(0, std::memcmp(eager_out.view().data, graph_out.view().data, dout.bytes)) << "replay differs from eager";
  EXPECT_EQ(0, std::memcmp(eager_lse.view().data, graph_lse.view().data, dlse.bytes)) << "replay lse differs";
  EXPECT_NO_THROW(sa::check_device_faults(0));
  // The same graph over lists that went bad since.
  const Fault& f = kFaults[0];
  sa::HostTensor bad_idx = idx, bad_cnt = cnt;
  f.mutate(bad_idx.data<std::int32_t>(), bad_cnt.data<std::int32_t>());
  cuda_ok(cudaMemcpy(didx.ptr, bad_idx.view().data, didx.bytes, cudaMemcpyHostToDevice), "upload");
  const std::string cpu = cpu_message(f, q, k, v, bad_idx, bad_cnt, false);
  cuda_ok(cudaGraphLaunch(exec, stream), "replay");
  cuda_ok(cudaStreamSynchronize(stream), "replay");
  gout.download(graph_out);
  glse.download(graph_lse);
  expect_nan_tile_only(graph_out, graph_lse, eager_out, eager_lse, f.rows(), "replay over faulty lists");
  try {
    sa::check_device_faults();
    ADD_FAILURE() << "the replay recorded no fault";
  } catch (const sa::Error& e) {
    expect_fault(e, f, cpu, "reported by check_device_faults");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(TileAttentionGpu, RejectsUnsupportedHeadDim) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {1, 64, 1, 96}, 7000);
  sa::HostTensor out(sa::DType::bf16, {1, 64, 1, 96});
  DeviceTensor dq(q), dout(out);
  try {
    gpu_dense(dq.view, dq.view, dq.view, dout.view);
    ADD_FAILURE() << "D = 96 accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "q");
    EXPECT_NE(std::string(e.what()).find("head dim"), std::string::npos) << e.what();
  }
}

// The public operators route device tensors to this backend.
TEST(TileAttentionGpu, PublicOperatorsDispatchToCuda) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::int64_t B = 1, L = 300, H = 2;
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {B, L, H, kD}, 8000);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {B, L, H, kD}, 8001);
  const sa::HostTensor v = st::random_tensor(sa::DType::bf16, {B, L, H, kD}, 8002);
  sa::HostTensor idx(sa::DType::i32, {B, H, 3, 2}), cnt(sa::DType::i32, {B, H, 3});
  for (std::int64_t r = 0; r < B * H * 3; ++r) {
    cnt.data<std::int32_t>()[r] = 2;
    idx.data<std::int32_t>()[r * 2] = 0;
    idx.data<std::int32_t>()[r * 2 + 1] = 2;
  }
  sa::HostTensor a(sa::DType::bf16, {B, L, H, kD}), b(a), c(a), d(a);
  st::poison(a);
  DeviceTensor dq(q), dk(k), dv(v), didx(idx), dcnt(cnt), da(a), db(a), dc(a), dd(a);
  sa::AttentionOptions opt;
  opt.causal = true;
  const sa::TileLists tiles{didx.view, dcnt.view};
  sa::dense(dq.view, dk.view, dv.view, da.view, std::nullopt, opt);
  gpu_dense(dq.view, dk.view, dv.view, db.view, std::nullopt, opt);
  sa::tile_sparse(dq.view, dk.view, dv.view, tiles, dc.view, std::nullopt, opt);
  gpu_tile_sparse(dq.view, dk.view, dv.view, tiles, dd.view, std::nullopt, opt);
  cuda_ok(cudaDeviceSynchronize(), "kernel");
  da.download(a);
  db.download(b);
  dc.download(c);
  dd.download(d);
  ASSERT_TRUE(st::all_finite(a) && st::all_finite(c));
  EXPECT_EQ(0, std::memcmp(a.view().data, b.view().data, da.bytes)) << "sparse_attn::dense";
  EXPECT_EQ(0, std::memcmp(c.view().data, d.view().data, da.bytes)) << "sparse_attn::tile_sparse";
}

// bits_sparse on the GPU: the public operator on device bit sets (made from random lists by the CPU
// conversion) against the reference of the same BlockBits, per group and per head, causal and not,
// D = 64 and 128; where no tail is split (causal) its output equals tile_sparse's on the same lists bit
// for bit. Stray bits are reported as on the CPU; trusted bits skip the check.
TEST(TileAttentionGpu, BitsSparse) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"bits bf16 per group", sa::DType::bf16, 2, 1013, 1500, 2, 2, false, false, false, 5},
      {"bits bf16 causal per head", sa::DType::bf16, 2, 1013, 1500, 4, 2, true, false, true, 6},
      {"bits f16 causal Lq>Lk", sa::DType::f16, 2, 400, 333, 4, 1, true, false, false, 3},
      {"bits D=64 bf16 Tk=35", sa::DType::bf16, 1, 300, 4400, 4, 1, false, false, false, 12, 0.0f, 64},
  };
  std::uint64_t seed = 9000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const CaseData d = make_case(c, seed += 10);
    const std::int64_t G = c.per_head ? d.p.Hq : d.p.Hkv;
    sa::HostTensor bits(sa::DType::u32, {d.p.B, G, d.p.Tq(), sa::ceil_div(d.p.Tk(), std::int64_t{32})});
    sa::tile_lists_to_block_bits(sa::TileLists{d.idx.view(), d.cnt.view()}, sa::BlockBits{bits.view()}, d.p);
    sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D}), lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
    st::poison(out);
    st::poison(lse);
    DeviceTensor dq(d.q), dk(d.k), dv(d.v), dbits(bits), dout(out), dlse(lse);
    sa::bits_sparse(dq.view, dk.view, dv.view, sa::BlockBits{dbits.view}, dout.view, dlse.view, d.opt);
    cuda_ok(cudaDeviceSynchronize(), "bits_sparse");
    dout.download(out);
    dlse.download(lse);
    check_against_reference(c, d.q, d.k, d.v, sa::BlockBits{bits.view()}, d.p, out, lse, d.scale);
    if (c.causal) {
      const auto [tout, tlse] = run_gpu(c, d);
      EXPECT_EQ(0, std::memcmp(out.view().data, tout.view().data, dout.bytes)) << "out differs from tile_sparse";
      EXPECT_EQ(0, std::memcmp(lse.view().data, tlse.view().data, dlse.bytes)) << "lse differs from tile_sparse";
    }
    // Trusted: the same bits give the same result without the check.
    sa::AttentionOptions trusted = d.opt;
    trusted.trusted = true;
    sa::HostTensor out2 = out;
    st::poison(out2);
    DeviceTensor dout2(out2);
    sa::bits_sparse(dq.view, dk.view, dv.view, sa::BlockBits{dbits.view}, dout2.view, std::nullopt, trusted);
    cuda_ok(cudaDeviceSynchronize(), "bits_sparse trusted");
    dout2.download(out2);
    EXPECT_EQ(0, std::memcmp(out.view().data, out2.view().data, dout.bytes)) << "trusted run differs";
  }
  // A stray bit (block 12 of Tk = 12) in row (1, 1, 3): the CPU's error, argument and text.
  const Case c{"bits stray", sa::DType::bf16, 2, 600, 1500, 2, 2, false, false, false, 3};
  const CaseData d = make_case(c, 9100);
  sa::HostTensor bits(sa::DType::u32, {d.p.B, d.p.Hkv, d.p.Tq(), 1});
  sa::tile_lists_to_block_bits(sa::TileLists{d.idx.view(), d.cnt.view()}, sa::BlockBits{bits.view()}, d.p);
  bits.data<std::uint32_t>()[(1 * 2 + 1) * d.p.Tq() + 3] |= 1u << 12;
  sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D});
  std::string cpu_msg;
  try {
    sa::bits_sparse(d.q.view(), d.k.view(), d.v.view(), sa::BlockBits{bits.view()}, out.view());
  } catch (const sa::Error& e) {
    cpu_msg = e.what();
  }
  ASSERT_FALSE(cpu_msg.empty()) << "the CPU accepted a stray bit";
  DeviceTensor dq(d.q), dk(d.k), dv(d.v), dbits(bits), dout(out);
  try {
    sa::bits_sparse(dq.view, dk.view, dv.view, sa::BlockBits{dbits.view}, dout.view);
    ADD_FAILURE() << "the device accepted a stray bit";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "bits.bits") << e.what();
    EXPECT_EQ(std::string(e.what()), cpu_msg);
    EXPECT_NE(cpu_msg.find("stray bit 12 (block 12) set in the word at [1, 1, 3, 0]"), std::string::npos) << cpu_msg;
  }
}

// Small enough for compute-sanitizer: the public bits_sparse on device bits, checked and trusted.
TEST(TileAttentionGpu, BitsSanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"small bits causal", sa::DType::bf16, 2, 300, 520, 2, 1, true, false, false, 3};
  const CaseData d = make_case(c, 3030);
  sa::HostTensor bits(sa::DType::u32, {d.p.B, d.p.Hkv, d.p.Tq(), 1});
  sa::tile_lists_to_block_bits(sa::TileLists{d.idx.view(), d.cnt.view()}, sa::BlockBits{bits.view()}, d.p);
  sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D}), lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
  st::poison(out);
  st::poison(lse);
  DeviceTensor dq(d.q), dk(d.k), dv(d.v), dbits(bits), dout(out), dlse(lse);
  sa::bits_sparse(dq.view, dk.view, dv.view, sa::BlockBits{dbits.view}, dout.view, dlse.view, d.opt);
  sa::AttentionOptions trusted = d.opt;
  trusted.trusted = true;
  sa::bits_sparse(dq.view, dk.view, dv.view, sa::BlockBits{dbits.view}, dout.view, dlse.view, trusted);
  cuda_ok(cudaDeviceSynchronize(), "bits_sparse");
  dout.download(out);
  dlse.download(lse);
  check_against_reference(c, d.q, d.k, d.v, sa::BlockBits{bits.view()}, d.p, out, lse, d.scale);
}
