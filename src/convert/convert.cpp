// Conversions between selection formats (formats.hpp): argument checks, the CPU implementation, and
// the dispatch of device tensors to the CUDA backend (src/cuda/convert), which checks the contents on
// the device and reports them as the CPU path does.
#include <algorithm>
#include <bit>
#include <optional>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "core/cpu.hpp"
#include "core/format_rows.hpp"
#include "sparse_attn/formats.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/convert/backend.hpp"
#endif

namespace sparse_attn {

using detail::bit_words;
using detail::Fault;
using detail::load3_i32;
using detail::load4;
using detail::require_cpu;
using detail::scan_rows;
using detail::store3_i32;

void tile_lists_to_block_bits(const TileLists& in, const BlockBits& out, const ProblemShape& p) {
  tile_lists_to_block_bits(in, out, p, ConvertOptions{});
}

void tile_lists_to_block_bits(const TileLists& in, const BlockBits& out, const ProblemShape& p,
                              const ConvertOptions& options) {
  const std::string op = "tile_lists_to_block_bits";
  validate(in, p, op, "in");
  const std::int64_t G = in.idx.shape[1];
  detail::check_tensor(op, "out.bits", out.bits, 4, {DType::u32});
  detail::check_shape(op, "out.bits", out.bits, {p.B, G, p.Tq(), bit_words(p)});
  detail::check_last_contiguous(op, "out.bits", out.bits);
  if (in.idx.device != Device::cpu) {
    // Metadata here, contents on the device (the backend reports them as the CPU path below does).
    detail::check_same_device(op, "out.bits", out.bits, "in.idx", in.idx);
#if defined(SPARSE_ATTN_WITH_CUDA)
    if (in.idx.device == Device::cuda) return cuda_backend::tile_lists_to_block_bits(in, out, p, options);
#endif
    detail::unsupported_device(op, "in.idx", in.idx);
  }
  (void)options;
  require_cpu(op, "out.bits", out.bits);
  const std::int64_t Tq = p.Tq(), W = bit_words(p);
  detail::parallel_for(p.B * G * Tq, [&](std::int64_t r) {
    const std::int64_t b = r / (G * Tq), g = r / Tq % G, t = r % Tq;
    auto* words = reinterpret_cast<std::uint32_t*>(detail::addr4(out.bits, b, g, t, 0));
    std::fill(words, words + W, 0u);
    const std::int32_t c = load3_i32(in.cnt, b, g, t);
    for (std::int64_t k = 0; k < c; ++k) {
      const auto id = load4<std::int32_t>(in.idx, b, g, t, k);
      words[id / 32] |= std::uint32_t{1} << (id % 32);
    }
  });
}

namespace {

/// Writes ascending ids of the set bits of `words` into row (b, g, t) of `out`, -1 past the count.
void write_tile_row(const TileLists& out, std::int64_t b, std::int64_t g, std::int64_t t, const std::uint32_t* words,
                    std::int64_t W) {
  const std::int64_t Kmax = out.idx.shape[3];
  auto* ids = reinterpret_cast<std::int32_t*>(detail::addr4(out.idx, b, g, t, 0));
  std::int64_t n = 0;
  for (std::int64_t w = 0; w < W; ++w) {
    for (std::uint32_t x = words[w]; x != 0; x &= x - 1u)
      ids[n++] = static_cast<std::int32_t>(w * 32 + std::countr_zero(x));
  }
  std::fill(ids + n, ids + Kmax, -1);
  store3_i32(out.cnt, b, g, t, static_cast<std::int32_t>(n));
}

void check_tile_output_shape(const std::string& op, const TileLists& out, const ProblemShape& p, std::int64_t G) {
  detail::check_tensor(op, "out.idx", out.idx, 4, {DType::i32});
  detail::check_tensor(op, "out.cnt", out.cnt, 3, {DType::i32});
  detail::check_shape(op, "out.idx", out.idx, {p.B, G, p.Tq(), -1});
  detail::check_shape(op, "out.cnt", out.cnt, {p.B, G, p.Tq()});
  detail::check_last_contiguous(op, "out.idx", out.idx);
}

void check_tile_output(const std::string& op, const TileLists& out, const ProblemShape& p, std::int64_t G) {
  check_tile_output_shape(op, out, p, G);
  require_cpu(op, "out.idx", out.idx);
  require_cpu(op, "out.cnt", out.cnt);
}

/// Throws if any row of `words` ([rows, W]) has more set bits than Kmax, naming the first such tile.
void check_capacity(const std::string& op, const std::vector<std::uint32_t>& words, std::int64_t W, std::int64_t G,
                    std::int64_t Tq, std::int64_t Kmax, const char* what) {
  const std::int64_t rows = W ? static_cast<std::int64_t>(words.size()) / W : 0;
  scan_rows(op, rows, [&](std::int64_t r, std::vector<std::int64_t>&) -> std::optional<Fault> {
    std::int64_t n = 0;
    for (std::int64_t w = 0; w < W; ++w) n += std::popcount(words[static_cast<std::size_t>(r * W + w)]);
    if (n <= Kmax) return std::nullopt;
    return Fault{"out.idx", detail::over_capacity_message(what, r / (G * Tq), r / Tq % G, r % Tq, n, Kmax)};
  });
}

}  // namespace

void block_bits_to_tile_lists(const BlockBits& in, const TileLists& out, const ProblemShape& p) {
  block_bits_to_tile_lists(in, out, p, ConvertOptions{});
}

void block_bits_to_tile_lists(const BlockBits& in, const TileLists& out, const ProblemShape& p,
                              const ConvertOptions& options) {
  const std::string op = "block_bits_to_tile_lists";
  validate(in, p, op, "in");
  const std::int64_t G = in.bits.shape[1], Tq = p.Tq(), W = bit_words(p);
  if (in.bits.device != Device::cpu) {
    // Metadata here, contents on the device (the backend reports them as the CPU path below does).
    check_tile_output_shape(op, out, p, G);
    detail::check_same_device(op, "out.idx", out.idx, "in.bits", in.bits);
    detail::check_same_device(op, "out.cnt", out.cnt, "in.bits", in.bits);
#if defined(SPARSE_ATTN_WITH_CUDA)
    if (in.bits.device == Device::cuda) return cuda_backend::block_bits_to_tile_lists(in, out, p, options, op, "in");
#endif
    detail::unsupported_device(op, "in.bits", in.bits);
  }
  (void)options;
  check_tile_output(op, out, p, G);
  // Gather the words densely first so the capacity check runs before anything is written.
  std::vector<std::uint32_t> words(static_cast<std::size_t>(p.B * G * Tq * W));
  detail::parallel_for(p.B * G * Tq, [&](std::int64_t r) {
    const std::int64_t b = r / (G * Tq), g = r / Tq % G, t = r % Tq;
    const auto* src = reinterpret_cast<const std::uint32_t*>(detail::addr4(in.bits, b, g, t, 0));
    std::copy(src, src + W, words.begin() + r * W);
  });
  check_capacity(op, words, W, G, Tq, out.idx.shape[3], "the bit set");
  detail::parallel_for(p.B * G * Tq, [&](std::int64_t r) {
    write_tile_row(out, r / (G * Tq), r / Tq % G, r % Tq, words.data() + r * W, W);
  });
}

void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p) {
  query_lists_to_tile_lists(in, out, p, ConvertOptions{});
}

void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                               const ConvertOptions& options) {
  const std::string op = "query_lists_to_tile_lists";
  if (in.idx.device != Device::cpu) {
    // Metadata here, contents on the device (the backend reports them as the CPU path below does).
    validate(in, p, op, "in");
    check_tile_output_shape(op, out, p, p.Hkv);
    detail::check_same_device(op, "out.idx", out.idx, "in.idx", in.idx);
    detail::check_same_device(op, "out.cnt", out.cnt, "in.idx", in.idx);
#if defined(SPARSE_ATTN_WITH_CUDA)
    if (in.idx.device == Device::cuda) return cuda_backend::query_lists_to_tile_lists(in, out, p, options);
#endif
    detail::unsupported_device(op, "in.idx", in.idx);
  }
  validate(in, p, op, "in");
  const std::int64_t G = p.Hkv, Tq = p.Tq(), W = bit_words(p), K = in.idx.shape[3];
  check_tile_output(op, out, p, G);
  std::vector<std::uint32_t> words(static_cast<std::size_t>(p.B * G * Tq * W), 0u);
  detail::parallel_for(p.B * G * Tq, [&](std::int64_t r) {
    const std::int64_t b = r / (G * Tq), g = r / Tq % G, t = r % Tq;
    std::uint32_t* u = words.data() + r * W;
    const std::int64_t i_end = std::min(p.Lq, (t + 1) * kTileQ);
    for (std::int64_t i = t * kTileQ; i < i_end; ++i) {
      const auto* ids = reinterpret_cast<const std::int32_t*>(detail::addr4(in.idx, b, g, i, 0));
      for (std::int64_t k = 0; k < K; ++k)
        if (ids[k] >= 0) u[ids[k] / 32] |= std::uint32_t{1} << (ids[k] % 32);
    }
  });
  check_capacity(op, words, W, G, Tq, out.idx.shape[3], "the union");
  detail::parallel_for(p.B * G * Tq, [&](std::int64_t r) {
    write_tile_row(out, r / (G * Tq), r / Tq % G, r % Tq, words.data() + r * W, W);
  });
}

}  // namespace sparse_attn
