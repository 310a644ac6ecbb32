// KV-centric query_sparse on the CPU, in the three phases of the GPU design (docs/design.md §5.3), so that
// the decomposition itself is exercised and tested:
//   1. reverse index: for each KV block, the CSR list of (query, slot) pairs that chose it;
//   2. attention: each chosen KV block is converted to float once, and each work item runs one
//      block against the gathered queries that chose it, every head of the group, writing a partial
//      output and partial LSE per (query, head, slot);
//   3. combine: per (query, head), LSE-weighted sum of the partials in slot order (deterministic).
//
// Partials for a whole problem can be far larger than q itself (Lq * Hq * Kq * D), so the queries of
// each (batch, group) are processed in chunks whose partial buffer stays within a byte budget.

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/cpu_backend.hpp"
#include "attention/cpu_kernel.hpp"
#include "core/check.hpp"
#include "core/cpu.hpp"
#include "sparse_attn/dtype.hpp"

namespace sparse_attn::detail::cpu {
namespace {

using attn::RowTile;

// Rows (query x head pairs) per attention work item: a popular block is split into several items
// so that one block does not serialise the phase.
inline constexpr std::int64_t kRowsPerItem = 128;

struct Entry {
  std::int32_t query;  // within the chunk
  std::int32_t slot;
};

// Partial outputs [query][slot][head][D] in f32 or bf16, partial LSE [query][slot][head] in f32.
class Partials {
 public:
  Partials(std::int64_t queries, std::int64_t slots, std::int64_t heads, std::int64_t D, PartialPrecision prec)
      : slots_(slots), heads_(heads), D_(D), prec_(prec) {
    const auto n = static_cast<std::size_t>(queries * slots * heads * D);
    if (prec_ == PartialPrecision::f32) f32_.resize(n); else bf16_.resize(n);
    lse_.resize(static_cast<std::size_t>(queries * slots * heads));
  }

  /// Marks every partial of the first `queries` queries as empty (a slot nobody writes: -1 ids and
  /// blocks entirely in the causal future).
  void clear(std::int64_t queries) {
    std::fill(lse_.begin(), lse_.begin() + queries * slots_ * heads_, attn::kNegInf);
  }

  std::int64_t index(std::int64_t i, std::int64_t s, std::int64_t hh) const { return (i * slots_ + s) * heads_ + hh; }
  float& lse(std::int64_t i, std::int64_t s, std::int64_t hh) { return lse_[static_cast<std::size_t>(index(i, s, hh))]; }

  void store(std::int64_t i, std::int64_t s, std::int64_t hh, const float* src) {
    const std::int64_t off = index(i, s, hh) * D_;
    if (prec_ == PartialPrecision::f32) {
      std::copy(src, src + D_, f32_.begin() + off);
    } else {
      for (std::int64_t d = 0; d < D_; ++d) bf16_[static_cast<std::size_t>(off + d)] = float_to_bf16(src[d]);
    }
  }

  /// acc += w * partial(i, s, hh)
  void accumulate(std::int64_t i, std::int64_t s, std::int64_t hh, float w, float* acc) const {
    const std::int64_t off = index(i, s, hh) * D_;
    if (prec_ == PartialPrecision::f32) {
      const float* src = f32_.data() + off;
#pragma omp simd
      for (std::int64_t d = 0; d < D_; ++d) acc[d] = attn::fmadd(w, src[d], acc[d]);
    } else {
      const std::uint16_t* src = bf16_.data() + off;
      for (std::int64_t d = 0; d < D_; ++d) acc[d] = attn::fmadd(w, bf16_to_float(src[d]), acc[d]);
    }
  }

 private:
  std::int64_t slots_, heads_, D_;
  PartialPrecision prec_;
  std::vector<float> f32_;
  std::vector<std::uint16_t> bf16_;
  std::vector<float> lse_;
};

// CSR reverse index of one chunk: offsets[blk] .. offsets[blk + 1] into entries, ascending (query, slot).
struct ReverseIndex {
  std::vector<std::int64_t> offsets;
  std::vector<Entry> entries;
};

ReverseIndex build_reverse_index(const AttentionCall& a, const QueryLists& lists, std::int64_t b, std::int64_t g,
                                 std::int64_t i0, std::int64_t nq) {
  const ProblemShape& p = a.p;
  const std::int64_t Tk = p.Tk(), Kq = lists.idx.shape[3];
  const TensorView& idx = lists.idx;
  ReverseIndex ri;
  ri.offsets.assign(static_cast<std::size_t>(Tk + 1), 0);
  // Pass 1 counts, pass 2 fills; both walk (query, slot) in ascending order, which fixes the order
  // inside each block's list.
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<std::int64_t> fill;
    if (pass == 1) {
      for (std::int64_t j = 0; j < Tk; ++j) ri.offsets[static_cast<std::size_t>(j + 1)] += ri.offsets[static_cast<std::size_t>(j)];
      ri.entries.resize(static_cast<std::size_t>(ri.offsets.back()));
      fill.assign(ri.offsets.begin(), ri.offsets.end() - 1);
    }
    for (std::int64_t qi = 0; qi < nq; ++qi) {
      const std::int64_t i = i0 + qi;
      const std::int64_t limit = p.causal ? i + p.offset() : p.Lk - 1;
      const auto* row = reinterpret_cast<const std::int32_t*>(addr4(idx, b, g, i, 0));
      for (std::int64_t s = 0; s < Kq; ++s) {
        const std::int64_t j = row[s * idx.stride[3]];
        if (j == -1) continue;
        if (j < 0 || j >= Tk)  // not require(): its message would be built for every entry
          throw Error("query_sparse", "lists.idx",
                      "block id " + std::to_string(j) + " at " + coord_string({b, g, i, s}) +
                          " is out of range [0, " + std::to_string(Tk) + ") (-1 marks an empty slot)");
        if (j * kBlockK > limit) continue;  // entirely in the query's future: the partial stays empty
        if (pass == 0) {
          ++ri.offsets[static_cast<std::size_t>(j + 1)];
        } else {
          ri.entries[static_cast<std::size_t>(fill[static_cast<std::size_t>(j)]++)] =
              Entry{static_cast<std::int32_t>(qi), static_cast<std::int32_t>(s)};
        }
      }
    }
  }
  return ri;
}

struct WorkItem {
  std::int64_t block, begin, end;  // entries [begin, end) of the block's list
};

}  // namespace

void query_sparse(const AttentionCall& a, const QueryCall& c, std::int64_t partial_budget) {
  const ProblemShape& p = a.p;
  const QueryLists& lists = c.lists;
  const PartialPrecision precision = c.partials;
  const std::int64_t group = p.group_size();
  const std::int64_t Kq = c.Kq;
  const std::int64_t Tk = p.Tk();
  const std::int64_t per_query_bytes =
      std::max<std::int64_t>(1, Kq * group * p.D * (precision == PartialPrecision::f32 ? 4 : 2));
  const std::int64_t chunk = std::clamp<std::int64_t>(partial_budget / per_query_bytes, 1, p.Lq);
  const std::int64_t entries_per_item = std::max<std::int64_t>(1, kRowsPerItem / group);

  Partials partials(chunk, std::max<std::int64_t>(Kq, 1), group, p.D, precision);

  for (std::int64_t b = 0; b < p.B; ++b) {
    for (std::int64_t g = 0; g < p.Hkv; ++g) {
      for (std::int64_t i0 = 0; i0 < p.Lq; i0 += chunk) {
        const std::int64_t nq = std::min(chunk, p.Lq - i0);
        partials.clear(nq);
        if (Kq > 0) {
          // ---- 1. reverse index
          const ReverseIndex ri = build_reverse_index(a, lists, b, g, i0, nq);
          std::vector<WorkItem> work;
          attn::BlockStore store(b * p.Hkv + g, 1, p.Lk, p.D);
          for (std::int64_t j = 0; j < Tk; ++j) {
            const std::int64_t e0 = ri.offsets[static_cast<std::size_t>(j)], e1 = ri.offsets[static_cast<std::size_t>(j + 1)];
            if (e1 > e0) store.mark(0, j);
            for (std::int64_t e = e0; e < e1; e += entries_per_item) work.push_back({j, e, std::min(e1, e + entries_per_item)});
          }
          store.fill(a.k, a.v);  // each chosen block converted once, whatever number of items it splits into

          // ---- 2. attention: one KV block, its gathered (query, head) rows, a fresh softmax each
          parallel_for(static_cast<std::int64_t>(work.size()), [&](std::int64_t w) {
            const WorkItem& item = work[static_cast<std::size_t>(w)];
            const attn::KVView kv = store.view(0, item.block);
            const std::int64_t n_entries = item.end - item.begin;
            RowTile tile(p.D, n_entries * group);
            tile.reset(n_entries * group);
            bool straddles = false;
            for (std::int64_t e = 0; e < n_entries; ++e) {
              const Entry& en = ri.entries[static_cast<std::size_t>(item.begin + e)];
              const std::int64_t i = i0 + en.query;
              const std::int64_t limit = p.causal ? i + p.offset() : p.Lk - 1;
              straddles = straddles || kv.start + kv.n - 1 > limit;
              for (std::int64_t hh = 0; hh < group; ++hh) {
                const std::int64_t r = e * group + hh;
                load_bhld(a.q, b, i, g * group + hh, tile.q_row(r));
                tile.limit[static_cast<std::size_t>(r)] = limit;
              }
            }
            attn::block_step(tile, kv, a.scale, straddles);
            std::vector<float> row(static_cast<std::size_t>(p.D));
            for (std::int64_t e = 0; e < n_entries; ++e) {
              const Entry& en = ri.entries[static_cast<std::size_t>(item.begin + e)];
              for (std::int64_t hh = 0; hh < group; ++hh) {
                const float l = attn::finalize_row(tile, e * group + hh, row.data(), a.scale);
                partials.store(en.query, en.slot, hh, row.data());
                partials.lse(en.query, en.slot, hh) = l;
              }
            }
          });
        }

        // ---- 3. combine in slot order
        parallel_for(nq, [&](std::int64_t qi) {
          const std::int64_t i = i0 + qi;
          std::vector<float> acc(static_cast<std::size_t>(p.D));
          for (std::int64_t hh = 0; hh < group; ++hh) {
            const std::int64_t h = g * group + hh;
            // A NaN partial (a NaN or +inf score in that block) makes the row NaN; -inf ones are empty.
            float m = attn::kNegInf;
            bool nan = false;
            for (std::int64_t s = 0; s < Kq; ++s) {
              m = std::max(m, partials.lse(qi, s, hh));
              nan = nan || std::isnan(partials.lse(qi, s, hh));
            }
            constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
            float lse = nan ? kNaN : attn::kNegInf;
            std::fill(acc.begin(), acc.end(), nan ? kNaN : 0.0f);
            if (!nan && m != attn::kNegInf) {
              float sum = 0.0f;
              for (std::int64_t s = 0; s < Kq; ++s) sum += attn::exp_f32(partials.lse(qi, s, hh) - m);
              lse = m + std::log(sum);
              for (std::int64_t s = 0; s < Kq; ++s) {
                const float li = partials.lse(qi, s, hh);
                if (li == attn::kNegInf) continue;
                partials.accumulate(qi, s, hh, attn::exp_f32(li - lse), acc.data());
              }
            }
            store_row(a.out, addr4(a.out, b, i, h, 0), p.D, acc.data());
            if (a.lse) *attn::lse_ptr(*a.lse, b, h, i) = lse;
          }
        });
      }
    }
  }
}

}  // namespace sparse_attn::detail::cpu
