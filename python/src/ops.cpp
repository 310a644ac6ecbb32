// Executors. Every output is passed in (the Python layer allocates it with the caller's array
// library), and the GIL is released while the C++ operator runs.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "binding.hpp"

namespace sparse_attn::python {

using namespace nb::literals;

namespace {

AttentionOptions attention_options(std::optional<float> scale, bool causal, bool trusted, std::uintptr_t stream) {
  AttentionOptions o;
  o.softmax_scale = scale;
  o.causal = causal;
  o.trusted = trusted;
  o.stream = stream_ptr(stream);
  return o;
}

nb::dict gated_stats(const GatedStats& s) {
  nb::dict d;
  d["kept_blocks"] = s.kept_blocks;
  d["visible_blocks"] = s.visible_blocks;
  d["gated_candidates"] = s.gated_candidates;
  d["gated_kept"] = s.gated_kept;
  d["density"] = s.density();
  d["deferred"] = s.deferred;
  return d;
}

nb::dict entmax_stats(const EntmaxStats& s) {
  nb::dict d;
  d["active_tiles"] = s.active_tiles;
  d["visible_tiles"] = s.visible_tiles;
  d["support"] = s.support;
  return d;
}

}  // namespace

void bind_ops(nb::module_& m) {
  m.def(
      "dense",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, std::optional<float> scale,
         bool causal, std::uintptr_t stream) {
        Imports im("dense");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v"), ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        const auto o = attention_options(scale, causal, false, stream);
        nb::gil_scoped_release release;
        sparse_attn::dense(qv, kv, vv, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none() = nb::none(), "softmax_scale"_a.none() = nb::none(),
      "causal"_a = false, "stream"_a = 0, "Dense attention into out (and lse).");

  m.def(
      "tile_sparse",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle idx, nb::handle cnt, nb::handle out, nb::handle lse,
         std::optional<float> scale, bool causal, bool trusted, std::uintptr_t stream) {
        Imports im("tile_sparse");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const TileLists tiles{im.in(idx, "tiles.idx"), im.in(cnt, "tiles.cnt")};
        const TensorView ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        const auto o = attention_options(scale, causal, trusted, stream);
        nb::gil_scoped_release release;
        sparse_attn::tile_sparse(qv, kv, vv, tiles, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "idx"_a, "cnt"_a, "out"_a, "lse"_a.none() = nb::none(),
      "softmax_scale"_a.none() = nb::none(), "causal"_a = false, "trusted"_a = false, "stream"_a = 0,
      "Q-centric block-sparse attention over TileLists (idx [B, G, Tq, Kmax], cnt [B, G, Tq]).");

  m.def(
      "bits_sparse",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle bits, nb::handle out, nb::handle lse,
         std::optional<float> scale, bool causal, bool trusted, std::uintptr_t stream) {
        Imports im("bits_sparse");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const BlockBits bb{im.in(bits, "bits.bits")};
        const TensorView ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        const auto o = attention_options(scale, causal, trusted, stream);
        nb::gil_scoped_release release;
        sparse_attn::bits_sparse(qv, kv, vv, bb, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "bits"_a, "out"_a, "lse"_a.none() = nb::none(),
      "softmax_scale"_a.none() = nb::none(), "causal"_a = false, "trusted"_a = false, "stream"_a = 0,
      "Block-sparse attention over BlockBits (uint32 [B, G, Tq, ceil(Tk / 32)]).");

  m.def(
      "query_sparse",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle idx, nb::handle out, nb::handle lse,
         std::optional<float> scale, bool causal, bool trusted, const std::string& partials,
         const std::string& schedule, int merge_window, std::uintptr_t stream) {
        Imports im("query_sparse");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const QueryLists lists{im.in(idx, "lists.idx")};
        const TensorView ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        QuerySparseOptions o;
        static_cast<AttentionOptions&>(o) = attention_options(scale, causal, trusted, stream);
        o.partials = parse_partials("query_sparse", partials);
        o.schedule = parse_schedule("query_sparse", schedule);
        o.merge_window = merge_window;
        nb::gil_scoped_release release;
        sparse_attn::query_sparse(qv, kv, vv, lists, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "idx"_a, "out"_a, "lse"_a.none() = nb::none(), "softmax_scale"_a.none() = nb::none(),
      "causal"_a = false, "trusted"_a = false, "partials"_a = "f32", "schedule"_a = "kv_centric",
      "merge_window"_a = 0, "stream"_a = 0,
      "Attention over QueryLists (idx [B, Hkv, Lq, Kq], -1 = empty slot); schedule 'kv_centric' or "
      "'group_centric' (GPU; the CPU runs its reference for either); merge_window: the KV-centric "
      "schedule's window of blocks merged into one partial (0 automatic, 1 off, 2 to 8).");

  m.def(
      "token_sparse",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle idx, nb::handle out, nb::handle lse,
         std::optional<float> scale, bool causal, bool trusted, std::uintptr_t stream) {
        Imports im("token_sparse");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const TokenLists tokens{im.in(idx, "tokens.idx")};
        const TensorView ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        const auto o = attention_options(scale, causal, trusted, stream);
        nb::gil_scoped_release release;
        sparse_attn::token_sparse(qv, kv, vv, tokens, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "idx"_a, "out"_a, "lse"_a.none() = nb::none(), "softmax_scale"_a.none() = nb::none(),
      "causal"_a = false, "trusted"_a = false, "stream"_a = 0,
      "Attention over TokenLists (idx [B, Hkv, Lq, Kt] key positions, -1 = empty slot).");

  m.def(
      "sparse_attention",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, const std::string& kind, nb::handle a,
         nb::handle b, nb::handle lse, std::optional<float> scale, bool causal, bool trusted,
         std::uintptr_t stream) {
        Imports im("sparse_attention");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const Selection sel = make_selection(im, kind, a, b);
        const TensorView ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        const auto o = attention_options(scale, causal, trusted, stream);
        nb::gil_scoped_release release;
        sparse_attn::sparse_attention(qv, kv, vv, sel, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "kind"_a, "a"_a.none() = nb::none(), "b"_a.none() = nb::none(),
      "lse"_a.none() = nb::none(), "softmax_scale"_a.none() = nb::none(), "causal"_a = false, "trusted"_a = false,
      "stream"_a = 0, "Attention over any selection kind ('dense', 'tiles', 'bits', 'query_lists', 'token_lists').");

  m.def(
      "gated",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle thresholds, nb::handle out, nb::handle lse,
         std::optional<float> scale, nb::handle kept_per_tile, std::uintptr_t stream, std::int64_t sink_blocks,
         nb::handle counts) {
        Imports im("gated");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const TensorView tv = im.in(thresholds, "thresholds");
        const TensorView ov = im.out(out, "out");
        const auto lv = im.out_opt(lse, "lse");
        GatedOptions o;
        o.softmax_scale = scale;
        o.stream = stream_ptr(stream);
        o.kept_per_tile = im.out_opt(kept_per_tile, "kept_per_tile");
        o.counts = im.out_opt(counts, "counts");
        o.sink_blocks = sink_blocks;
        GatedStats stats;
        {
          nb::gil_scoped_release release;
          stats = sparse_attn::gated(qv, kv, vv, tv, ov, lv, o);
        }
        return gated_stats(stats);
      },
      "q"_a, "k"_a, "v"_a, "thresholds"_a, "out"_a, "lse"_a.none() = nb::none(),
      "softmax_scale"_a.none() = nb::none(), "kept_per_tile"_a.none() = nb::none(), "stream"_a = 0,
      "sink_blocks"_a = 1, "counts"_a.none() = nb::none(),
      "Causal BSFA-gated attention; returns the gate statistics as a dict (all 0 and 'deferred' True where "
      "they went to `counts` on a CUDA device).");

  m.def(
      "entmax",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, float alpha, std::optional<float> scale,
         bool causal, int histogram_bins, nb::handle block_bits, std::uintptr_t stream) {
        Imports im("entmax");
        const TensorView qv = im.in(q, "q"), kv = im.in(k, "k"), vv = im.in(v, "v");
        const TensorView ov = im.out(out, "out");
        EntmaxOptions o;
        o.alpha = alpha;
        o.softmax_scale = scale;
        o.causal = causal;
        o.histogram_bins = histogram_bins;
        o.stream = stream_ptr(stream);
        o.block_bits = im.out_opt(block_bits, "block_bits");
        EntmaxStats stats;
        {
          nb::gil_scoped_release release;
          stats = sparse_attn::entmax(qv, kv, vv, ov, o);
        }
        return entmax_stats(stats);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "alpha"_a = 1.5f, "softmax_scale"_a.none() = nb::none(), "causal"_a = false,
      "histogram_bins"_a = 64, "block_bits"_a.none() = nb::none(), "stream"_a = 0,
      "alpha-entmax attention with block skipping; returns support statistics as a dict.");
}

}  // namespace sparse_attn::python
