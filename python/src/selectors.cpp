// Selectors: the caller passes the list tensors to fill.
#include <nanobind/stl/string.h>

#include "binding.hpp"

namespace sparse_attn::python {

using namespace nb::literals;

void bind_selectors(nb::module_& m) {
  m.def(
      "pooled_select",
      [](nb::handle q, nb::handle k, nb::handle idx, nb::handle cnt, int representatives, int top_k,
         bool force_local, bool force_block0, bool causal, nb::handle workspace, std::uintptr_t stream) {
        Imports im("pooled_select");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k");
        const TileLists out{im.out(idx, "out.idx"), im.out(cnt, "out.cnt")};
        PooledOptions o;
        o.representatives = representatives;
        o.top_k = top_k;
        o.force_local = force_local;
        o.force_block0 = force_block0;
        o.causal = causal;
        if (!workspace.is_none()) o.workspace = im.out(workspace, "options.workspace");
        o.stream = stream_ptr(stream);
        nb::gil_scoped_release release;
        sparse_attn::pooled_select(qv, kv, out, o);
      },
      "q"_a, "k"_a, "idx"_a, "cnt"_a, "representatives"_a = 1, "top_k"_a = 16, "force_local"_a = true,
      "force_block0"_a = false, "causal"_a = false, "workspace"_a.none() = nb::none(), "stream"_a = 0,
      "R1 / R4 pooled selector into TileLists idx [B, Hkv, Tq, Kmax], cnt [B, Hkv, Tq].");

  m.def(
      "token_max_select",
      [](nb::handle qidx, nb::handle kidx, nb::handle idx, nb::handle cnt, int top_k, const std::string& precision,
         bool causal, bool reserve_local, bool force_block0, nb::handle workspace, std::uintptr_t stream) {
        Imports im("token_max_select");
        const TensorView qv = im.in(qidx, "qidx"), kv = im.in(kidx, "kidx");
        TokenMaxOptions o;
        o.top_k = top_k;
        o.precision = parse_precision("token_max_select", precision);
        o.causal = causal;
        o.reserve_local = reserve_local;
        o.force_block0 = force_block0;
        if (!workspace.is_none()) o.workspace = im.out(workspace, "options.workspace");
        o.stream = stream_ptr(stream);
        if (cnt.is_none()) {
          const QueryLists out{im.out(idx, "out.idx")};
          nb::gil_scoped_release release;
          sparse_attn::token_max_select(qv, kv, out, o);
        } else {
          const TileLists out{im.out(idx, "out.idx"), im.out(cnt, "out.cnt")};
          nb::gil_scoped_release release;
          sparse_attn::token_max_select(qv, kv, out, o);
        }
      },
      "qidx"_a, "kidx"_a, "idx"_a, "cnt"_a.none() = nb::none(), "top_k"_a = 16, "precision"_a = "bf16",
      "causal"_a = true, "reserve_local"_a = true, "force_block0"_a = false, "workspace"_a.none() = nb::none(),
      "stream"_a = 0,
      "MSA token-max selector: QueryLists into idx [B, Hkv, Lq, Kq] when cnt is None, else TileLists.");

  m.def(
      "lightning_select",
      [](nb::handle qI, nb::handle w, nb::handle kI, nb::handle idx, bool blocks, int top_k, bool causal,
         const std::string& precision, int sink_keys, nb::handle workspace, std::uintptr_t stream) {
        Imports im("lightning_select");
        const TensorView qv = im.in(qI, "qI"), wv = im.in(w, "w"), kv = im.in(kI, "kI");
        LightningOptions o;
        o.top_k = top_k;
        o.causal = causal;
        o.precision = parse_precision("lightning_select", precision);
        o.sink_keys = sink_keys;
        if (!workspace.is_none()) o.workspace = im.out(workspace, "options.workspace");
        o.stream = stream_ptr(stream);
        if (blocks) {
          const QueryLists out{im.out(idx, "out.idx")};
          nb::gil_scoped_release release;
          sparse_attn::lightning_select(qv, wv, kv, out, o);
        } else {
          const TokenLists out{im.out(idx, "out.idx")};
          nb::gil_scoped_release release;
          sparse_attn::lightning_select(qv, wv, kv, out, o);
        }
      },
      "qI"_a, "w"_a, "kI"_a, "idx"_a, "blocks"_a = false, "top_k"_a = 2048, "causal"_a = true,
      "precision"_a = "fp8_e4m3", "sink_keys"_a = 0, "workspace"_a.none() = nb::none(), "stream"_a = 0,
      "DSA lightning indexer: top-k keys per query (TokenLists), or blocks (QueryLists) when blocks=True.");

  m.def(
      "pooled_workspace_bytes",
      [](nb::handle q, nb::handle k, int representatives) {
        Imports im("pooled_workspace_bytes");
        PooledOptions o;
        o.representatives = representatives;
        return sparse_attn::pooled_workspace_bytes(im.in(q, "q"), im.in(k, "k"), o);
      },
      "q"_a, "k"_a, "representatives"_a = 1,
      "Bytes of device scratch a CUDA pooled_select of these inputs takes (0 on the CPU).");
  m.def(
      "token_max_workspace_bytes",
      [](nb::handle qidx, nb::handle kidx, bool tiles, const std::string& precision) {
        Imports im("token_max_workspace_bytes");
        TokenMaxOptions o;
        o.precision = parse_precision("token_max_workspace_bytes", precision);
        return sparse_attn::token_max_workspace_bytes(im.in(qidx, "qidx"), im.in(kidx, "kidx"), tiles, o);
      },
      "qidx"_a, "kidx"_a, "tiles"_a, "precision"_a = "bf16",
      "Bytes of device scratch a CUDA token_max_select takes (TileLists when tiles; 0 on the CPU).");
  m.def(
      "lightning_workspace_bytes",
      [](nb::handle qI, nb::handle kI, bool blocks, int top_k, const std::string& precision) {
        Imports im("lightning_workspace_bytes");
        LightningOptions o;
        o.top_k = top_k;
        o.precision = parse_precision("lightning_workspace_bytes", precision);
        return sparse_attn::lightning_workspace_bytes(im.in(qI, "qI"), im.in(kI, "kI"), !blocks, o);
      },
      "qI"_a, "kI"_a, "blocks"_a = false, "top_k"_a = 2048, "precision"_a = "fp8_e4m3",
      "Bytes of device scratch a CUDA lightning_select takes (block form when blocks; 0 on the CPU).");

  m.def("precision_name", [](const std::string& p) {
    return std::string(sparse_attn::precision_name(parse_precision("precision_name", p)));
  });
}

}  // namespace sparse_attn::python
