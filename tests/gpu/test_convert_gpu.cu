// GPU tests of query_lists_to_tile_lists (and, at the end, block_bits_to_tile_lists) on device tensors: ids, order, counts and -1 padding equal to
// the CPU function's on random lists (empty slots, empty queries, an empty tile, a block every query
// chose), on awkward shapes (Lq = 1, 17, 1013; Lk not a multiple of 128; causal with Lq < Lk and
// Lq > Lk; Hkv > 1; B > 1 with different lists; Tk past one compaction round; no slots at all),
// poisoned outputs, strided lists and outputs, a caller's stream, the trusted path, and errors: the
// same argument and message as the CPU function for ids out of range, values below -1, repeated ids,
// a union over Kmax, and the order in which several faults are reported.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

constexpr std::int32_t kPoison = 0x5a5a5a5a;

// convert(options) with options.stream a stream of its own, synchronised and destroyed afterwards.
template <class Convert>
void convert_on_own_stream(Convert convert) {
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  sa::ConvertOptions options;
  options.stream = stream;
  convert(options);
  cuda_ok(cudaStreamSynchronize(stream), "conversion on the stream");
  cuda_ok(cudaStreamDestroy(stream), "stream");
}

sa::ProblemShape shape(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hkv, bool causal = false) {
  sa::ProblemShape p;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hkv * 2, p.Hkv = Hkv, p.D = 128, p.causal = causal;
  return p;
}

struct Tiles {
  sa::HostTensor idx, cnt;
};

Tiles poisoned_tiles(const sa::ProblemShape& p, std::int64_t kmax) {
  Tiles t{sa::HostTensor(sa::DType::i32, {p.B, p.Hkv, p.Tq(), kmax}), sa::HostTensor(sa::DType::i32, {p.B, p.Hkv, p.Tq()})};
  std::fill(t.idx.data<std::int32_t>(), t.idx.data<std::int32_t>() + t.idx.numel(), kPoison);
  std::fill(t.cnt.data<std::int32_t>(), t.cnt.data<std::int32_t>() + t.cnt.numel(), kPoison);
  return t;
}

Tiles cpu_convert(const sa::HostTensor& lists, const sa::ProblemShape& p, std::int64_t kmax) {
  Tiles t = poisoned_tiles(p, kmax);
  sa::query_lists_to_tile_lists(sa::QueryLists{lists.view()}, sa::TileLists{t.idx.view(), t.cnt.view()}, p);
  return t;
}

/// The device conversion of `lists` into poisoned device outputs; returns them downloaded.
Tiles gpu_convert(const sa::HostTensor& lists, const sa::ProblemShape& p, std::int64_t kmax,
                  const sa::ConvertOptions& options = {}) {
  Tiles t = poisoned_tiles(p, kmax);
  DeviceBuffer dl(lists), di(t.idx), dc(t.cnt);
  sa::query_lists_to_tile_lists(sa::QueryLists{dl.view}, sa::TileLists{di.view, dc.view}, p, options);
  cuda_ok(cudaDeviceSynchronize(), "conversion");
  di.download(t.idx);
  dc.download(t.cnt);
  return t;
}

void expect_equal(const Tiles& want, const Tiles& got, const std::string& what) {
  ASSERT_EQ(want.idx.numel(), got.idx.numel()) << what;
  const auto* a = want.idx.data<std::int32_t>();
  const auto* b = got.idx.data<std::int32_t>();
  const std::int64_t kmax = want.idx.shape()[3];
  for (std::int64_t e = 0; e < want.idx.numel(); ++e)
    ASSERT_EQ(a[e], b[e]) << what << ": idx differs at tile row " << e / std::max<std::int64_t>(kmax, 1) << ", slot "
                          << e % std::max<std::int64_t>(kmax, 1);
  for (std::int64_t e = 0; e < want.cnt.numel(); ++e)
    ASSERT_EQ(want.cnt.data<std::int32_t>()[e], got.cnt.data<std::int32_t>()[e]) << what << ": cnt differs at tile " << e;
}

std::int64_t largest_union(const Tiles& t) {
  const auto* c = t.cnt.data<std::int32_t>();
  return t.cnt.numel() ? *std::max_element(c, c + t.cnt.numel()) : 0;
}

struct Case {
  const char* name;
  std::int64_t B, Lq, Lk, Hkv, kq;
  bool causal = false, empty_tile = false, popular = false;
};

// Every shape against the CPU with a roomy Kmax (padding checked), the tightest Kmax the unions
// allow, and the trusted path.
void check_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name);
  const sa::ProblemShape p = shape(c.B, c.Lq, c.Lk, c.Hkv, c.causal);
  const sa::HostTensor lists = st::query_lists::random_lists(p, c.kq, c.empty_tile, c.popular, seed);
  const std::int64_t roomy = p.Tk() + 5;
  const Tiles want = cpu_convert(lists, p, roomy);
  const std::int64_t tight = largest_union(want);
  const Tiles want_tight = cpu_convert(lists, p, tight);
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_convert(lists, p, roomy), "roomy Kmax"));
  ASSERT_NO_FATAL_FAILURE(expect_equal(want_tight, gpu_convert(lists, p, tight), "tight Kmax"));
  ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_convert(lists, p, roomy, trusted), "trusted"));
}


TEST(ConvertGpu, EqualsCpuOnRandomLists) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"one tile", 1, 128, 256, 1, 4},
      {"Lq = 1", 1, 1, 300, 1, 3},
      {"Lq = 17, Lk = 1000", 2, 17, 1000, 1, 6},
      {"Lq = 1013, Hkv = 2, B = 3", 3, 1013, 1100, 2, 5},
      {"query-long slice: Hkv = 8, 16 of 256", 1, 1024, 32768, 8, 16},
      {"empty tile and popular block", 2, 640, 2048, 2, 7, false, true, true},
      {"causal Lq < Lk", 2, 300, 1500, 2, 4, true},
      {"causal Lq > Lk", 1, 700, 260, 1, 3, true},
      {"Tk = 2 (Lk = 129)", 1, 513, 129, 1, 4},
      {"long slots, Tk = 40", 1, 256, 5000, 1, 40},
  };
  std::uint64_t seed = 11;
  for (const Case& c : cases) ASSERT_NO_FATAL_FAILURE(check_case(c, seed++));
}

// Tk = 8594 blocks: the bit set has 269 words, more than one compaction round of 256 threads, and the
// unions (up to 128 x 96 ids) span both rounds.
TEST(ConvertGpu, EqualsCpuPastOneCompactionRound) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  ASSERT_NO_FATAL_FAILURE(check_case({"Tk = 8594", 2, 300, 1100000, 1, 96}, 5));
}

TEST(ConvertGpu, NoSelectedBlock) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 200, 512, 2);
  sa::HostTensor empty(sa::DType::i32, {p.B, p.Hkv, p.Lq, 3});
  std::fill(empty.data<std::int32_t>(), empty.data<std::int32_t>() + empty.numel(), -1);
  ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_convert(empty, p, 3), gpu_convert(empty, p, 3), "every slot -1"));
  // No slots at all (Kq = 0; the CPU path cannot take a host tensor without storage): every tile empty.
  const Tiles got = gpu_convert(sa::HostTensor(sa::DType::i32, {p.B, p.Hkv, p.Lq, 0}), p, 3);
  for (std::int64_t e = 0; e < got.idx.numel(); ++e) ASSERT_EQ(got.idx.data<std::int32_t>()[e], -1) << e;
  for (std::int64_t e = 0; e < got.cnt.numel(); ++e) ASSERT_EQ(got.cnt.data<std::int32_t>()[e], 0) << e;
}

// Lists that are a slice of wider rows (row stride Kq + 3) and outputs with padded rows and a
// transposed count tensor, converted on a stream of the caller.
TEST(ConvertGpu, StridedTensorsOnAStream) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 400, 3000, 3);
  const std::int64_t kq = 6, wide = kq + 3, kmax = p.Tk() + 1, kpad = kmax + 4;
  const sa::HostTensor packed = st::query_lists::random_lists(p, kq, false, false, 77);
  sa::HostTensor wide_lists(sa::DType::i32, {p.B, p.Hkv, p.Lq, wide});
  std::fill(wide_lists.data<std::int32_t>(), wide_lists.data<std::int32_t>() + wide_lists.numel(), 12345);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r)
    std::memcpy(wide_lists.data<std::int32_t>() + r * wide, packed.data<std::int32_t>() + r * kq, kq * 4);
  const Tiles want = cpu_convert(packed, p, kmax);

  sa::HostTensor out_idx(sa::DType::i32, {p.B, p.Hkv, p.Tq(), kpad}), out_cnt(sa::DType::i32, {p.Tq(), p.Hkv, p.B});
  std::fill(out_idx.data<std::int32_t>(), out_idx.data<std::int32_t>() + out_idx.numel(), kPoison);
  std::fill(out_cnt.data<std::int32_t>(), out_cnt.data<std::int32_t>() + out_cnt.numel(), kPoison);
  DeviceBuffer dl(wide_lists), di(out_idx), dc(out_cnt);
  sa::TensorView lv = dl.view;
  lv.shape[3] = kq;  // strides stay those of the wide rows
  sa::TensorView iv = di.view;
  iv.shape[3] = kmax;
  sa::TensorView cv = dc.view;  // [Tq, Hkv, B] seen as [B, Hkv, Tq]
  cv.shape = {p.B, p.Hkv, p.Tq()};
  cv.stride = {1, p.B, p.B * p.Hkv};
  convert_on_own_stream([&](const sa::ConvertOptions& options) {
    sa::query_lists_to_tile_lists(sa::QueryLists{lv}, sa::TileLists{iv, cv}, p, options);
  });
  di.download(out_idx);
  dc.download(out_cnt);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Tq(); ++r) {
    const std::int64_t b = r / (p.Hkv * p.Tq()), g = r / p.Tq() % p.Hkv, t = r % p.Tq();
    const auto* got = out_idx.data<std::int32_t>() + r * kpad;
    const auto* exp = want.idx.data<std::int32_t>() + r * kmax;
    for (std::int64_t k = 0; k < kmax; ++k) ASSERT_EQ(exp[k], got[k]) << "tile " << r << " slot " << k;
    for (std::int64_t k = kmax; k < kpad; ++k) ASSERT_EQ(got[k], kPoison) << "padding of tile " << r << " was written";
    ASSERT_EQ(want.cnt.data<std::int32_t>()[r], out_cnt.data<std::int32_t>()[(t * p.Hkv + g) * p.B + b]) << "tile " << r;
  }
}

/// Runs the same conversion on the CPU and on the device: both must throw, with the same argument and
/// the same text, and the CPU's must be `want_arg` and contain `want_text`.
template <class Cpu, class Gpu>
void expect_same_error_of(Cpu&& cpu, Gpu&& gpu, const std::string& want_arg, const std::string& want_text) {
  std::optional<sa::Error> cpu_err, gpu_err;
  try {
    cpu();
  } catch (const sa::Error& e) {
    cpu_err = e;
  }
  try {
    gpu();
  } catch (const sa::Error& e) {
    gpu_err = e;
  }
  ASSERT_TRUE(cpu_err.has_value()) << "the CPU accepted input the test made invalid";
  ASSERT_TRUE(gpu_err.has_value()) << "the device accepted input the CPU rejects: " << cpu_err->what();
  EXPECT_EQ(cpu_err->argument(), want_arg) << cpu_err->what();
  EXPECT_NE(std::string(cpu_err->what()).find(want_text), std::string::npos) << cpu_err->what();
  EXPECT_EQ(gpu_err->argument(), cpu_err->argument());
  EXPECT_STREQ(gpu_err->what(), cpu_err->what());
}

/// The QueryLists conversion of `lists` into Kmax = kmax on both.
void expect_same_error(const sa::HostTensor& lists, const sa::ProblemShape& p, std::int64_t kmax,
                       const std::string& want_arg, const std::string& want_text) {
  expect_same_error_of([&] { cpu_convert(lists, p, kmax); }, [&] { gpu_convert(lists, p, kmax); }, want_arg, want_text);
}

std::int32_t& at(sa::HostTensor& l, const sa::ProblemShape& p, std::int64_t b, std::int64_t g, std::int64_t i,
                 std::int64_t s) {
  const std::int64_t kq = l.shape()[3];
  return l.data<std::int32_t>()[((b * p.Hkv + g) * p.Lq + i) * kq + s];
}

TEST(ConvertGpu, InvalidListsReportedAsOnTheCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 1013, 1100, 2);  // Tk = 9
  const std::int64_t kq = 5, kmax = p.Tk();
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 6; ++trial) {
    const sa::HostTensor base = st::query_lists::random_lists(p, kq, false, false, 100 + trial);
    const std::int64_t b = rng() % p.B, g = rng() % p.Hkv, i = rng() % p.Lq, s = 1 + rng() % (kq - 1);
    {
      sa::HostTensor l = base;
      at(l, p, b, g, i, s) = static_cast<std::int32_t>(p.Tk() + rng() % 50);
      ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, kmax, "in.idx", "is out of range"));
    }
    {
      sa::HostTensor l = base;
      at(l, p, b, g, i, s) = -2 - static_cast<std::int32_t>(rng() % 1000);
      ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, kmax, "in.idx", "only -1 may mark an empty slot"));
    }
    {
      sa::HostTensor l = base;
      at(l, p, b, g, i, 0) = 4;
      at(l, p, b, g, i, s) = 4;
      ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, kmax, "in.idx", "duplicate block id 4"));
    }
  }
}

// Several faults: the first in row-major order wins, a repeat before a range fault in the same row
// is the one reported, and a list fault anywhere comes before a capacity fault in an earlier tile.
TEST(ConvertGpu, FirstFaultWins) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 600, 4000, 2);  // Tk = 32, Tq = 5
  const std::int64_t kq = 6;
  sa::HostTensor base = st::query_lists::random_lists(p, kq, false, false, 9);
  {
    sa::HostTensor l = base;
    at(l, p, 1, 1, 500, 2) = 99;   // later row
    at(l, p, 1, 0, 20, 4) = -7;    // earlier row: reported
    ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, p.Tk(), "in.idx", "invalid value -7 at [1, 0, 20, 4]"));
  }
  {
    sa::HostTensor l = base;
    at(l, p, 0, 1, 3, 0) = 7;
    at(l, p, 0, 1, 3, 1) = 7;   // repeat at slot 1
    at(l, p, 0, 1, 3, 3) = 500;  // range fault later in the same row
    ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, p.Tk(), "in.idx", "duplicate block id 7 at [0, 1, 3, 1]"));
  }
  {
    // Kmax 1 overflows in tile [0, 0, 0]; the id out of range sits in the last row.
    sa::HostTensor l = base;
    at(l, p, 1, 1, p.Lq - 1, kq - 1) = 32;
    ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, 1, "in.idx", "block id 32 at [1, 1, 599, 5] is out of range"));
  }
}

TEST(ConvertGpu, UnionOverCapacity) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 700, 2000, 2);  // Tk = 16, Tq = 6
  const std::int64_t kq = 3;
  // Every query picks blocks 0..2 except one query of tile [1, 1, 4] (and, later, of [1, 1, 5]) that
  // adds more: only those tiles overflow a Kmax of 3, and the first is the one reported.
  sa::HostTensor l(sa::DType::i32, {p.B, p.Hkv, p.Lq, kq});
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r)
    for (std::int64_t s = 0; s < kq; ++s) l.data<std::int32_t>()[r * kq + s] = static_cast<std::int32_t>(s);
  at(l, p, 1, 1, 4 * 128 + 77, 1) = 9;
  at(l, p, 1, 1, 4 * 128 + 78, 2) = 11;
  at(l, p, 1, 1, 5 * 128 + 3, 0) = 13;
  ASSERT_NO_FATAL_FAILURE(expect_same_error(l, p, 3, "out.idx", "the union of tile [1, 1, 4] holds 5 blocks but Kmax is 3"));
  // With room for the unions the same lists convert as on the CPU.
  ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_convert(l, p, 5), gpu_convert(l, p, 5), "Kmax 5"));
}

TEST(ConvertGpu, TrustedNeedsRoomForTheLargestUnion) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(1, 300, 4096, 1);  // Tk = 32
  const sa::HostTensor lists = st::query_lists::random_lists(p, 4, false, false, 21);
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  try {
    gpu_convert(lists, p, 31, trusted);
    FAIL() << "a trusted conversion with Kmax below min(Tk, 128 * Kq) must be refused";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "out.idx") << e.what();
    EXPECT_NE(std::string(e.what()).find("32 ids per tile"), std::string::npos) << e.what();
  }
  // Trusted lists with ids out of range are ignored, never written out of bounds: the other ids
  // convert as the CPU converts the lists without them.
  sa::HostTensor bad = lists, clean = lists;
  at(bad, p, 0, 0, 5, 1) = 1 << 30;
  at(bad, p, 0, 0, 6, 2) = -9;
  at(clean, p, 0, 0, 5, 1) = -1;
  at(clean, p, 0, 0, 6, 2) = -1;
  ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_convert(clean, p, 32), gpu_convert(bad, p, 32, trusted), "trusted, bad ids"));
}

TEST(ConvertGpu, DeviceMismatchNamesTheArgument) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(1, 128, 256, 1);
  const sa::HostTensor lists = st::query_lists::random_lists(p, 2, false, false, 1);
  Tiles host = poisoned_tiles(p, 2);
  DeviceBuffer dl(lists), dc(host.cnt);
  try {
    sa::query_lists_to_tile_lists(sa::QueryLists{dl.view}, sa::TileLists{host.idx.view(), dc.view}, p);
    FAIL() << "device lists into a host out.idx must be refused";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "out.idx") << e.what();
  }
}

// Small enough for compute-sanitizer (memcheck, racecheck, synccheck): the checked and the trusted
// kernel on a partial tile, Hkv = 2, -1 slots, a tight Kmax, then an error path.
TEST(ConvertGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 200, 1000, 2, true);
  const sa::HostTensor lists = st::query_lists::random_lists(p, 5, false, true, 8);
  const Tiles want = cpu_convert(lists, p, p.Tk());
  ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_convert(lists, p, p.Tk()), "checked"));
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_convert(lists, p, p.Tk(), trusted), "trusted"));
  const std::int64_t tight = largest_union(want);
  ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_convert(lists, p, tight), gpu_convert(lists, p, tight), "tight"));
  sa::HostTensor bad = lists;
  at(bad, p, 1, 0, 150, 4) = 5;  // Tk = 8
  at(bad, p, 1, 0, 150, 3) = 5;
  ASSERT_NO_FATAL_FAILURE(expect_same_error(bad, p, p.Tk(), "in.idx", "duplicate block id 5"));
}

// ---- BlockBits -> TileLists ------------------------------------------------------------------------

/// Random bit sets [B, G, Tq, W]: each word with density `density` (0..1), bits at or past Tk zero,
/// tile 1 of every (b, g) empty; G is Hkv unless `G` says otherwise.
sa::HostTensor random_bits(const sa::ProblemShape& p, std::int64_t G, double density, std::uint64_t seed) {
  const std::int64_t W = (p.Tk() + 31) / 32;
  sa::HostTensor bits(sa::DType::u32, {p.B, G, p.Tq(), W});
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution on(density);
  auto* w = bits.data<std::uint32_t>();
  for (std::int64_t r = 0; r < p.B * G * p.Tq(); ++r)
    for (std::int64_t x = 0; x < W; ++x) {
      std::uint32_t word = 0;
      for (int bit = 0; bit < 32; ++bit)
        if (x * 32 + bit < p.Tk() && r % p.Tq() != 1 && on(rng)) word |= 1u << bit;
      w[r * W + x] = word;
    }
  return bits;
}

Tiles poisoned_tiles_g(const sa::ProblemShape& p, std::int64_t G, std::int64_t kmax) {
  Tiles t{sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq(), kmax}), sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq()})};
  std::fill(t.idx.data<std::int32_t>(), t.idx.data<std::int32_t>() + t.idx.numel(), kPoison);
  std::fill(t.cnt.data<std::int32_t>(), t.cnt.data<std::int32_t>() + t.cnt.numel(), kPoison);
  return t;
}

Tiles cpu_bits(const sa::HostTensor& bits, const sa::ProblemShape& p, std::int64_t kmax) {
  Tiles t = poisoned_tiles_g(p, bits.shape()[1], kmax);
  sa::block_bits_to_tile_lists(sa::BlockBits{bits.view()}, sa::TileLists{t.idx.view(), t.cnt.view()}, p);
  return t;
}

Tiles gpu_bits(const sa::HostTensor& bits, const sa::ProblemShape& p, std::int64_t kmax,
               const sa::ConvertOptions& options = {}) {
  Tiles t = poisoned_tiles_g(p, bits.shape()[1], kmax);
  DeviceBuffer db(bits), di(t.idx), dc(t.cnt);
  sa::block_bits_to_tile_lists(sa::BlockBits{db.view}, sa::TileLists{di.view, dc.view}, p, options);
  cuda_ok(cudaDeviceSynchronize(), "bits conversion");
  di.download(t.idx);
  dc.download(t.cnt);
  return t;
}

// A shape of bit sets or tile lists (G lists per batch: Hkv or Hq) and the density of its selection.
struct BitsCase {
  const char* name;
  std::int64_t B, Lq, Lk, Hkv, G;
  double density;
};

// Shapes with Tk below, at and past one word and past one warp round of 32 words (Tk 1094: 35 words);
// G = Hkv and G = Hq; densities from empty to full; roomy, tight and trusted capacities.
TEST(ConvertGpu, BitsEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const BitsCase cases[] = {
      {"Tk 1", 1, 200, 100, 1, 1, 0.5},         {"Tk 9, Hkv 2", 2, 1013, 1100, 2, 2, 0.3},
      {"Tk 32, full", 1, 300, 4096, 1, 1, 1.0}, {"Tk 33, G = Hq", 2, 256, 4100, 2, 4, 0.2},
      {"Tk 1094 (35 words)", 1, 640, 140000, 1, 1, 0.05}, {"empty", 1, 129, 5000, 2, 2, 0.0},
  };
  std::uint64_t seed = 40;
  for (const BitsCase& c : cases) {
    SCOPED_TRACE(c.name);
    const sa::ProblemShape p = shape(c.B, c.Lq, c.Lk, c.Hkv);
    const sa::HostTensor bits = random_bits(p, c.G, c.density, ++seed);
    const std::int64_t roomy = p.Tk() + 3;
    const Tiles want = cpu_bits(bits, p, roomy);
    const std::int64_t tight = std::max<std::int64_t>(largest_union(want), 1);  // a host tensor needs storage
    sa::ConvertOptions trusted;
    trusted.trusted = true;
    ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_bits(bits, p, roomy), "roomy Kmax"));
    ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_bits(bits, p, tight), gpu_bits(bits, p, tight), "tight Kmax"));
    ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_bits(bits, p, roomy, trusted), "trusted"));
  }
}

void expect_same_bits_error(const sa::HostTensor& bits, const sa::ProblemShape& p, std::int64_t kmax,
                            const std::string& want_arg, const std::string& want_text) {
  expect_same_error_of([&] { cpu_bits(bits, p, kmax); }, [&] { gpu_bits(bits, p, kmax); }, want_arg, want_text);
}

// Stray bits (the first row in row-major order, its lowest stray bit) before any row over capacity;
// a trusted conversion drops stray bits and needs Kmax >= Tk.
TEST(ConvertGpu, BitsErrorsAsOnTheCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 600, 1100, 2);  // Tk = 9, Tq = 5, one word
  const sa::HostTensor base = random_bits(p, p.Hkv, 0.3, 7);
  auto word = [&](sa::HostTensor& b, std::int64_t bb, std::int64_t g, std::int64_t t) -> std::uint32_t& {
    return b.data<std::uint32_t>()[(bb * p.Hkv + g) * p.Tq() + t];
  };
  {
    sa::HostTensor b = base;
    word(b, 1, 1, 4) |= 1u << 20;
    word(b, 1, 0, 2) |= (1u << 12) | (1u << 30);  // earlier row: bit 12 (block 12) reported
    ASSERT_NO_FATAL_FAILURE(expect_same_bits_error(b, p, p.Tk(), "in.bits", "stray bit 12 (block 12) set in the word at [1, 0, 2, 0]"));
  }
  {
    sa::HostTensor b = base;
    word(b, 0, 1, 3) = 0x1ffu;  // 9 blocks: over a Kmax of 8
    word(b, 1, 1, 0) = 0x1ffu;
    ASSERT_NO_FATAL_FAILURE(expect_same_bits_error(b, p, 8, "out.idx", "the bit set of tile [0, 1, 3] holds 9 blocks but Kmax is 8"));
    word(b, 1, 1, 4) |= 1u << 9;  // a stray bit in a later row still comes first
    ASSERT_NO_FATAL_FAILURE(expect_same_bits_error(b, p, 8, "in.bits", "stray bit 9 (block 9)"));
  }
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  try {
    gpu_bits(base, p, p.Tk() - 1, trusted);
    FAIL() << "a trusted conversion with Kmax below Tk must be refused";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "out.idx") << e.what();
  }
  sa::HostTensor stray = base;
  word(stray, 0, 0, 0) |= 0xfffffe00u;
  ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_bits(base, p, p.Tk()), gpu_bits(stray, p, p.Tk(), trusted), "trusted, stray bits"));
}

// Bits that are a column slice of wider rows, outputs with padded rows, on a caller's stream.
TEST(ConvertGpu, BitsStridedOnAStream) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 300, 9000, 2);  // Tk = 71, W = 3
  const std::int64_t W = 3, wide = W + 2, kmax = p.Tk(), kpad = kmax + 4;
  const sa::HostTensor packed = random_bits(p, p.Hkv, 0.3, 5);
  sa::HostTensor wide_bits(sa::DType::u32, {p.B, p.Hkv, p.Tq(), wide});
  std::fill(wide_bits.data<std::uint32_t>(), wide_bits.data<std::uint32_t>() + wide_bits.numel(), 0xffffffffu);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Tq(); ++r)
    std::memcpy(wide_bits.data<std::uint32_t>() + r * wide, packed.data<std::uint32_t>() + r * W, W * 4);
  const Tiles want = cpu_bits(packed, p, kmax);
  Tiles got = poisoned_tiles_g(p, p.Hkv, kpad);
  DeviceBuffer db(wide_bits), di(got.idx), dc(got.cnt);
  sa::TensorView bv = db.view;
  bv.shape[3] = W;
  sa::TensorView iv = di.view;
  iv.shape[3] = kmax;
  convert_on_own_stream([&](const sa::ConvertOptions& options) {
    sa::block_bits_to_tile_lists(sa::BlockBits{bv}, sa::TileLists{iv, dc.view}, p, options);
  });
  di.download(got.idx);
  dc.download(got.cnt);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Tq(); ++r) {
    for (std::int64_t k = 0; k < kmax; ++k)
      ASSERT_EQ(want.idx.data<std::int32_t>()[r * kmax + k], got.idx.data<std::int32_t>()[r * kpad + k]) << r << ", " << k;
    for (std::int64_t k = kmax; k < kpad; ++k) ASSERT_EQ(got.idx.data<std::int32_t>()[r * kpad + k], kPoison) << r;
    ASSERT_EQ(want.cnt.data<std::int32_t>()[r], got.cnt.data<std::int32_t>()[r]) << r;
  }
}

// Small enough for compute-sanitizer: checked, tight and trusted bit conversions, then a stray bit.
TEST(ConvertGpu, BitsSanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 300, 4300, 2);  // Tk = 34, W = 2
  const sa::HostTensor bits = random_bits(p, p.Hkv, 0.3, 3);
  const Tiles want = cpu_bits(bits, p, p.Tk());
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_bits(bits, p, p.Tk()), "checked"));
  ASSERT_NO_FATAL_FAILURE(expect_equal(want, gpu_bits(bits, p, p.Tk(), trusted), "trusted"));
  const std::int64_t tight = largest_union(want);
  ASSERT_NO_FATAL_FAILURE(expect_equal(cpu_bits(bits, p, tight), gpu_bits(bits, p, tight), "tight"));
  sa::HostTensor bad = bits;
  bad.data<std::uint32_t>()[5 * 2 + 1] |= 1u << 3;  // row 5, word 1: block 35 >= Tk
  ASSERT_NO_FATAL_FAILURE(expect_same_bits_error(bad, p, p.Tk(), "in.bits", "stray bit 3 (block 35)"));
}

// ---- TileLists -> BlockBits ------------------------------------------------------------------------

struct TileListsHost {
  sa::HostTensor idx, cnt;
};

/// Valid TileLists [B, G, Tq, kmax] from random bit sets (the CPU conversion), -1 past each count.
TileListsHost random_tile_lists(const sa::ProblemShape& p, std::int64_t G, std::int64_t kmax, double density,
                                std::uint64_t seed) {
  const sa::HostTensor bits = random_bits(p, G, density, seed);
  const Tiles t = cpu_bits(bits, p, std::max<std::int64_t>(largest_union(cpu_bits(bits, p, p.Tk())), kmax));
  TileListsHost out{sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq(), t.idx.shape()[3]}), t.cnt};
  std::memcpy(out.idx.data<std::int32_t>(), t.idx.data<std::int32_t>(), static_cast<std::size_t>(t.idx.numel()) * 4);
  return out;
}

sa::HostTensor cpu_tiles_to_bits(const TileListsHost& l, const sa::ProblemShape& p) {
  sa::HostTensor bits(sa::DType::u32, {p.B, l.idx.shape()[1], p.Tq(), (p.Tk() + 31) / 32});
  std::memset(bits.view().data, 0x5a, static_cast<std::size_t>(bits.numel()) * 4);
  sa::tile_lists_to_block_bits(sa::TileLists{l.idx.view(), l.cnt.view()}, sa::BlockBits{bits.view()}, p);
  return bits;
}

sa::HostTensor gpu_tiles_to_bits(const TileListsHost& l, const sa::ProblemShape& p, const sa::ConvertOptions& options = {}) {
  sa::HostTensor bits(sa::DType::u32, {p.B, l.idx.shape()[1], p.Tq(), (p.Tk() + 31) / 32});
  std::memset(bits.view().data, 0x5a, static_cast<std::size_t>(bits.numel()) * 4);
  DeviceBuffer di(l.idx), dc(l.cnt), db(bits);
  sa::tile_lists_to_block_bits(sa::TileLists{di.view, dc.view}, sa::BlockBits{db.view}, p, options);
  cuda_ok(cudaDeviceSynchronize(), "tile lists to bits");
  db.download(bits);
  return bits;
}

void expect_same_words(const sa::HostTensor& want, const sa::HostTensor& got, const std::string& what) {
  ASSERT_EQ(want.numel(), got.numel()) << what;
  for (std::int64_t e = 0; e < want.numel(); ++e)
    ASSERT_EQ(want.data<std::uint32_t>()[e], got.data<std::uint32_t>()[e]) << what << ": word " << e;
}

TEST(ConvertGpu, TilesToBitsEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const BitsCase cases[] = {{"Tk 1", 1, 200, 100, 1, 1, 0.5},
                            {"Tk 9 Hkv 2", 2, 1013, 1100, 2, 2, 0.3},
                            {"Tk 33 G = Hq", 2, 256, 4100, 2, 4, 0.2},
                            {"Tk 1094", 1, 640, 140000, 1, 1, 0.05}};
  std::uint64_t seed = 70;
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  for (const BitsCase& c : cases) {
    SCOPED_TRACE(c.name);
    const sa::ProblemShape p = shape(c.B, c.Lq, c.Lk, c.Hkv);
    const TileListsHost l = random_tile_lists(p, c.G, 1, c.density, ++seed);
    const sa::HostTensor want = cpu_tiles_to_bits(l, p);
    ASSERT_NO_FATAL_FAILURE(expect_same_words(want, gpu_tiles_to_bits(l, p), "checked"));
    ASSERT_NO_FATAL_FAILURE(expect_same_words(want, gpu_tiles_to_bits(l, p, trusted), "trusted"));
  }
}

void expect_same_tiles_error(const TileListsHost& l, const sa::ProblemShape& p, const std::string& want_arg,
                             const std::string& want_text) {
  expect_same_error_of([&] { cpu_tiles_to_bits(l, p); }, [&] { gpu_tiles_to_bits(l, p); }, want_arg, want_text);
}

// Counts outside [0, Kmax], ids out of range, repeated or descending: the first faulty tile in row-major
// order, its first fault, as on the CPU. Trusted lists with such entries are clamped and never written
// out of bounds.
TEST(ConvertGpu, TilesToBitsErrorsAsOnTheCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 600, 2000, 2);  // Tk = 16, Tq = 5
  const TileListsHost base = random_tile_lists(p, p.Hkv, 6, 0.3, 5);
  const std::int64_t kmax = base.idx.shape()[3];
  auto cnt = [&](TileListsHost& l, std::int64_t r) -> std::int32_t& { return l.cnt.data<std::int32_t>()[r]; };
  auto id = [&](TileListsHost& l, std::int64_t r, std::int64_t k) -> std::int32_t& {
    return l.idx.data<std::int32_t>()[r * kmax + k];
  };
  // Row r = (b * Hkv + g) * Tq + t; rows 12 = [1, 0, 2] and 17 = [1, 1, 2].
  auto with = [&](auto mutate) {
    TileListsHost l{base.idx, base.cnt};
    for (std::int64_t r = 0; r < 20; ++r) {  // three ids 1, 5, 9 in every tile
      cnt(l, r) = 3;
      id(l, r, 0) = 1, id(l, r, 1) = 5, id(l, r, 2) = 9;
    }
    mutate(l);
    return l;
  };
  ASSERT_NO_FATAL_FAILURE(expect_same_tiles_error(with([&](TileListsHost& l) { cnt(l, 17) = -1; cnt(l, 12) = -3; }),
                                                  p, "in.cnt", "negative count -3 at [1, 0, 2]"));
  ASSERT_NO_FATAL_FAILURE(expect_same_tiles_error(with([&](TileListsHost& l) { cnt(l, 12) = static_cast<std::int32_t>(kmax + 1); }),
                                                  p, "in.cnt", "exceeds the list capacity"));
  ASSERT_NO_FATAL_FAILURE(expect_same_tiles_error(with([&](TileListsHost& l) { id(l, 12, 2) = 16; id(l, 17, 0) = -4; }),
                                                  p, "in.idx", "block id 16 at [1, 0, 2, 2] is out of range [0, 16)"));
  ASSERT_NO_FATAL_FAILURE(expect_same_tiles_error(with([&](TileListsHost& l) { id(l, 12, 1) = 1; }), p, "in.idx",
                                                  "duplicate block id 1 at [1, 0, 2, 1]"));
  ASSERT_NO_FATAL_FAILURE(expect_same_tiles_error(with([&](TileListsHost& l) { id(l, 12, 2) = 3; }), p, "in.idx",
                                                  "block ids must be strictly ascending: 3 at [1, 0, 2, 2] follows 5"));
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  TileListsHost bad = with([&](TileListsHost& l) {
    cnt(l, 3) = static_cast<std::int32_t>(kmax + 50);
    cnt(l, 4) = -8;
    id(l, 12, 1) = 1 << 30;
    id(l, 12, 2) = -9;
  });
  for (std::int64_t k = 3; k < kmax; ++k) id(bad, 3, k) = 9;  // the count clamped to Kmax reads them: repeats
  // Expected: {1, 5, 9} everywhere, nothing in row 4 (count clamped to 0), only block 1 in row 12.
  const sa::HostTensor got = gpu_tiles_to_bits(bad, p, trusted);
  sa::HostTensor want(sa::DType::u32, {p.B, p.Hkv, p.Tq(), 1});
  for (std::int64_t r = 0; r < 20; ++r) want.data<std::uint32_t>()[r] = (1u << 1) | (1u << 5) | (1u << 9);
  want.data<std::uint32_t>()[4] = 0u;
  want.data<std::uint32_t>()[12] = 1u << 1;
  ASSERT_NO_FATAL_FAILURE(expect_same_words(want, got, "trusted, bad entries"));
}

// Lists with padded rows and a count tensor with padded rows, on a caller's stream, into padded bit rows.
TEST(ConvertGpu, TilesToBitsStridedOnAStream) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 300, 9000, 2);  // Tk = 71, W = 3, Tq = 3
  const TileListsHost l = random_tile_lists(p, p.Hkv, 1, 0.3, 9);
  const std::int64_t kmax = l.idx.shape()[3], kpad = kmax + 3, W = 3, wpad = W + 2, tpad = p.Tq() + 2;
  const sa::HostTensor want = cpu_tiles_to_bits(l, p);
  sa::HostTensor wide_idx(sa::DType::i32, {p.B, p.Hkv, p.Tq(), kpad}), wide_cnt(sa::DType::i32, {p.B, p.Hkv, tpad});
  std::fill(wide_idx.data<std::int32_t>(), wide_idx.data<std::int32_t>() + wide_idx.numel(), 1 << 30);
  std::fill(wide_cnt.data<std::int32_t>(), wide_cnt.data<std::int32_t>() + wide_cnt.numel(), -7);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Tq(); ++r) {
    std::memcpy(wide_idx.data<std::int32_t>() + r * kpad, l.idx.data<std::int32_t>() + r * kmax, kmax * 4);
    wide_cnt.data<std::int32_t>()[r / p.Tq() * tpad + r % p.Tq()] = l.cnt.data<std::int32_t>()[r];
  }
  sa::HostTensor bits(sa::DType::u32, {p.B, p.Hkv, p.Tq(), wpad});
  std::fill(bits.data<std::uint32_t>(), bits.data<std::uint32_t>() + bits.numel(), 0xabcdef01u);
  DeviceBuffer di(wide_idx), dc(wide_cnt), db(bits);
  sa::TensorView iv = di.view;
  iv.shape[3] = kmax;
  sa::TensorView cv = dc.view;
  cv.shape[2] = p.Tq();
  sa::TensorView bv = db.view;
  bv.shape[3] = W;
  convert_on_own_stream([&](const sa::ConvertOptions& options) {
    sa::tile_lists_to_block_bits(sa::TileLists{iv, cv}, sa::BlockBits{bv}, p, options);
  });
  db.download(bits);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Tq(); ++r) {
    for (std::int64_t w = 0; w < W; ++w)
      ASSERT_EQ(want.data<std::uint32_t>()[r * W + w], bits.data<std::uint32_t>()[r * wpad + w]) << r << ", " << w;
    for (std::int64_t w = W; w < wpad; ++w) ASSERT_EQ(bits.data<std::uint32_t>()[r * wpad + w], 0xabcdef01u) << r;
  }
}

// Small enough for compute-sanitizer: TileLists -> BlockBits checked, trusted, then an error.
TEST(ConvertGpu, TilesToBitsSanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::ProblemShape p = shape(2, 300, 4300, 2);  // Tk = 34, W = 2
  TileListsHost l = random_tile_lists(p, p.Hkv, 1, 0.3, 3);
  const sa::HostTensor words = cpu_tiles_to_bits(l, p);
  sa::ConvertOptions trusted;
  trusted.trusted = true;
  ASSERT_NO_FATAL_FAILURE(expect_same_words(words, gpu_tiles_to_bits(l, p), "checked"));
  ASSERT_NO_FATAL_FAILURE(expect_same_words(words, gpu_tiles_to_bits(l, p, trusted), "trusted"));
  l.cnt.data<std::int32_t>()[7] = -2;
  ASSERT_NO_FATAL_FAILURE(expect_same_tiles_error(l, p, "in.cnt", "negative count -2"));
}

}  // namespace
