// Selection formats: shape helpers, conversions against brute-force sets, explicit masks against a
// direct evaluation of the format's meaning, and one test per validator failure kind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn {

// Readable names for parameterised cases.
void PrintTo(const ProblemShape& p, std::ostream* os) { *os << p.describe(); }

namespace {

using ::testing::HasSubstr;
using Sets = std::vector<std::set<std::int32_t>>;  // one set of block ids per (b, g, t), row-major

ProblemShape shape(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
                   bool causal = false) {
  ProblemShape p;
  p.B = B;
  p.Lq = Lq;
  p.Lk = Lk;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.D = 64;
  p.causal = causal;
  return p;
}

struct OwnedTiles {
  HostTensor idx, cnt;
  TileLists view() const { return {idx.view(), cnt.view()}; }
};

struct OwnedBits {
  HostTensor bits;
  BlockBits view() const { return {bits.view()}; }
};

/// Random distinct block sets; every fourth tile, starting with the second, is empty.
Sets random_sets(std::int64_t rows, std::int64_t Tk, std::int64_t max_count, std::mt19937_64& rng) {
  Sets sets(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (r % 4 == 1) continue;
    const auto n = std::uniform_int_distribution<std::int64_t>(1, std::min(max_count, Tk))(rng);
    std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(Tk - 1));
    auto& s = sets[static_cast<std::size_t>(r)];
    while (static_cast<std::int64_t>(s.size()) < n) s.insert(id(rng));
  }
  return sets;
}

/// TileLists holding `sets`; slots past the count hold garbage that no reader may look at.
OwnedTiles make_tiles(const Sets& sets, std::int64_t B, std::int64_t G, std::int64_t Tq, std::int64_t Kmax) {
  OwnedTiles t{HostTensor(DType::i32, {B, G, Tq, Kmax}), HostTensor(DType::i32, {B, G, Tq})};
  auto* idx = t.idx.data<std::int32_t>();
  auto* cnt = t.cnt.data<std::int32_t>();
  for (std::int64_t r = 0; r < B * G * Tq; ++r) {
    const auto& s = sets[static_cast<std::size_t>(r)];
    cnt[r] = static_cast<std::int32_t>(s.size());
    std::int64_t k = 0;
    for (std::int32_t id : s) idx[r * Kmax + k++] = id;
    for (; k < Kmax; ++k) idx[r * Kmax + k] = 1000003 + static_cast<std::int32_t>(k);
  }
  return t;
}

OwnedTiles empty_tiles(const ProblemShape& p, std::int64_t G, std::int64_t Kmax) {
  return make_tiles(Sets(static_cast<std::size_t>(p.B * G * p.Tq())), p.B, G, p.Tq(), Kmax);
}

std::int64_t words_of(const ProblemShape& p) { return ceil_div(p.Tk(), 32); }

OwnedBits make_bits(const Sets& sets, const ProblemShape& p, std::int64_t G) {
  const std::int64_t W = words_of(p);
  OwnedBits o{HostTensor(DType::u32, {p.B, G, p.Tq(), W})};
  auto* w = o.bits.data<std::uint32_t>();
  std::fill(w, w + o.bits.numel(), 0u);
  for (std::size_t r = 0; r < sets.size(); ++r)
    for (std::int32_t id : sets[r]) w[static_cast<std::int64_t>(r) * W + id / 32] |= 1u << (id % 32);
  return o;
}

/// Checks that `t` holds exactly `sets`, ascending, with -1 in every slot past the count.
void expect_tiles_equal(const OwnedTiles& t, const Sets& sets) {
  const std::int64_t Kmax = t.idx.shape()[3];
  const auto* idx = t.idx.data<std::int32_t>();
  const auto* cnt = t.cnt.data<std::int32_t>();
  for (std::size_t r = 0; r < sets.size(); ++r) {
    const auto row = static_cast<std::int64_t>(r);
    ASSERT_EQ(cnt[row], static_cast<std::int32_t>(sets[r].size())) << "row " << r;
    std::int64_t k = 0;
    for (std::int32_t id : sets[r]) ASSERT_EQ(idx[row * Kmax + k++], id) << "row " << r << " slot " << k - 1;
    for (; k < Kmax; ++k) ASSERT_EQ(idx[row * Kmax + k], -1) << "row " << r << " slot " << k;
  }
}

// ---- ProblemShape ------------------------------------------------------------------------------

TEST(ProblemShape, KeyEndAndVisiblePairsMatchBruteForce) {
  for (bool causal : {false, true}) {
    for (auto [Lq, Lk] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {1, 700}, {17, 17}, {200, 700}, {700, 200},
                          {1013, 1013}, {129, 128}, {5, 3}}) {
      const ProblemShape p = shape(1, Lq, Lk, 2, 1, causal);
      std::int64_t pairs = 0;
      for (std::int64_t i = 0; i < Lq; ++i) {
        std::int64_t end = 0;
        for (std::int64_t j = 0; j < Lk; ++j) end += p.visible(i, j) ? 1 : 0;
        ASSERT_EQ(p.key_end(i), end) << p.describe() << " i=" << i;
        pairs += end;
      }
      EXPECT_EQ(p.visible_pairs(), pairs) << p.describe();
    }
  }
}

TEST(ProblemShape, DescribeAndNames) {
  const ProblemShape p = shape(2, 17, 300, 16, 2, true);
  EXPECT_EQ(p.describe(), "B=2 Lq=17 Lk=300 Hq=16 Hkv=2 D=64 causal");
  EXPECT_EQ(std::string(selection_name(AllBlocks{})), "dense");
  EXPECT_EQ(std::string(selection_name(TileLists{})), "TileLists");
  EXPECT_EQ(std::string(selection_name(BlockBits{})), "BlockBits");
  EXPECT_EQ(std::string(selection_name(QueryLists{})), "QueryLists");
  EXPECT_EQ(std::string(selection_name(TokenLists{})), "TokenLists");
}

// ---- conversions -------------------------------------------------------------------------------

struct ConvCase {
  std::int64_t B, Lq, Lk, Hq, Hkv;
  bool per_head;  // G = Hq instead of Hkv
};

class TileBitsRoundTrip : public ::testing::TestWithParam<ConvCase> {};

TEST_P(TileBitsRoundTrip, ListsToBitsToLists) {
  const ConvCase c = GetParam();
  const ProblemShape p = shape(c.B, c.Lq, c.Lk, c.Hq, c.Hkv);
  const std::int64_t G = c.per_head ? c.Hq : c.Hkv, Tq = p.Tq(), Tk = p.Tk(), Kmax = std::min<std::int64_t>(Tk, 11);
  std::mt19937_64 rng(0x5eed + static_cast<std::uint64_t>(c.Lk * 31 + G));
  const Sets sets = random_sets(c.B * G * Tq, Tk, Kmax, rng);
  const OwnedTiles tiles = make_tiles(sets, c.B, G, Tq, Kmax);
  validate(tiles.view(), p, "test");

  OwnedBits bits{HostTensor(DType::u32, {c.B, G, Tq, words_of(p)})};
  testing::poison(bits.bits);
  tile_lists_to_block_bits(tiles.view(), bits.view(), p);
  const OwnedBits expected = make_bits(sets, p, G);
  ASSERT_EQ(std::memcmp(bits.bits.data<std::uint32_t>(), expected.bits.data<std::uint32_t>(),
                        static_cast<std::size_t>(bits.bits.numel()) * 4),
            0);
  validate(bits.view(), p, "test");

  OwnedTiles back{HostTensor(DType::i32, {c.B, G, Tq, Kmax}), HostTensor(DType::i32, {c.B, G, Tq})};
  testing::poison(back.idx);
  testing::poison(back.cnt);
  block_bits_to_tile_lists(bits.view(), back.view(), p);
  expect_tiles_equal(back, sets);
  validate(back.view(), p, "test");
  EXPECT_EQ(selection_groups(Selection{back.view()}, p, "test"), G);
  EXPECT_EQ(selection_groups(Selection{bits.view()}, p, "test"), G);
}

TEST_P(TileBitsRoundTrip, BitsToListsToBits) {
  const ConvCase c = GetParam();
  const ProblemShape p = shape(c.B, c.Lq, c.Lk, c.Hq, c.Hkv);
  const std::int64_t G = c.per_head ? c.Hq : c.Hkv, Tq = p.Tq(), Tk = p.Tk();
  std::mt19937_64 rng(0xb175 + static_cast<std::uint64_t>(c.Lq));
  const Sets sets = random_sets(c.B * G * Tq, Tk, Tk, rng);  // up to every block, so Kmax = Tk is needed
  const OwnedBits bits = make_bits(sets, p, G);
  OwnedTiles tiles{HostTensor(DType::i32, {c.B, G, Tq, Tk}), HostTensor(DType::i32, {c.B, G, Tq})};
  testing::poison(tiles.idx);
  testing::poison(tiles.cnt);
  block_bits_to_tile_lists(bits.view(), tiles.view(), p);
  expect_tiles_equal(tiles, sets);
  OwnedBits back{HostTensor(DType::u32, {c.B, G, Tq, words_of(p)})};
  testing::poison(back.bits);
  tile_lists_to_block_bits(tiles.view(), back.view(), p);
  EXPECT_EQ(std::memcmp(back.bits.data<std::uint32_t>(), bits.bits.data<std::uint32_t>(),
                        static_cast<std::size_t>(bits.bits.numel()) * 4),
            0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, TileBitsRoundTrip,
                         ::testing::Values(ConvCase{2, 300, 1000, 4, 2, false},    // Tk = 8: one partial word
                                           ConvCase{3, 1013, 5000, 16, 1, true},   // Tk = 40, G = Hq = 16 Hkv
                                           ConvCase{2, 1013, 5000, 16, 1, false},  // G = Hkv = 1
                                           ConvCase{1, 1, 4096, 3, 3, false},      // Tk = 32 exactly, Lq = 1
                                           ConvCase{2, 17, 8193, 2, 2, true}));    // Tk = 65: three words

TEST(Conversions, BlockBitsOverCapacityNamesTileAndWritesNothing) {
  const ProblemShape p = shape(2, 300, 2000, 2, 1);  // Tq = 3, Tk = 16
  Sets sets(static_cast<std::size_t>(p.B * p.Tq()));
  sets[4] = {0, 3, 7, 9, 15};  // (b 1, g 0, t 1): five blocks
  sets[5] = {1, 2};
  const OwnedBits bits = make_bits(sets, p, 1);
  OwnedTiles out{HostTensor(DType::i32, {2, 1, 3, 4}), HostTensor(DType::i32, {2, 1, 3})};
  testing::poison(out.idx);
  testing::poison(out.cnt);
  try {
    block_bits_to_tile_lists(bits.view(), out.view(), p);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "out.idx");
    EXPECT_THAT(e.what(), HasSubstr("[1, 0, 1]"));
    EXPECT_THAT(e.what(), HasSubstr("holds 5 blocks but Kmax is 4"));
  }
  for (std::int64_t i = 0; i < out.cnt.numel(); ++i) EXPECT_EQ(out.cnt.data<std::int32_t>()[i], 0x7fffffff);
}

TEST(Conversions, ConvertersValidateTheirInputs) {
  const ProblemShape p = shape(1, 256, 1024, 2, 2);  // Tq = 2, Tk = 8
  OwnedTiles tiles = make_tiles(Sets{{1, 2}, {3}, {0}, {7}}, 1, 2, 2, 4);
  tiles.idx.data<std::int32_t>()[1] = 9;  // (0, 0, 0, 1) out of range
  OwnedBits bits{HostTensor(DType::u32, {1, 2, 2, 1})};
  try {
    tile_lists_to_block_bits(tiles.view(), bits.view(), p);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "tile_lists_to_block_bits");
    EXPECT_EQ(e.argument(), "in.idx");
    EXPECT_THAT(e.what(), HasSubstr("block id 9 at [0, 0, 0, 1] is out of range [0, 8)"));
  }
  // Wrong output shape is reported against the output.
  const OwnedTiles good = make_tiles(Sets{{1, 2}, {3}, {0}, {7}}, 1, 2, 2, 4);
  OwnedBits wrong{HostTensor(DType::u32, {1, 2, 2, 2})};
  try {
    tile_lists_to_block_bits(good.view(), wrong.view(), p);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "out.bits");
    EXPECT_THAT(e.what(), HasSubstr("expected shape [1, 2, 2, 1]"));
  }
}

/// Random per-query lists: ids in [0, extent), distinct per row, some slots -1, some rows all -1.
HostTensor random_lists(const ProblemShape& p, std::int64_t K, std::int64_t extent, std::mt19937_64& rng) {
  HostTensor t(DType::i32, {p.B, p.Hkv, p.Lq, K});
  auto* d = t.data<std::int32_t>();
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(extent - 1));
  std::bernoulli_distribution empty(0.25);
  for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r) {
    std::set<std::int32_t> used;
    for (std::int64_t k = 0; k < K; ++k) {
      std::int32_t v = -1;
      if (r % 7 != 3 && !empty(rng) && static_cast<std::int64_t>(used.size()) < extent) {
        do v = id(rng);
        while (used.count(v));
        used.insert(v);
      }
      d[r * K + k] = v;
    }
  }
  return t;
}

TEST(Conversions, QueryListsToTileListsIsTheUnionPerTile) {
  for (const ProblemShape& p : {shape(2, 1013, 2600, 4, 2), shape(1, 17, 300, 16, 1), shape(3, 1, 129, 1, 1)}) {
    std::mt19937_64 rng(0x9e37 + static_cast<std::uint64_t>(p.Lq));
    const std::int64_t K = 5, Tq = p.Tq(), Tk = p.Tk();
    const HostTensor lists = random_lists(p, K, Tk, rng);
    validate(QueryLists{lists.view()}, p, "test");
    Sets expected(static_cast<std::size_t>(p.B * p.Hkv * Tq));
    const auto* d = lists.data<std::int32_t>();
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t g = 0; g < p.Hkv; ++g)
        for (std::int64_t i = 0; i < p.Lq; ++i)
          for (std::int64_t k = 0; k < K; ++k) {
            const std::int32_t v = d[((b * p.Hkv + g) * p.Lq + i) * K + k];
            if (v >= 0) expected[static_cast<std::size_t>((b * p.Hkv + g) * Tq + i / 128)].insert(v);
          }
    OwnedTiles out{HostTensor(DType::i32, {p.B, p.Hkv, Tq, Tk}), HostTensor(DType::i32, {p.B, p.Hkv, Tq})};
    testing::poison(out.idx);
    testing::poison(out.cnt);
    query_lists_to_tile_lists(QueryLists{lists.view()}, out.view(), p);
    expect_tiles_equal(out, expected);
    validate(out.view(), p, "test");
  }
}

TEST(Conversions, QueryListsUnionOverCapacityNamesTile) {
  const ProblemShape p = shape(1, 300, 1280, 2, 2);  // Tq = 3, Tk = 10
  HostTensor lists(DType::i32, {1, 2, 300, 2});
  std::fill(lists.data<std::int32_t>(), lists.data<std::int32_t>() + lists.numel(), -1);
  auto at = [&](std::int64_t g, std::int64_t i, std::int64_t k) -> std::int32_t& {
    return lists.data<std::int32_t>()[(g * 300 + i) * 2 + k];
  };
  at(1, 130, 0) = 4;  // tile (0, 1, 1): union {4, 5, 9}
  at(1, 200, 0) = 5;
  at(1, 255, 1) = 9;
  at(0, 0, 0) = 1;
  OwnedTiles out{HostTensor(DType::i32, {1, 2, 3, 2}), HostTensor(DType::i32, {1, 2, 3})};
  try {
    query_lists_to_tile_lists(QueryLists{lists.view()}, out.view(), p);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "query_lists_to_tile_lists");
    EXPECT_EQ(e.argument(), "out.idx");
    EXPECT_THAT(e.what(), HasSubstr("the union of tile [0, 1, 1] holds 3 blocks but Kmax is 2"));
  }
}

// ---- masks -------------------------------------------------------------------------------------

/// The meaning of each format, evaluated directly: is key j selected for (b, h, i)?
struct Oracle {
  const ProblemShape& p;
  const Selection& s;
  bool selected(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    const std::int64_t hk = h / (p.Hq / p.Hkv), t = i / 128, blk = j / 128;
    if (std::holds_alternative<AllBlocks>(s)) return true;
    if (const auto* tl = std::get_if<TileLists>(&s)) {
      const std::int64_t G = tl->idx.shape[1], g = G == p.Hq ? h : hk, K = tl->idx.shape[3];
      const auto* idx = tl->idx.ptr<const std::int32_t>() + ((b * G + g) * p.Tq() + t) * K;
      const std::int32_t c = tl->cnt.ptr<const std::int32_t>()[(b * G + g) * p.Tq() + t];
      return std::find(idx, idx + c, blk) != idx + c;
    }
    if (const auto* bb = std::get_if<BlockBits>(&s)) {
      const std::int64_t G = bb->bits.shape[1], g = G == p.Hq ? h : hk, W = bb->bits.shape[3];
      const std::uint32_t w = bb->bits.ptr<const std::uint32_t>()[((b * G + g) * p.Tq() + t) * W + blk / 32];
      return (w >> (blk % 32)) & 1u;
    }
    const TensorView& idx = std::holds_alternative<QueryLists>(s) ? std::get<QueryLists>(s).idx
                                                                  : std::get<TokenLists>(s).idx;
    const std::int64_t K = idx.shape[3];
    const auto* row = idx.ptr<const std::int32_t>() + ((b * p.Hkv + hk) * p.Lq + i) * K;
    const std::int64_t want = std::holds_alternative<QueryLists>(s) ? blk : j;
    return std::find(row, row + K, want) != row + K;
  }
};

void expect_mask_matches(const Selection& s, const ProblemShape& p) {
  const HostTensor mask = expand_mask(s, p);
  ASSERT_EQ(mask.shape(), (std::vector<std::int64_t>{p.B, p.Hq, p.Lq, p.Lk}));
  const Oracle oracle{p, s};
  const auto* m = mask.data<std::uint8_t>();
  std::int64_t ones = 0;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Lq; ++i)
        for (std::int64_t j = 0; j < p.Lk; ++j) {
          const bool want = oracle.selected(b, h, i, j) && (!p.causal || j <= i + p.Lk - p.Lq);
          const std::uint8_t got = m[((b * p.Hq + h) * p.Lq + i) * p.Lk + j];
          ASSERT_EQ(got, want ? 1 : 0) << selection_name(s) << " " << p.describe() << " at b=" << b << " h=" << h
                                       << " i=" << i << " j=" << j;
          ones += got;
        }
  EXPECT_GT(ones, 0) << "the test selection selects nothing";
  // selection_row agrees with expand_mask on a few rows, including the last.
  std::vector<std::uint8_t> row(static_cast<std::size_t>(p.Lk), 0xee);
  for (auto [b, h, i] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 0, 0},
                         {p.B - 1, p.Hq - 1, p.Lq - 1},
                         {p.B / 2, p.Hq / 2, p.Lq / 2}}) {
    selection_row(s, p, b, h, i, row.data());
    ASSERT_EQ(std::memcmp(row.data(), m + ((b * p.Hq + h) * p.Lq + i) * p.Lk, static_cast<std::size_t>(p.Lk)), 0);
  }
}

class Masks : public ::testing::TestWithParam<ProblemShape> {};

TEST_P(Masks, EveryFormatMatchesItsMeaning) {
  const ProblemShape& p = GetParam();
  std::mt19937_64 rng(0x3a5c + static_cast<std::uint64_t>(p.Lq * 7 + p.Lk + p.causal));
  const std::int64_t Tq = p.Tq(), Tk = p.Tk();
  expect_mask_matches(AllBlocks{}, p);
  for (std::int64_t G : {p.Hkv, p.Hq}) {
    const Sets sets = random_sets(p.B * G * Tq, Tk, 4, rng);
    const OwnedTiles tiles = make_tiles(sets, p.B, G, Tq, 4);
    expect_mask_matches(tiles.view(), p);
    const OwnedBits bits = make_bits(sets, p, G);
    expect_mask_matches(bits.view(), p);
  }
  const HostTensor qlists = random_lists(p, 3, Tk, rng);
  expect_mask_matches(QueryLists{qlists.view()}, p);
  const HostTensor tokens = random_lists(p, 40, p.Lk, rng);
  expect_mask_matches(TokenLists{tokens.view()}, p);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Masks,
                         ::testing::Values(shape(2, 200, 700, 4, 2, true),    // causal, Lq < Lk
                                           shape(2, 200, 700, 4, 2, false),   //
                                           shape(1, 300, 140, 16, 1, true),   // causal, Lq > Lk: rows that see nothing
                                           shape(2, 17, 390, 3, 3, true),     // Hq = Hkv
                                           shape(1, 1, 1000, 2, 1, true)));   // Lq = 1

TEST(Masks, AllBlocksCausalRowsThatSeeNothingAreEmpty) {
  const ProblemShape p = shape(1, 10, 4, 1, 1, true);  // offset -6: queries 0..5 see nothing
  std::vector<std::uint8_t> row(4, 0xee);
  selection_row(AllBlocks{}, p, 0, 0, 5, row.data());
  EXPECT_EQ(row, (std::vector<std::uint8_t>{0, 0, 0, 0}));
  selection_row(AllBlocks{}, p, 0, 0, 7, row.data());
  EXPECT_EQ(row, (std::vector<std::uint8_t>{1, 1, 0, 0}));
}

TEST(Masks, SelectionRowRejectsBadCoordinatesAndContents) {
  const ProblemShape p = shape(1, 256, 1024, 2, 1);  // Tq = 2, Tk = 8
  std::vector<std::uint8_t> row(1024);
  EXPECT_THROW(selection_row(AllBlocks{}, p, 1, 0, 0, row.data()), Error);
  EXPECT_THROW(selection_row(AllBlocks{}, p, 0, 2, 0, row.data()), Error);
  EXPECT_THROW(selection_row(AllBlocks{}, p, 0, 0, 256, row.data()), Error);
  // An id past Tk would write past the row: it is reported instead.
  OwnedTiles tiles = make_tiles(Sets{{1}, {2, 3}}, 1, 1, 2, 2);
  tiles.idx.data<std::int32_t>()[3] = 8;
  try {
    selection_row(tiles.view(), p, 0, 1, 200, row.data());
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "tiles.idx");
    EXPECT_THAT(e.what(), HasSubstr("block id 8 at [0, 0, 1, 1] is out of range [0, 8)"));
  }
  HostTensor tok(DType::i32, {1, 1, 256, 1});
  std::fill(tok.data<std::int32_t>(), tok.data<std::int32_t>() + 256, 5);
  tok.data<std::int32_t>()[9] = 1024;
  EXPECT_THROW(selection_row(TokenLists{tok.view()}, p, 0, 0, 9, row.data()), Error);
  EXPECT_THROW(expand_mask(TokenLists{tok.view()}, p), Error);
}

// ---- validators --------------------------------------------------------------------------------

template <class F>
void expect_error(F&& f, const std::string& argument, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected sparse_attn::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    for (const std::string& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

class TileValidation : public ::testing::Test {
 protected:
  // Lk = 32 blocks, Lq = 4 tiles, one group; every tile holds {1, 5, 9}.
  ProblemShape p = shape(1, 512, 4096, 2, 1);
  OwnedTiles t = make_tiles(Sets(4, std::set<std::int32_t>{1, 5, 9}), 1, 1, 4, 4);
  std::int32_t* idx(std::int64_t tile, std::int64_t k) { return t.idx.data<std::int32_t>() + tile * 4 + k; }
  std::int32_t* cnt(std::int64_t tile) { return t.cnt.data<std::int32_t>() + tile; }
  void expect(const std::string& argument, std::initializer_list<std::string> parts) {
    expect_error([&] { validate(t.view(), p, "tile_sparse"); }, argument, parts);
  }
};

TEST_F(TileValidation, AcceptsAValidSelection) { EXPECT_NO_THROW(validate(t.view(), p, "tile_sparse")); }

TEST_F(TileValidation, IdOutOfRange) {
  *idx(3, 2) = 40;
  expect("tiles.idx", {"tile_sparse: argument 'tiles.idx': block id 40 at [0, 0, 3, 2] is out of range [0, 32)"});
  *idx(3, 2) = -1;
  expect("tiles.idx", {"block id -1 at [0, 0, 3, 2] is out of range"});
}

TEST_F(TileValidation, DuplicateId) {
  *idx(2, 2) = 5;
  expect("tiles.idx", {"duplicate block id 5 at [0, 0, 2, 2]"});
}

TEST_F(TileValidation, Unsorted) {
  *idx(1, 1) = 0;
  expect("tiles.idx", {"strictly ascending", "0 at [0, 0, 1, 1] follows 1"});
}

TEST_F(TileValidation, CountOverCapacity) {
  *cnt(2) = 5;
  expect("tiles.cnt", {"count 5 at [0, 0, 2] exceeds the list capacity Kmax = 4"});
}

TEST_F(TileValidation, NegativeCount) {
  *cnt(1) = -2;
  expect("tiles.cnt", {"negative count -2 at [0, 0, 1]"});
}

TEST_F(TileValidation, SlotsPastTheCountAreIgnored) {
  *cnt(0) = 0;  // a tile with zero selected blocks; its (now unused) slots keep stale ids
  *idx(1, 3) = 12345;
  EXPECT_NO_THROW(validate(t.view(), p, "tile_sparse"));
}

TEST_F(TileValidation, FirstOffendingCoordinateWins) {
  *idx(3, 0) = 99;
  *idx(1, 2) = 77;
  expect("tiles.idx", {"block id 77 at [0, 0, 1, 2]"});
}

TEST_F(TileValidation, NameParameterPrefixesTheArgument) {
  *idx(0, 0) = 32;
  expect_error([&] { validate(t.view(), p, "op", "sel"); }, "sel.idx", {"op: argument 'sel.idx'"});
}

TEST_F(TileValidation, Metadata) {
  // groups neither Hkv nor Hq
  OwnedTiles three = make_tiles(Sets(12), 1, 3, 4, 4);
  expect_error([&] { validate(three.view(), p, "op"); }, "tiles.idx", {"must be Hkv = 1 or Hq = 2"});
  EXPECT_THROW(selection_groups(Selection{three.view()}, p, "op"), Error);
  // wrong Tq
  OwnedTiles short_tq = make_tiles(Sets(3), 1, 1, 3, 4);
  expect_error([&] { validate(short_tq.view(), p, "op"); }, "tiles.idx", {"expected shape [1, 1, 4, *]"});
  // cnt shape
  OwnedTiles bad_cnt = t;
  bad_cnt.cnt = HostTensor(DType::i32, {1, 1, 5});
  expect_error([&] { validate(bad_cnt.view(), p, "op"); }, "tiles.cnt", {"expected shape [1, 1, 4]"});
  // dtype
  TileLists f32 = t.view();
  f32.idx.dtype = DType::f32;
  expect_error([&] { validate(f32, p, "op"); }, "tiles.idx", {"dtype f32"});
  TileLists u32cnt = t.view();
  u32cnt.cnt.dtype = DType::u32;
  expect_error([&] { validate(u32cnt, p, "op"); }, "tiles.cnt", {"dtype u32"});
  // last dim not contiguous: a view of every other slot of a [1, 1, 4, 8] buffer
  HostTensor wide(DType::i32, {1, 1, 4, 8});
  TileLists strided = t.view();
  strided.idx = wide.view();
  strided.idx.shape[3] = 4;
  strided.idx.stride[3] = 2;
  expect_error([&] { validate(strided, p, "op"); }, "tiles.idx", {"stride 2"});
  // devices differ
  TileLists mixed = t.view();
  mixed.cnt.device = Device::cuda;
  expect_error([&] { validate(mixed, p, "op"); }, "tiles.cnt", {"cuda:0", "cpu:0"});
  // missing tensor
  expect_error([&] { validate(TileLists{}, p, "op"); }, "tiles.idx", {"missing"});
}

TEST_F(TileValidation, DeviceTensorsAreCheckedForMetadataOnly) {
  *idx(0, 0) = 1000;  // bad contents that the CPU would reject
  TileLists dev = t.view();
  dev.idx.device = Device::cuda;
  dev.cnt.device = Device::cuda;
  EXPECT_NO_THROW(validate(dev, p, "op"));
  dev.cnt.shape[2] = 3;
  EXPECT_THROW(validate(dev, p, "op"), Error);
}

TEST(BitsValidation, StrayBitsPastTk) {
  const ProblemShape p = shape(2, 300, 33 * 128 - 5, 4, 2);  // Tk = 33: word 1 keeps only bit 0
  OwnedBits bits = make_bits(Sets(static_cast<std::size_t>(2 * 2 * 3), std::set<std::int32_t>{0, 31, 32}), p, 2);
  EXPECT_NO_THROW(validate(bits.view(), p, "bits_sparse"));
  bits.bits.data<std::uint32_t>()[((1 * 2 + 0) * 3 + 2) * 2 + 1] |= 1u << 5;  // block 37 of (1, 0, 2)
  expect_error([&] { validate(bits.view(), p, "bits_sparse"); }, "bits.bits",
               {"stray bit 5 (block 37)", "[1, 0, 2, 1]", "Tk = 33"});
}

TEST(BitsValidation, Metadata) {
  const ProblemShape p = shape(1, 128, 2048, 2, 1);  // Tk = 16: one word
  OwnedBits two_words{HostTensor(DType::u32, {1, 1, 1, 2})};
  expect_error([&] { validate(two_words.view(), p, "op"); }, "bits.bits", {"expected shape [1, 1, 1, 1]"});
  OwnedBits ok{HostTensor(DType::u32, {1, 2, 1, 1})};
  ok.bits.data<std::uint32_t>()[0] = ok.bits.data<std::uint32_t>()[1] = 0xffffu;
  EXPECT_NO_THROW(validate(ok.view(), p, "op"));
  BlockBits i32 = ok.view();
  i32.bits.dtype = DType::i32;
  expect_error([&] { validate(i32, p, "op"); }, "bits.bits", {"dtype i32"});
}

class ListValidation : public ::testing::Test {
 protected:
  ProblemShape p = shape(2, 130, 1000, 4, 2);  // Tk = 8
  HostTensor lists = make(p, 3, 8);
  HostTensor tokens = make(p, 3, 1000);
  static HostTensor make(const ProblemShape& p, std::int64_t K, std::int64_t extent) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(extent));
    return random_lists(p, K, extent, rng);
  }
  std::int32_t* at(HostTensor& t, std::int64_t b, std::int64_t g, std::int64_t i, std::int64_t k) {
    return t.data<std::int32_t>() + ((b * 2 + g) * 130 + i) * 3 + k;
  }
};

TEST_F(ListValidation, AcceptsValidLists) {
  EXPECT_NO_THROW(validate(QueryLists{lists.view()}, p, "query_sparse"));
  EXPECT_NO_THROW(validate(TokenLists{tokens.view()}, p, "token_sparse"));
  EXPECT_NO_THROW(validate(Selection{QueryLists{lists.view()}}, p, "op"));
  EXPECT_EQ(selection_groups(Selection{TokenLists{tokens.view()}}, p, "op"), 2);
}

TEST_F(ListValidation, QueryIdOutOfRange) {
  *at(lists, 1, 0, 129, 2) = 8;
  expect_error([&] { validate(QueryLists{lists.view()}, p, "query_sparse"); }, "lists.idx",
               {"block id 8 at [1, 0, 129, 2] is out of range [0, 8)"});
}

TEST_F(ListValidation, QueryDuplicate) {
  *at(lists, 0, 1, 5, 0) = 3;
  *at(lists, 0, 1, 5, 1) = -1;
  *at(lists, 0, 1, 5, 2) = 3;
  expect_error([&] { validate(QueryLists{lists.view()}, p, "query_sparse"); }, "lists.idx",
               {"duplicate block id 3 at [0, 1, 5, 2]"});
}

TEST_F(ListValidation, ValueBelowMinusOne) {
  *at(lists, 0, 0, 0, 1) = -2;
  expect_error([&] { validate(QueryLists{lists.view()}, p, "query_sparse"); }, "lists.idx",
               {"invalid value -2 at [0, 0, 0, 1]", "only -1"});
  *at(tokens, 1, 1, 7, 0) = -100;
  expect_error([&] { validate(TokenLists{tokens.view()}, p, "token_sparse"); }, "tokens.idx",
               {"invalid value -100 at [1, 1, 7, 0]"});
}

TEST_F(ListValidation, TokenOutOfRange) {
  *at(tokens, 1, 1, 64, 1) = 1000;
  expect_error([&] { validate(TokenLists{tokens.view()}, p, "token_sparse"); }, "tokens.idx",
               {"token position 1000 at [1, 1, 64, 1] is out of range [0, 1000)"});
}

TEST_F(ListValidation, TokenDuplicate) {
  *at(tokens, 0, 0, 100, 0) = 999;
  *at(tokens, 0, 0, 100, 1) = -1;
  *at(tokens, 0, 0, 100, 2) = 999;
  expect_error([&] { validate(TokenLists{tokens.view()}, p, "token_sparse"); }, "tokens.idx",
               {"duplicate token position 999 at [0, 0, 100, 2]"});
}

TEST_F(ListValidation, Metadata) {
  HostTensor wrong_heads(DType::i32, {2, 4, 130, 3});
  expect_error([&] { validate(QueryLists{wrong_heads.view()}, p, "op"); }, "lists.idx", {"expected shape [2, 2, 130, *]"});
  expect_error([&] { selection_groups(Selection{QueryLists{wrong_heads.view()}}, p, "op"); }, "lists.idx",
               {"must be Hkv = 2"});
  TokenLists u32{tokens.view()};
  u32.idx.dtype = DType::u32;
  expect_error([&] { validate(u32, p, "op"); }, "tokens.idx", {"dtype u32"});
  // A device tensor's contents are left to the device backend.
  *at(tokens, 0, 0, 0, 0) = -50;
  TokenLists dev{tokens.view()};
  dev.idx.device = Device::cuda;
  EXPECT_NO_THROW(validate(dev, p, "op"));
}

TEST(SelectionValidation, DispatchesOnTheAlternative) {
  const ProblemShape p = shape(1, 128, 256, 2, 1);
  EXPECT_NO_THROW(validate(Selection{AllBlocks{}}, p, "dense"));
  EXPECT_EQ(selection_groups(Selection{AllBlocks{}}, p, "dense"), 1);
  OwnedBits bits{HostTensor(DType::u32, {1, 2, 1, 1})};
  bits.bits.data<std::uint32_t>()[0] = 0x3u;
  bits.bits.data<std::uint32_t>()[1] = 0x4u;  // block 2 of Tk = 2
  expect_error([&] { validate(Selection{bits.view()}, p, "sparse_attention"); }, "bits.bits",
               {"sparse_attention: argument 'bits.bits'", "[0, 1, 0, 0]"});
  ProblemShape bad = p;
  bad.Hq = 3;
  bad.Hkv = 2;
  expect_error([&] { validate(Selection{AllBlocks{}}, bad, "dense"); }, "problem", {"multiple of KV heads"});
}

}  // namespace
}  // namespace sparse_attn
