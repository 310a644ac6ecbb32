// Q-centric CPU executors: dense, tile_sparse and bits_sparse share one driver and differ only in
// the block source, a small policy that lists a Q tile's KV blocks in ascending order.
//
// Work item = (batch, selection group, Q tile). When the selection is per KV group (G = Hkv) the
// item holds every query head of the group, so each selected K/V block is used by all of them while
// it is hot in cache (the GPU kernel's GQA pairing, on the CPU). Per-head selections (G = Hq) give
// one head per item.

#include <algorithm>
#include <bit>
#include <string>
#include <vector>

#include "attention/cpu_backend.hpp"
#include "attention/cpu_kernel.hpp"
#include "core/check.hpp"
#include "core/cpu.hpp"

namespace sparse_attn::detail::cpu {
namespace {

using attn::RowTile;

// Every block; causal skipping happens in the driver.
struct AllBlocksSource {
  std::int64_t groups;
  std::int64_t Tk;
  template <class F>
  void for_each(std::int64_t, std::int64_t, std::int64_t, F&& f) const {
    for (std::int64_t j = 0; j < Tk; ++j) f(j);
  }
};

struct TileListSource {
  TensorView idx, cnt;
  std::int64_t groups;
  std::int64_t Tk;
  template <class F>
  void for_each(std::int64_t b, std::int64_t g, std::int64_t t, F&& f) const {
    const std::int64_t kmax = idx.shape[3];
    const auto c = *reinterpret_cast<const std::int32_t*>(
        static_cast<const char*>(cnt.data) + 4 * (b * cnt.stride[0] + g * cnt.stride[1] + t * cnt.stride[2]));
    // Checks on ids are written as if + throw, not require(): require's message would be built
    // for every id read.
    if (c < 0 || c > kmax)
      throw Error("tile_sparse", "tiles.cnt",
                  "count " + std::to_string(c) + " at " + coord_string({b, g, t}) + " is outside [0, " +
                      std::to_string(kmax) + "]");
    const auto* row = reinterpret_cast<const std::int32_t*>(addr4(idx, b, g, t, 0));
    for (std::int64_t s = 0; s < c; ++s) {
      const std::int64_t j = row[s * idx.stride[3]];
      if (j < 0 || j >= Tk)
        throw Error("tile_sparse", "tiles.idx",
                    "block id " + std::to_string(j) + " at " + coord_string({b, g, t, s}) + " is out of range [0, " +
                        std::to_string(Tk) + ")");
      f(j);
    }
  }
};

struct BlockBitsSource {
  TensorView bits;
  std::int64_t groups;
  std::int64_t Tk;
  template <class F>
  void for_each(std::int64_t b, std::int64_t g, std::int64_t t, F&& f) const {
    const std::int64_t words = bits.shape[3];
    const auto* row = reinterpret_cast<const std::uint32_t*>(addr4(bits, b, g, t, 0));
    for (std::int64_t w = 0; w < words; ++w) {
      std::uint32_t word = row[w * bits.stride[3]];
      while (word) {
        const std::int64_t j = w * 32 + std::countr_zero(word);
        word &= word - 1;
        if (j >= Tk)
          throw Error("bits_sparse", "bits.bits",
                      "bit for block " + std::to_string(j) + " at " + coord_string({b, g, t, w}) + " is past Tk = " +
                          std::to_string(Tk));
        f(j);
      }
    }
  }
};

template <class Source>
void run_q_centric(const AttentionCall& a, const Source& src, std::int64_t kv_store_budget) {
  const ProblemShape& p = a.p;
  const std::int64_t group = p.group_size();
  const bool per_kv_group = src.groups == p.Hkv;
  const std::int64_t heads_per_item = per_kv_group ? group : 1;
  const std::int64_t sel_per_kv = src.groups / p.Hkv;  // selection groups per KV head: 1 or group
  const std::int64_t Tq = p.Tq(), Tk = p.Tk();
  const std::int64_t pair_bytes = Tk * (attn::kt_floats(p.D) + attn::v_floats(p.D)) * std::int64_t(sizeof(float));
  const std::int64_t pairs_total = p.B * p.Hkv;
  // K and V are converted once per pass into a BlockStore; a pass covers as many (batch, KV head)
  // pairs as a dense store within the budget holds.
  const std::int64_t pairs_per_chunk = std::clamp<std::int64_t>(kv_store_budget / pair_bytes, 1, pairs_total);

  // The causal key range of Q tile t: its first row sees up to lo, its last up to hi (inclusive).
  auto tile_limits = [&](std::int64_t t) {
    const std::int64_t i0 = t * kTileQ, i1 = std::min(p.Lq, i0 + kTileQ) - 1;
    return p.causal ? std::pair{i0 + p.offset(), i1 + p.offset()} : std::pair{p.Lk - 1, p.Lk - 1};
  };

  for (std::int64_t pair0 = 0; pair0 < pairs_total; pair0 += pairs_per_chunk) {
    const std::int64_t pairs = std::min(pairs_per_chunk, pairs_total - pair0);
    attn::BlockStore store(pair0, pairs, p.Lk, p.D);
    // Items of this chunk: (pair, selection group within the KV head, Q tile).
    const std::int64_t items = pairs * sel_per_kv * Tq;
    auto decode = [&](std::int64_t item, std::int64_t& pair, std::int64_t& b, std::int64_t& g, std::int64_t& t) {
      t = item % Tq;
      const std::int64_t sub = (item / Tq) % sel_per_kv;
      pair = item / (Tq * sel_per_kv);
      b = (pair0 + pair) / p.Hkv;
      g = ((pair0 + pair) % p.Hkv) * sel_per_kv + sub;
    };

    // Which blocks will be visited (this also range-checks every id before any work starts).
    for (std::int64_t item = 0; item < items; ++item) {
      std::int64_t pair, b, g, t;
      decode(item, pair, b, g, t);
      const std::int64_t hi = tile_limits(t).second;
      src.for_each(b, g, t, [&](std::int64_t j) {
        if (j * kBlockK <= hi) store.mark(pair, j);
      });
    }
    store.fill(a.k, a.v);

    parallel_for(items, [&](std::int64_t item) {
      std::int64_t pair, b, g, t;
      decode(item, pair, b, g, t);
      const std::int64_t h0 = per_kv_group ? g * group : g;
      const std::int64_t i0 = t * kTileQ;
      const std::int64_t rows = std::min(kTileQ, p.Lq - i0);
      const auto [lo, hi] = tile_limits(t);

      std::vector<RowTile> tiles;
      tiles.reserve(static_cast<std::size_t>(heads_per_item));
      for (std::int64_t hh = 0; hh < heads_per_item; ++hh) {
        RowTile& tile = tiles.emplace_back(p.D, kTileQ);
        tile.reset(rows);
        for (std::int64_t r = 0; r < rows; ++r) {
          load_bhld(a.q, b, i0 + r, h0 + hh, tile.q_row(r));
          tile.limit[static_cast<std::size_t>(r)] = p.causal ? i0 + r + p.offset() : p.Lk - 1;
        }
      }

      src.for_each(b, g, t, [&](std::int64_t j) {
        const std::int64_t start = j * kBlockK;
        if (start > hi) return;  // entirely in the future of every row
        const attn::KVView kv = store.view(pair, j);
        const bool straddles = start + kv.n - 1 > lo;  // only these pay for the causal prefix
        for (RowTile& tile : tiles) attn::block_step(tile, kv, a.scale, straddles);
      });

      std::vector<float> row(static_cast<std::size_t>(p.D));
      for (std::int64_t hh = 0; hh < heads_per_item; ++hh) {
        const RowTile& tile = tiles[static_cast<std::size_t>(hh)];
        for (std::int64_t r = 0; r < rows; ++r) {
          const float l = attn::finalize_row(tile, r, row.data(), a.scale);
          store_row(a.out, addr4(a.out, b, i0 + r, h0 + hh, 0), p.D, row.data());
          if (a.lse) *attn::lse_ptr(*a.lse, b, h0 + hh, i0 + r) = l;
        }
      }
    });
  }
}

}  // namespace

void dense(const AttentionCall& a, std::int64_t kv_store_budget) {
  run_q_centric(a, AllBlocksSource{a.p.Hkv, a.p.Tk()}, kv_store_budget);
}

void tile_sparse(const AttentionCall& a, const TileCall& t, std::int64_t kv_store_budget) {
  run_q_centric(a, TileListSource{t.tiles.idx, t.tiles.cnt, t.G, a.p.Tk()}, kv_store_budget);
}

void bits_sparse(const AttentionCall& a, const BlockBits& bits, std::int64_t kv_store_budget) {
  run_q_centric(a, BlockBitsSource{bits.bits, bits.bits.shape[1], a.p.Tk()}, kv_store_budget);
}

}  // namespace sparse_attn::detail::cpu
