// GPU tests of the pooled R1 / R4 selector (src/cuda/selectors/pooled.cu): the device lists and counts
// must equal the CPU reference bit for bit, from the public function and from each scoring kernel
// (SelectorTuning). Beyond the random cases of test_selectors_gpu.cu, these target what the int8
// screening, the float64 kernel and the split of a tile's blocks over CTAs could get wrong:
// - near-ties: key blocks (and the four R4 key groups inside a block) that are copies of one another
//   up to a single last-bit change of one element, so block scores differ only in their last bits,
//   far inside the screening bound, and exact copies whose ties must go to the lower id;
// - all-equal inputs, where every pair of every block ties (the candidate queue overflows);
// - NaN / inf / huge / tiny inputs (no int8 copy: every such pair is evaluated in float64);
// - strided and misaligned views (the scalar load path), D not a multiple of 4 or above 128, query
//   groups of more than 64 rows (two query chunks), tiles with several key passes per CTA;
// - the two-level int8 copy at its edges (levels +-16255 and the split points of M = 128 H + L), rows
//   of means spread over several warps (D = 256) and D past the int8 screen (264);
// - the scratch cached per (device, stream): growth between queued calls, two streams at once, graph
//   capture and replay after a growth.
// Device outputs are poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "cuda/selectors/backend.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/dtype.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

void cuda_ok(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

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

// Copies tokens [sl, sl + n) of (b, sh) in src onto tokens [dl, dl + n) of (b, dh) in dst.
void copy_tokens(Input& dst, std::int64_t b, std::int64_t dl, std::int64_t dh, const Input& src, std::int64_t sl,
                 std::int64_t sh, std::int64_t n) {
  for (std::int64_t i = 0; i < n && dl + i < dst.L && sl + i < src.L; ++i)
    for (std::int64_t d = 0; d < dst.D; ++d) dst.set(dst.index(b, dl + i, dh, d), src.get(src.index(b, sl + i, sh, d)));
}

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
  void download(sa::HostTensor& h) const { cuda_ok(cudaMemcpy(h.view().data, ptr, bytes, cudaMemcpyDeviceToHost), "download"); }
};

sa::HostTensor poisoned(const std::vector<std::int64_t>& shape) {
  sa::HostTensor h(sa::DType::i32, shape);
  std::memset(h.view().data, 0x5a, static_cast<std::size_t>(h.numel()) * 4);
  return h;
}

// Poisoned device lists of shape [B, Hkv, Tq, kmax] and counts [B, Hkv, Tq]; idx and cnt keep the poison.
struct PoisonedLists {
  sa::HostTensor idx, cnt;
  DevCopy didx, dcnt;
  explicit PoisonedLists(const std::vector<std::int64_t>& shape)
      : idx(poisoned(shape)), cnt(poisoned({shape[0], shape[1], shape[2]})), didx(idx), dcnt(cnt) {}
  sa::TileLists out() const {
    return {sa::TensorView::contiguous(didx.ptr, sa::DType::i32, idx.shape(), sa::Device::cuda, 0),
            sa::TensorView::contiguous(dcnt.ptr, sa::DType::i32, cnt.shape(), sa::Device::cuda, 0)};
  }
};

int first_difference(const sa::HostTensor& gpu, const sa::HostTensor& cpu, std::string& where) {
  const auto* g = gpu.data<std::int32_t>();
  const auto* c = cpu.data<std::int32_t>();
  int bad = 0;
  for (std::int64_t i = 0; i < cpu.numel(); ++i) {
    if (g[i] == c[i]) continue;
    if (bad++ == 0) {
      std::string coord;
      std::int64_t rest = i;
      const auto& s = cpu.shape();
      for (int d = static_cast<int>(s.size()) - 1; d >= 0; --d) {
        coord = std::to_string(rest % s[static_cast<std::size_t>(d)]) + (coord.empty() ? "" : ", ") + coord;
        rest /= s[static_cast<std::size_t>(d)];
      }
      where = "[" + coord + "] gpu " + std::to_string(g[i]) + " cpu " + std::to_string(c[i]);
    }
  }
  return bad;
}

// The public function (its automatic choice), then each scoring kernel explicitly: the float64 one (where
// it applies) and the int8 screen.
using sa::detail::PooledScoring;
constexpr PooledScoring kKernels[3] = {PooledScoring::automatic, PooledScoring::exact_f64, PooledScoring::int8_tensor_cores};

struct Options {
  int r = 1, top_k = 4, kmax = 4;
  bool causal = false, force_local = true, force_block0 = false;
};

// Runs the CPU and the GPU selector on the same inputs and expects identical lists and counts; rep_bytes is
// SelectorTuning::pooled_rep_bytes of the GPU calls.
void expect_same(const std::string& name, const Input& q, const Input& k, const Options& opt, int rep_bytes = 0) {
  SCOPED_TRACE(name);
  const std::int64_t Tq = sa::ceil_div(q.L, sa::kTileQ);
  sa::PooledOptions o;
  o.representatives = opt.r, o.top_k = opt.top_k, o.causal = opt.causal, o.force_local = opt.force_local,
  o.force_block0 = opt.force_block0;
  sa::HostTensor idx(sa::DType::i32, {q.B, k.H, Tq, opt.kmax}), cnt(sa::DType::i32, {q.B, k.H, Tq});
  sa::pooled_select(q.view_at(q.buf.view().data, sa::Device::cpu), k.view_at(k.buf.view().data, sa::Device::cpu),
                    sa::TileLists{idx.view(), cnt.view()}, o);

  DevCopy dq(q.buf), dk(k.buf);
  const bool exact_applies = sa::detail::pooled_exact_applies(q.H / k.H * opt.r, q.D);
  for (int screen = 0; screen < 3; ++screen) {
    const char* names[3] = {"automatic", "float64 kernel", "int8 screen"};
    if (kKernels[screen] == PooledScoring::exact_f64 && !exact_applies) continue;
    const char* sname = names[screen];
    sa::HostTensor gidx = poisoned(idx.shape()), gcnt = poisoned(cnt.shape());
    DevCopy didx(gidx), dcnt(gcnt);
    const sa::TileLists out{sa::TensorView::contiguous(didx.ptr, sa::DType::i32, idx.shape(), sa::Device::cuda, 0),
                            sa::TensorView::contiguous(dcnt.ptr, sa::DType::i32, cnt.shape(), sa::Device::cuda, 0)};
    const sa::TensorView qv = q.view_at(dq.ptr, sa::Device::cuda), kv = k.view_at(dk.ptr, sa::Device::cuda);
    sa::detail::SelectorTuning tuning;
    tuning.pooled_scoring = kKernels[screen], tuning.pooled_rep_bytes = rep_bytes;
    if (screen == 0 && rep_bytes == 0) sa::pooled_select(qv, kv, out, o);  // the public function
    else sa::cuda_backend::pooled_select(qv, kv, out, o, tuning);
    cuda_ok(cudaDeviceSynchronize(), "pooled_select");
    didx.download(gidx);
    dcnt.download(gcnt);
    std::string where;
    const int bad_cnt = first_difference(gcnt, cnt, where);
    EXPECT_EQ(bad_cnt, 0) << name << ", " << sname << ": cnt differs at " << where;
    const int bad_idx = first_difference(gidx, idx, where);
    EXPECT_EQ(bad_idx, 0) << name << ", " << sname << ": " << bad_idx << " of " << idx.numel()
                          << " ids differ, first at " << where;
  }
}

// Key blocks whose scores differ only in their last bits, for every (b, kv head): block `src` takes the
// tokens of query tile `tile` (head h * group) so it scores high; for R4 its key groups 1..3 are copies of
// group 0 with one element nudged; blocks in `twins` are copies of `src` with one element nudged up or
// down (every third one an exact copy, a tie for the lower id).
void plant_near_ties(const Input& q, Input& k, std::int64_t group, std::int64_t src, std::int64_t tile,
                     const std::vector<std::int64_t>& twins, int r, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::int64_t span = sa::kBlockK / r;
  for (std::int64_t b = 0; b < k.B; ++b) {
    for (std::int64_t h = 0; h < k.H; ++h) {
      copy_tokens(k, b, src * sa::kBlockK, h, q, tile * sa::kTileQ, h * group, sa::kBlockK);
      for (int c = 1; c < r; ++c) {
        copy_tokens(k, b, src * sa::kBlockK + c * span, h, k, src * sa::kBlockK, h, span);
        k.nudge(k.index(b, src * sa::kBlockK + c * span + static_cast<std::int64_t>(rng() % span), h,
                        static_cast<std::int64_t>(rng() % k.D)),
                c % 2 == 1);
      }
      for (std::size_t i = 0; i < twins.size(); ++i) {
        copy_tokens(k, b, twins[i] * sa::kBlockK, h, k, src * sa::kBlockK, h, sa::kBlockK);
        if (i % 3 == 2) continue;
        k.nudge(k.index(b, twins[i] * sa::kBlockK + static_cast<std::int64_t>(rng() % sa::kBlockK), h,
                        static_cast<std::int64_t>(rng() % k.D)),
                i % 3 == 0);
      }
    }
  }
}

TEST(PooledGpu, RandomEqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const auto bf16 = sa::DType::bf16, f16 = sa::DType::f16, f32 = sa::DType::f32;
  std::uint64_t seed = 1000;
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    // tile16-like at a small Lk, GQA 16, both causal settings and both forcings
    for (bool causal : {false, true}) {
      const Input q = make_input(bf16, 2, 1000, 16, 128, seed++), k = make_input(bf16, 2, 3000, 1, 128, seed++);
      expect_same(R + "GQA16 Lq=1000 Lk=3000" + (causal ? " causal" : ""), q, k, {r, 5, 7, causal, true, true});
    }
    // Hq = Hkv, B = 3, Lk not a multiple of 128, no forcing
    {
      const Input q = make_input(bf16, 3, 333, 4, 128, seed++), k = make_input(bf16, 3, 1290, 4, 128, seed++);
      expect_same(R + "Hq=Hkv=4 B=3", q, k, {r, 3, 3, false, false, false});
    }
    // Lq = 1 and Lq > Lk causal (tiles that see nothing), f16
    {
      const Input q = make_input(f16, 1, 1, 8, 64, seed++), k = make_input(f16, 1, 700, 2, 64, seed++);
      expect_same(R + "Lq=1 causal f16", q, k, {r, 3, 4, true, true, false});
      const Input q2 = make_input(f16, 2, 900, 2, 64, seed++), k2 = make_input(f16, 2, 300, 1, 64, seed++);
      expect_same(R + "Lq>Lk causal f16", q2, k2, {r, 2, 2, true, true, true});
    }
    // f32 with D = 80 and D = 200 (two column chunks), top_k past the candidates
    {
      const Input q = make_input(f32, 2, 260, 6, 80, seed++), k = make_input(f32, 2, 650, 3, 80, seed++);
      expect_same(R + "f32 D=80 GQA2", q, k, {r, 9, 9, true, true, true});
      const Input q2 = make_input(f32, 1, 140, 2, 200, seed++), k2 = make_input(f32, 1, 1100, 1, 200, seed++);
      expect_same(R + "f32 D=200", q2, k2, {r, 4, 5, false, true, false});
    }
    // D = 30 (no 16-byte rows) and a misaligned view with padded rows: the scalar load paths
    {
      const Input q = make_input(bf16, 1, 300, 4, 30, seed++), k = make_input(bf16, 1, 777, 2, 30, seed++);
      expect_same(R + "D=30", q, k, {r, 3, 3, true, true, false});
      const Input q2 = make_input(bf16, 2, 257, 4, 128, seed++, 3, 1), k2 = make_input(bf16, 2, 900, 1, 128, seed++, 5, 3);
      expect_same(R + "misaligned padded views", q2, k2, {r, 4, 4, false, true, true});
      const Input q3 = make_input(f16, 1, 200, 2, 64, seed++, 64, 0), k3 = make_input(f16, 1, 640, 2, 64, seed++, 192, 0);
      expect_same(R + "aligned strided views (packed qkv)", q3, k3, {r, 2, 3, true, false, true});
    }
    // rows of means spread over two and four warps (bf16 D = 256, f32 D = 256: the int8 copy reduces
    // through shared memory), a row of 24 threads (f16 D = 96), and D past the int8 screen (264)
    {
      const Input q = make_input(bf16, 1, 260, 8, 256, seed++), k = make_input(bf16, 1, 1400, 2, 256, seed++);
      expect_same(R + "bf16 D=256", q, k, {r, 4, 4, true, true, false});
      const Input q2 = make_input(f32, 1, 200, 2, 256, seed++), k2 = make_input(f32, 1, 800, 1, 256, seed++);
      expect_same(R + "f32 D=256", q2, k2, {r, 3, 3, false, true, true});
      const Input q3 = make_input(f16, 2, 140, 4, 96, seed++), k3 = make_input(f16, 2, 1000, 4, 96, seed++);
      expect_same(R + "f16 D=96", q3, k3, {r, 3, 4, true, false, false});
      const Input q4 = make_input(bf16, 1, 129, 2, 264, seed++), k4 = make_input(bf16, 1, 700, 1, 264, seed++);
      expect_same(R + "bf16 D=264 (no int8 screen)", q4, k4, {r, 2, 3, false, true, false});
    }
    // query groups of more than 64 rows (R4: GQA 24 and 32 give 96 and 128 rows)
    {
      const Input q = make_input(bf16, 1, 300, 32, 64, seed++), k = make_input(bf16, 1, 1500, 1, 64, seed++);
      expect_same(R + "GQA32", q, k, {r, 4, 4, true, true, false});
      const Input q2 = make_input(bf16, 2, 129, 24, 64, seed++), k2 = make_input(bf16, 2, 2000, 1, 64, seed++);
      expect_same(R + "GQA24", q2, k2, {r, 6, 6, false, true, true});
    }
  }
}

// Every load width of the representatives kernel (16, 8 and 4-byte vectors, single elements) gives the CPU's
// lists: the automatic choice takes the narrowest vector on shapes this small, so each width is forced here,
// on views that allow 16 bytes (bf16 D = 128, f32 D = 80), only 8 or 4 (f16 D = 68, bf16 D = 30 + padding)
// or none (a view one element into its buffer). A bad width is an Error naming tuning.pooled_rep_bytes.
TEST(PooledGpu, RepresentativeLoadWidthsEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const auto bf16 = sa::DType::bf16, f16 = sa::DType::f16, f32 = sa::DType::f32;
  struct Case {
    const char* name;
    sa::DType dtype;
    std::int64_t B, Lq, Hq, Lk, Hkv, D, pad, shift;
    int top_k, kmax;
    bool causal, force_local, force_block0;
  };
  const Case cases[] = {
      {"bf16 D=128", bf16, 2, 300, 8, 1000, 2, 128, 0, 0, 4, 4, true, true, false},
      {"f32 D=80", f32, 1, 260, 4, 700, 2, 80, 0, 0, 3, 3, false, true, true},
      {"f16 D=68", f16, 1, 200, 4, 600, 1, 68, 0, 0, 3, 4, true, false, false},
      {"bf16 D=30 rows of 32", bf16, 1, 150, 2, 500, 1, 30, 2, 0, 2, 2, false, true, false},
      {"bf16 views one element in", bf16, 1, 140, 4, 520, 2, 64, 0, 1, 3, 3, true, true, true},
  };
  std::uint64_t seed = 7000;
  for (int bytes : {16, 8, 4, 1}) {
    for (int r : {1, 4}) {
      for (const Case& c : cases) {
        const Input q = make_input(c.dtype, c.B, c.Lq, c.Hq, c.D, seed++, c.pad, c.shift);
        const Input k = make_input(c.dtype, c.B, c.Lk, c.Hkv, c.D, seed++, c.pad, c.shift);
        expect_same("load width " + std::to_string(bytes) + " R" + std::to_string(r) + " " + c.name, q, k,
                    {r, c.top_k, c.kmax, c.causal, c.force_local, c.force_block0}, bytes);
      }
    }
  }
  const Input q = make_input(bf16, 1, 128, 2, 64, 7900), k = make_input(bf16, 1, 256, 1, 64, 7901);
  DevCopy dq(q.buf), dk(k.buf);
  const PoisonedLists lists({1, 1, 1, 2});
  sa::PooledOptions o;
  o.top_k = 2;
  for (int bad : {-1, 2, 32}) {
    sa::detail::SelectorTuning tuning;
    tuning.pooled_rep_bytes = bad;
    try {
      sa::cuda_backend::pooled_select(q.view_at(dq.ptr, sa::Device::cuda), k.view_at(dk.ptr, sa::Device::cuda),
                                      lists.out(), o, tuning);
      ADD_FAILURE() << "width " << bad << " accepted";
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), "tuning.pooled_rep_bytes") << e.what();
    }
  }
}

// The float64 scoring kernel asked for explicitly where it does not apply (more than 64 query rows per
// tile, or more staged rows than its shared memory holds): an Error naming q, the outputs untouched.
TEST(PooledGpu, ExactKernelRefusesLargeGroups) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  EXPECT_TRUE(sa::detail::pooled_exact_applies(64, 128));
  EXPECT_FALSE(sa::detail::pooled_exact_applies(65, 64));
  EXPECT_FALSE(sa::detail::pooled_exact_applies(32, 300));
  const Input q = make_input(sa::DType::bf16, 1, 256, 32, 64, 77), k = make_input(sa::DType::bf16, 1, 512, 1, 64, 78);
  DevCopy dq(q.buf), dk(k.buf);
  const PoisonedLists lists({1, 1, 2, 4});
  sa::PooledOptions o;
  o.representatives = 4, o.top_k = 4;  // 32 heads x 4 = 128 query rows
  sa::detail::SelectorTuning tuning;
  tuning.pooled_scoring = PooledScoring::exact_f64;
  try {
    sa::cuda_backend::pooled_select(q.view_at(dq.ptr, sa::Device::cuda), k.view_at(dk.ptr, sa::Device::cuda),
                                    lists.out(), o, tuning);
    ADD_FAILURE() << "expected an Error for 128 query rows";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "q");
    EXPECT_NE(std::string(e.what()).find("group * r = 128"), std::string::npos) << e.what();
  }
  cuda_ok(cudaDeviceSynchronize(), "after the refused call");
  sa::HostTensor after = poisoned(lists.idx.shape());
  lists.didx.download(after);
  std::string where;
  EXPECT_EQ(first_difference(after, lists.idx, where), 0) << "out.idx written at " << where;
}

// Enough (b, group, tile) jobs that each CTA takes all of a tile's key rows, several KV passes of 128
// rows each (R4 with 40 blocks: 160 rows).
TEST(PooledGpu, ManyTilesSeveralKeyPasses) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const Input q = make_input(sa::DType::bf16, 1, 600 * 128 - 50, 2, 32, 51 + r);
    const Input k = make_input(sa::DType::bf16, 1, 40 * 128 - 7, 2, 32, 61 + r);
    expect_same("R" + std::to_string(r) + " 1200 tiles, 40 blocks", q, k, {r, 6, 6, false, true, false});
    const Input kl = make_input(sa::DType::bf16, 1, 600 * 128, 2, 32, 71 + r);
    expect_same("R" + std::to_string(r) + " 1200 tiles causal Lk=Lq+50", q, kl, {r, 6, 8, true, true, true});
  }
}

// Block scores equal up to their last bits: the int8 screen cannot separate them, the float64
// evaluation must, and exact copies must rank by id.
TEST(PooledGpu, NearTiesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 2000;
  for (auto dtype : {sa::DType::bf16, sa::DType::f32, sa::DType::f16}) {
    for (int r : {1, 4}) {
      for (bool causal : {false, true}) {
        const std::string name = std::string(sa::dtype_name(dtype)) + " R" + std::to_string(r) + (causal ? " causal" : "");
        // GQA 16 (64 query rows for R4), 24 blocks of which 12 are near-copies of block 2; top-5 cuts
        // through them.
        Input q = make_input(dtype, 2, 512, 16, 128, seed++);
        Input k = make_input(dtype, 2, 24 * 128 - 40, 1, 128, seed++);
        plant_near_ties(q, k, 16, 2, 1, {3, 5, 6, 8, 9, 11, 13, 14, 17, 19, 20, 22}, r, seed++);
        expect_same(name + " GQA16", q, k, {r, 5, 5, causal, false, false});
        expect_same(name + " GQA16 forced", q, k, {r, 7, 8, causal, true, true});
        // Hq = Hkv = 2, a longer key sequence with the near-copies spread across the CTAs of a tile
        Input q2 = make_input(dtype, 1, 300, 2, 64, seed++);
        Input k2 = make_input(dtype, 1, 90 * 128, 2, 64, seed++);
        std::vector<std::int64_t> twins;
        for (std::int64_t j = 7; j < 90; j += 6) twins.push_back(j);
        plant_near_ties(q2, k2, 1, 4, 0, twins, r, seed++);
        expect_same(name + " Hq=Hkv, twins across CTAs", q2, k2, {r, 6, 6, causal, true, false});
      }
    }
  }
}

// Every query and every key equal: all pairs of all blocks tie, the candidate queue overflows and the
// blocks are ranked by id.
TEST(PooledGpu, AllEqualInputs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    Input q = make_input(sa::DType::bf16, 1, 1024, 16, 128, 31), k = make_input(sa::DType::bf16, 1, 4096, 1, 128, 32);
    for (std::int64_t i = 0; i < q.buf.numel(); ++i) q.set(i, 0.5f);
    for (std::int64_t i = 0; i < k.buf.numel(); ++i) k.set(i, -0.25f);
    expect_same("R" + std::to_string(r) + " all equal", q, k, {r, 5, 6, false, true, false});
    expect_same("R" + std::to_string(r) + " all equal causal", q, k, {r, 5, 6, true, false, true});
  }
}

// NaN and infinities rank as the CPU's sanitize says; huge and tiny f32 values leave the int8 screen
// without a scale (outside [2^-60, 2^40]) and must still give the CPU's lists.
TEST(PooledGpu, NonFiniteAndExtremeValues) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    Input q = make_input(sa::DType::bf16, 2, 500, 4, 64, 41), k = make_input(sa::DType::bf16, 2, 2000, 2, 64, 42);
    q.set(q.index(0, 5, 1, 3), NAN);                  // tile 0 of head 1: NaN dots for its group
    k.set(k.index(0, 300, 0, 7), INFINITY);           // block 2
    k.set(k.index(1, 1000, 1, 9), -INFINITY);         // block 7
    k.set(k.index(1, 1001, 1, 9), INFINITY);          // block 7 again: inf - inf = NaN in its mean
    q.set(q.index(1, 260, 2, 0), INFINITY);           // tile 2 of head 2
    q.set(q.index(1, 7, 0, 5), 0.0f);               // zeros and subnormals: the exact conversion's slow path
    q.set(q.index(1, 8, 0, 6), -0.0f);
    k.set(k.index(0, 900, 1, 2), 1e-40f);             // a bf16 subnormal
    k.set(k.index(1, 1500, 0, 3), -3e-39f);
    expect_same(R + "NaN / inf", q, k, {r, 6, 6, false, true, false});
    expect_same(R + "NaN / inf causal", q, k, {r, 6, 6, true, false, true});

    const Input qh = make_input(sa::DType::f32, 1, 300, 2, 128, 43, 0, 0, 3e18f);
    const Input kh = make_input(sa::DType::f32, 1, 1500, 1, 128, 44, 0, 0, 3e18f);
    expect_same(R + "huge f32 (no int8 scale)", qh, kh, {r, 4, 4, false, true, false});
    Input qz = make_input(sa::DType::f16, 1, 256, 2, 64, 47), kz = make_input(sa::DType::f16, 1, 900, 1, 64, 48);
    for (std::int64_t l = 0; l < 40; ++l) qz.set(qz.index(0, l, 0, l % 64), 0.0f);  // f16 zeros
    qz.set(qz.index(0, 50, 1, 1), 3e-7f);                                          // an f16 subnormal
    expect_same(R + "f16 zeros and subnormals", qz, kz, {r, 4, 4, true, true, false});
    Input qt = make_input(sa::DType::f32, 1, 300, 2, 128, 45, 0, 0, 1e-21f);
    qt.set(qt.index(0, 3, 1, 4), 1e-42f);             // f32 subnormal and zero inputs
    qt.set(qt.index(0, 4, 1, 4), 0.0f);
    const Input kt = make_input(sa::DType::f32, 1, 1500, 1, 128, 46, 0, 0, 1e-21f);
    expect_same(R + "tiny f32 (subnormal products)", qt, kt, {r, 4, 4, true, true, false});
  }
}

// Means at the edges of the two-level int8 copy: every token of a representative span is the same f32
// row, so the means are exactly those rows; their entries are m 2^-14 with |m| up to 16255 (the
// largest level, H = +-127) and the split points of M = 128 H + L (L = -64, 63), so the copy is exact
// and its bound is charged in full. Key blocks come in pairs that differ by one level in one column
// (score gaps of about 2^-14 of an entry), which only the float64 evaluation separates.
TEST(PooledGpu, LevelEdgesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const std::int64_t levels[] = {16255, -16255, 16254, -16254, 63, 64, -64, -65, 8191, -8192, 127, -128, 1, 0, 12345, -7777};
  std::mt19937_64 rng(77);
  auto level = [&] { return static_cast<float>(levels[rng() % 16]) * 0x1p-14f; };
  for (int r : {1, 4}) {
    const std::int64_t span = sa::kTileQ / r, D = 64;
    Input q = make_input(sa::DType::f32, 1, 512, 4, D, 90 + r), k = make_input(sa::DType::f32, 1, 16 * 128, 2, D, 95 + r);
    auto fill = [&](Input& x, bool twins) {
      std::vector<float> row(static_cast<std::size_t>(D));
      for (std::int64_t h = 0; h < x.H; ++h)
        for (std::int64_t l0 = 0; l0 < x.L; l0 += span) {
          const bool twin = twins && (l0 / sa::kBlockK) % 2 == 1;
          if (!twin) {
            for (auto& v : row) v = level();
            row[0] = (rng() % 2 ? 16255.0f : -16255.0f) * 0x1p-14f;  // every row reaches the largest level
          } else {
            const std::size_t c = 1 + rng() % (D - 1);
            row[c] = row[c] + (row[c] > 0.0f ? -0x1p-14f : 0x1p-14f);  // one level towards zero
          }
          for (std::int64_t l = l0; l < std::min(x.L, l0 + span); ++l)
            for (std::int64_t d = 0; d < D; ++d) x.set(x.index(0, l, h, d), row[static_cast<std::size_t>(d)]);
        }
    };
    fill(q, false);
    fill(k, true);
    expect_same("R" + std::to_string(r) + " level edges", q, k, {r, 5, 6, false, false, false});
    expect_same("R" + std::to_string(r) + " level edges causal", q, k, {r, 3, 4, true, true, false});
  }
}

// Poisoned device lists for one call of the public selector; launch() queues the call on o.stream.
struct GpuCall {
  sa::HostTensor idx, cnt;
  std::unique_ptr<DevCopy> didx, dcnt;
  GpuCall(const Input& q, const Input& k, int kmax) {
    const std::int64_t Tq = sa::ceil_div(q.L, sa::kTileQ);
    idx = poisoned({q.B, k.H, Tq, kmax});
    cnt = poisoned({q.B, k.H, Tq});
    didx = std::make_unique<DevCopy>(idx);
    dcnt = std::make_unique<DevCopy>(cnt);
  }
  GpuCall(const Input& q, const Input& k, const DevCopy& dq, const DevCopy& dk, const sa::PooledOptions& o, int kmax)
      : GpuCall(q, k, kmax) {
    launch(q, k, dq, dk, o);
  }
  void launch(const Input& q, const Input& k, const DevCopy& dq, const DevCopy& dk, const sa::PooledOptions& o) {
    const sa::TileLists out{sa::TensorView::contiguous(didx->ptr, sa::DType::i32, idx.shape(), sa::Device::cuda, 0),
                            sa::TensorView::contiguous(dcnt->ptr, sa::DType::i32, cnt.shape(), sa::Device::cuda, 0)};
    sa::pooled_select(q.view_at(dq.ptr, sa::Device::cuda), k.view_at(dk.ptr, sa::Device::cuda), out, o);
  }
  // Downloads (after the caller's synchronisation) and compares with the CPU's lists.
  void expect_cpu(const std::string& name, const Input& q, const Input& k, sa::PooledOptions o) {
    didx->download(idx);
    dcnt->download(cnt);
    sa::HostTensor ridx(sa::DType::i32, idx.shape()), rcnt(sa::DType::i32, cnt.shape());
    o.stream = nullptr;
    sa::pooled_select(q.view_at(q.buf.view().data, sa::Device::cpu), k.view_at(k.buf.view().data, sa::Device::cpu),
                      sa::TileLists{ridx.view(), rcnt.view()}, o);
    std::string where;
    EXPECT_EQ(first_difference(cnt, rcnt, where), 0) << name << ": cnt differs at " << where;
    EXPECT_EQ(first_difference(idx, ridx, where), 0) << name << ": idx differs at " << where;
  }
};

// The scratch is cached per (device, stream): calls queued back to back on one stream with growing
// and shrinking shapes (the growth waits for the earlier calls), and calls on two streams at once,
// must each give the CPU's lists.
TEST(PooledGpu, ScratchAcrossShapesAndStreams) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  cudaStream_t s1 = nullptr, s2 = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_ok(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "cudaStreamCreate");
  const Input qa = make_input(sa::DType::bf16, 1, 300, 4, 64, 301), ka = make_input(sa::DType::bf16, 1, 700, 1, 64, 302);
  const Input qb = make_input(sa::DType::bf16, 2, 900, 8, 128, 303), kb = make_input(sa::DType::bf16, 2, 9000, 2, 128, 304);
  const Input qc = make_input(sa::DType::f16, 1, 200, 2, 64, 305), kc = make_input(sa::DType::f16, 1, 500, 2, 64, 306);
  DevCopy dqa(qa.buf), dka(ka.buf), dqb(qb.buf), dkb(kb.buf), dqc(qc.buf), dkc(kc.buf);
  for (int r : {1, 4}) {
    sa::PooledOptions o;
    o.representatives = r, o.top_k = 4;
    o.stream = s1;
    GpuCall a(qa, ka, dqa, dka, o, 4), b(qb, kb, dqb, dkb, o, 4), c(qc, kc, dqc, dkc, o, 5);
    o.stream = s2;
    GpuCall b2(qb, kb, dqb, dkb, o, 6), a2(qa, ka, dqa, dka, o, 4);
    cuda_ok(cudaDeviceSynchronize(), "queued calls");
    const std::string R = "R" + std::to_string(r) + " ";
    a.expect_cpu(R + "small on s1", qa, ka, o);
    b.expect_cpu(R + "large on s1 (growth)", qb, kb, o);
    c.expect_cpu(R + "small again on s1", qc, kc, o);
    b2.expect_cpu(R + "large on s2", qb, kb, o);
    a2.expect_cpu(R + "small on s2", qa, ka, o);
  }
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

// Captured into a CUDA graph (the call takes stream-ordered memory inside the capture, so the graph owns
// its scratch) on a stream without cached scratch, and on one with it; replayed twice, the second time
// after a larger call on the same stream has grown (freed and replaced) the stream's cached scratch.
TEST(PooledGpu, GraphCapture) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Input q = make_input(sa::DType::bf16, 2, 500, 8, 128, 401), k = make_input(sa::DType::bf16, 2, 3000, 2, 128, 402);
  const Input qbig = make_input(sa::DType::bf16, 2, 2000, 8, 128, 403), kbig = make_input(sa::DType::bf16, 2, 12000, 2, 128, 404);
  DevCopy dq(q.buf), dk(k.buf), dqbig(qbig.buf), dkbig(kbig.buf);
  for (int round = 0; round < 2; ++round) {
    cudaStream_t s = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    sa::PooledOptions o;
    o.representatives = round == 0 ? 4 : 1, o.top_k = 5, o.stream = s;
    if (round == 1) {  // the stream's scratch exists before the capture
      GpuCall warm(q, k, dq, dk, o, 5);
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
      call.expect_cpu(std::string(round == 0 ? "captured without scratch" : "captured with scratch") + ", replay " +
                          std::to_string(rep),
                      q, k, o);
      std::vector<std::int32_t> poison(static_cast<std::size_t>(call.idx.numel()), 0x5a5a5a5a);
      cuda_ok(cudaMemcpy(call.didx->ptr, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice), "re-poison");
      if (rep == 0) {  // grows the stream's cached scratch
        GpuCall big(qbig, kbig, dqbig, dkbig, o, 5);
        cuda_ok(cudaStreamSynchronize(s), "larger call");
        big.expect_cpu("larger call after the capture", qbig, kbig, o);
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// Small enough for compute-sanitizer: both tile configurations, both load paths, two query chunks,
// near-ties and a queue overflow.
TEST(PooledGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (int r : {1, 4}) {
    const std::string R = "R" + std::to_string(r) + " ";
    Input q = make_input(sa::DType::bf16, 2, 200, 4, 64, 81), k = make_input(sa::DType::bf16, 2, 700, 2, 64, 82);
    plant_near_ties(q, k, 2, 1, 0, {2, 3, 4}, r, 83);
    expect_same(R + "sanitizer near-ties", q, k, {r, 3, 4, true, true, true});
    const Input q2 = make_input(sa::DType::f16, 1, 130, 24, 36, 84, 2, 1), k2 = make_input(sa::DType::f16, 1, 390, 1, 36, 85);
    expect_same(R + "sanitizer GQA24 scalar", q2, k2, {r, 2, 2, false, true, false});
    Input q3 = make_input(sa::DType::bf16, 1, 256, 16, 32, 86), k3 = make_input(sa::DType::bf16, 1, 1024, 1, 32, 87);
    for (std::int64_t i = 0; i < q3.buf.numel(); ++i) q3.set(i, 1.0f);
    for (std::int64_t i = 0; i < k3.buf.numel(); ++i) k3.set(i, 1.0f);
    expect_same(R + "sanitizer all equal", q3, k3, {r, 3, 3, false, true, false});
    // causal with more than one slab of key rows per tile: the early tiles' later slabs hold no candidate
    const Input q4 = make_input(sa::DType::bf16, 1, 9000, 2, 32, 88), k4 = make_input(sa::DType::bf16, 1, 9000, 1, 32, 89);
    expect_same(R + "sanitizer causal, empty slabs", q4, k4, {r, 4, 4, true, true, false});
  }
}

}  // namespace
