// token_sparse on the CPU: the heads of one query group form the rows, the query's listed key
// positions (shared by those heads) are gathered into blocks of up to kBlockK keys, and the shared
// mainloop runs over those blocks. Keys in the query's causal future are dropped while gathering, so
// the gathered blocks need no mask.

#include <algorithm>
#include <string>
#include <vector>

#include "attention/cpu_backend.hpp"
#include "attention/cpu_kernel.hpp"
#include "core/check.hpp"
#include "core/cpu.hpp"

namespace sparse_attn::detail::cpu {

namespace {
// Queries per work item: enough to amortise the scratch buffers, few enough to balance threads.
inline constexpr std::int64_t kQueriesPerItem = 16;
}  // namespace

void token_sparse(const AttentionCall& a, const TokenCall& t) {
  const ProblemShape& p = a.p;
  const std::int64_t group = p.group_size();
  const std::int64_t Kt = t.Kt;
  const TensorView& idx = t.tokens.idx;
  const std::int64_t chunks = ceil_div(p.Lq, kQueriesPerItem);

  parallel_for(p.B * p.Hkv * chunks, [&](std::int64_t item) {
    const std::int64_t c = item % chunks;
    const std::int64_t g = (item / chunks) % p.Hkv;
    const std::int64_t b = item / (chunks * p.Hkv);
    attn::KVBlock kv(p.D);
    attn::RowTile tile(p.D, group);
    std::vector<float> row(static_cast<std::size_t>(p.D));
    for (std::int64_t i = c * kQueriesPerItem; i < std::min(p.Lq, (c + 1) * kQueriesPerItem); ++i) {
      const std::int64_t limit = p.causal ? i + p.offset() : p.Lk - 1;
      tile.reset(group);
      for (std::int64_t hh = 0; hh < group; ++hh) load_bhld(a.q, b, i, g * group + hh, tile.q_row(hh));
      const auto* list = reinterpret_cast<const std::int32_t*>(addr4(idx, b, g, i, 0));
      kv.begin(0);
      for (std::int64_t s = 0; s < Kt; ++s) {
        const std::int64_t pos = list[s * idx.stride[3]];
        if (pos == -1) continue;
        if (pos < 0 || pos >= p.Lk)  // not require(): its message would be built for every key
          throw Error("token_sparse", "tokens.idx",
                      "key position " + std::to_string(pos) + " at " + coord_string({b, g, i, s}) +
                          " is out of range [0, " + std::to_string(p.Lk) + ") (-1 marks an empty slot)");
        if (pos > limit) continue;
        kv.push(a.k, a.v, b, pos, g);
        if (kv.n == kBlockK) {
          attn::block_step(tile, kv.view(), a.scale, false);
          kv.begin(0);
        }
      }
      attn::block_step(tile, kv.view(), a.scale, false);
      for (std::int64_t hh = 0; hh < group; ++hh) {
        const float l = attn::finalize_row(tile, hh, row.data(), a.scale);
        store_row(a.out, addr4(a.out, b, i, g * group + hh, 0), p.D, row.data());
        if (a.lse) *attn::lse_ptr(*a.lse, b, g * group + hh, i) = l;
      }
    }
  });
}

}  // namespace sparse_attn::detail::cpu
