// Selection formats: shape helpers, validators, and explicit masks (the conversions between formats
// are src/convert).
//
// Content checks report the first offending coordinate in row-major order (format_rows.hpp says how
// the rows are scanned).
#include "sparse_attn/formats.hpp"

#include <algorithm>
#include <bit>
#include <optional>
#include <sstream>
#include <type_traits>
#include <vector>

#include "core/check.hpp"
#include "core/cpu.hpp"
#include "core/format_rows.hpp"
#include "sparse_attn/error.hpp"

namespace sparse_attn {

using detail::bit_words;
using detail::coord_string;
using detail::Fault;
using detail::load3_i32;
using detail::load4;
using detail::require;
using detail::require_cpu;
using detail::scan_rows;

// ---- ProblemShape ------------------------------------------------------------------------------

std::int64_t ProblemShape::key_end(std::int64_t i) const {
  if (!causal) return Lk;
  return std::clamp<std::int64_t>(i + offset() + 1, 0, Lk);
}

std::int64_t ProblemShape::visible_pairs() const {
  if (!causal) return Lq * Lk;
  // key_end(i) = clamp(i + offset + 1, 0, Lk): zero for the first queries when Lq > Lk, then a
  // ramp, then Lk. Summing the ramp in closed form keeps this O(1) for any length.
  const std::int64_t off = offset();
  const std::int64_t first = std::clamp<std::int64_t>(-off, 0, Lq);          // first i with key_end > 0
  const std::int64_t full = std::clamp<std::int64_t>(Lk - off - 1, 0, Lq);   // first i with key_end == Lk
  std::int64_t total = 0;
  if (full > first) {
    const std::int64_t a = first + off + 1, z = full - 1 + off + 1;  // ramp values at both ends
    total += (a + z) * (full - first) / 2;
  }
  total += (Lq - std::max(full, first)) * Lk;
  return total;
}

std::string ProblemShape::describe() const {
  std::ostringstream os;
  os << "B=" << B << " Lq=" << Lq << " Lk=" << Lk << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
     << (causal ? " causal" : " non-causal");
  return os.str();
}

const char* selection_name(const Selection& s) {
  switch (s.index()) {
    case 0: return "dense";
    case 1: return "TileLists";
    case 2: return "BlockBits";
    case 3: return "QueryLists";
    case 4: return "TokenLists";
  }
  return "?";
}

namespace {

/// Stamp-based duplicate detection: scratch[v] == row means v was already seen in this row.
bool seen_before(std::vector<std::int64_t>& scratch, std::int64_t extent, std::int64_t row, std::int64_t v) {
  if (static_cast<std::int64_t>(scratch.size()) != extent) scratch.assign(static_cast<std::size_t>(extent), -1);
  std::int64_t& s = scratch[static_cast<std::size_t>(v)];
  if (s == row) return true;
  s = row;
  return false;
}

std::string range_string(std::int64_t hi) { return "[0, " + std::to_string(hi) + ")"; }

void check_problem(const std::string& op, const ProblemShape& p) {
  require(p.B > 0 && p.Lq > 0 && p.Lk > 0 && p.Hq > 0 && p.Hkv > 0, op, "problem",
          [&] { return "every extent must be > 0, got " + p.describe(); });
  detail::check_head_ratio(op, "problem", p.Hq, p.Hkv);
}

std::int64_t check_groups(const std::string& op, const std::string& arg, const TensorView& t, const ProblemShape& p) {
  const std::int64_t G = t.shape[1];
  require(G == p.Hkv || G == p.Hq, op, arg,
          [&] { return "dimension 1 (groups) is " + std::to_string(G) + " but must be Hkv = " + std::to_string(p.Hkv) +
              " or Hq = " + std::to_string(p.Hq) + " (shape " + detail::shape_string(t) + ")"; });
  return G;
}

/// Metadata of a TileLists: returns G.
std::int64_t check_tile_meta(const std::string& op, const std::string& name, const TileLists& s, const ProblemShape& p) {
  const std::string ai = name + ".idx", ac = name + ".cnt";
  detail::check_tensor(op, ai, s.idx, 4, {DType::i32});
  detail::check_tensor(op, ac, s.cnt, 3, {DType::i32});
  const std::int64_t G = check_groups(op, ai, s.idx, p);
  detail::check_shape(op, ai, s.idx, {p.B, G, p.Tq(), -1});
  detail::check_shape(op, ac, s.cnt, {p.B, G, p.Tq()});
  detail::check_last_contiguous(op, ai, s.idx);
  detail::check_last_contiguous(op, ac, s.cnt);
  detail::check_same_device(op, ac, s.cnt, ai, s.idx);
  return G;
}

std::int64_t check_bits_meta(const std::string& op, const std::string& name, const BlockBits& s, const ProblemShape& p) {
  const std::string ab = name + ".bits";
  detail::check_tensor(op, ab, s.bits, 4, {DType::u32});
  const std::int64_t G = check_groups(op, ab, s.bits, p);
  detail::check_shape(op, ab, s.bits, {p.B, G, p.Tq(), bit_words(p)});
  detail::check_last_contiguous(op, ab, s.bits);
  return G;
}

void check_list_meta(const std::string& op, const std::string& arg, const TensorView& idx, const ProblemShape& p) {
  detail::check_tensor(op, arg, idx, 4, {DType::i32});
  detail::check_shape(op, arg, idx, {p.B, p.Hkv, p.Lq, -1});
  detail::check_last_contiguous(op, arg, idx);
}

std::optional<Fault> tile_row_fault(const TileLists& s, const std::string& name, const ProblemShape& p,
                                    std::int64_t G, std::int64_t r) {
  const std::int64_t Tq = p.Tq();
  const std::int64_t b = r / (G * Tq), g = r / Tq % G, t = r % Tq;
  const auto* ids = reinterpret_cast<const std::int32_t*>(detail::addr4(s.idx, b, g, t, 0));
  if (auto m = detail::tile_row_message(ids, s.idx.stride[3], load3_i32(s.cnt, b, g, t), s.idx.shape[3], p.Tk(), b, g, t))
    return Fault{name + "." + m->first, std::move(m->second)};
  return std::nullopt;
}

std::optional<Fault> bits_row_fault(const BlockBits& s, const std::string& name, const ProblemShape& p,
                                    std::int64_t G, std::int64_t r) {
  const std::int64_t Tq = p.Tq(), Tk = p.Tk(), W = bit_words(p);
  if (Tk % 32 == 0) return std::nullopt;
  const std::int64_t b = r / (G * Tq), g = r / Tq % G, t = r % Tq;
  const auto word = load4<std::uint32_t>(s.bits, b, g, t, W - 1);
  const std::uint32_t stray = word & ~((std::uint32_t{1} << (Tk % 32)) - 1u);
  if (stray == 0) return std::nullopt;
  return Fault{name + ".bits", detail::stray_bit_message(std::countr_zero(stray), W, b, g, t, Tk)};
}

/// One row (b, g, i) of a QueryLists (`tokens` false) or TokenLists: entries >= -1, ids in range,
/// no duplicates.
std::optional<Fault> list_row_fault(const TensorView& idx, const std::string& arg, const ProblemShape& p, bool tokens,
                                    std::int64_t r, std::vector<std::int64_t>& scratch) {
  const std::int64_t extent = tokens ? p.Lk : p.Tk();
  const std::int64_t b = r / (p.Hkv * p.Lq), g = r / p.Lq % p.Hkv, i = r % p.Lq;
  const auto* row = reinterpret_cast<const std::int32_t*>(detail::addr4(idx, b, g, i, 0));
  if (std::optional<std::string> m = detail::list_row_message(row, idx.shape[3], extent, tokens, b, g, i, r, scratch))
    return Fault{arg, std::move(*m)};
  return std::nullopt;
}

}  // namespace

namespace detail {

std::pair<std::string, std::string> tile_count_message(std::int32_t c, std::int64_t Kmax, std::int64_t b,
                                                       std::int64_t g, std::int64_t t) {
  if (c < 0) return {"cnt", "negative count " + std::to_string(c) + " at " + coord_string({b, g, t})};
  return {"cnt", "count " + std::to_string(c) + " at " + coord_string({b, g, t}) +
                     " exceeds the list capacity Kmax = " + std::to_string(Kmax)};
}

std::pair<std::string, std::string> tile_id_message(std::int32_t id, std::int32_t prev, std::int64_t Tk,
                                                    std::int64_t b, std::int64_t g, std::int64_t t, std::int64_t k) {
  const std::string at = coord_string({b, g, t, k});
  if (id < 0 || id >= Tk) return {"idx", "block id " + std::to_string(id) + " at " + at + " is out of range " + range_string(Tk)};
  if (id == prev) return {"idx", "duplicate block id " + std::to_string(id) + " at " + at};
  return {"idx", "block ids must be strictly ascending: " + std::to_string(id) + " at " + at + " follows " +
                     std::to_string(prev)};
}

std::optional<std::pair<std::string, std::string>> tile_row_message(const std::int32_t* ids, std::int64_t stride,
                                                                    std::int32_t c, std::int64_t Kmax, std::int64_t Tk,
                                                                    std::int64_t b, std::int64_t g, std::int64_t t) {
  if (c < 0 || c > Kmax) return tile_count_message(c, Kmax, b, g, t);
  std::int32_t prev = -1;
  for (std::int64_t k = 0; k < c; ++k) {
    const std::int32_t id = ids[k * stride];
    // The message (and its coordinate string) is built only for a fault.
    if (id < 0 || id >= Tk || (k > 0 && id <= prev)) return tile_id_message(id, prev, Tk, b, g, t, k);
    prev = id;
  }
  return std::nullopt;
}

std::optional<std::string> list_row_message(const std::int32_t* row, std::int64_t K, std::int64_t extent, bool tokens,
                                            std::int64_t b, std::int64_t g, std::int64_t i, std::int64_t r,
                                            std::vector<std::int64_t>& scratch) {
  const char* what = tokens ? "token position " : "block id ";
  for (std::int64_t k = 0; k < K; ++k) {
    const std::int32_t v = row[k];
    if (v == -1) continue;
    if (v >= 0 && v < extent && !seen_before(scratch, extent, r, v)) continue;
    // Fault path only: build the coordinate string now.
    const std::string at = coord_string({b, g, i, k});
    if (v < -1) return "invalid value " + std::to_string(v) + " at " + at + " (only -1 may mark an empty slot)";
    if (v >= extent) return what + std::to_string(v) + " at " + at + " is out of range " + range_string(extent);
    return "duplicate " + (what + std::to_string(v)) + " at " + at;
  }
  return std::nullopt;
}

}  // namespace detail

// ---- validation --------------------------------------------------------------------------------

void validate(const TileLists& s, const ProblemShape& p, const std::string& op, const std::string& name) {
  check_problem(op, p);
  const std::int64_t G = check_tile_meta(op, name, s, p);
  if (s.idx.device != Device::cpu) return;
  scan_rows(op, p.B * G * p.Tq(),
            [&](std::int64_t r, std::vector<std::int64_t>&) { return tile_row_fault(s, name, p, G, r); });
}

void validate(const BlockBits& s, const ProblemShape& p, const std::string& op, const std::string& name) {
  check_problem(op, p);
  const std::int64_t G = check_bits_meta(op, name, s, p);
  if (s.bits.device != Device::cpu) return;
  scan_rows(op, p.B * G * p.Tq(),
            [&](std::int64_t r, std::vector<std::int64_t>&) { return bits_row_fault(s, name, p, G, r); });
}

void validate(const QueryLists& s, const ProblemShape& p, const std::string& op, const std::string& name) {
  check_problem(op, p);
  const std::string arg = name + ".idx";
  check_list_meta(op, arg, s.idx, p);
  if (s.idx.device != Device::cpu) return;
  scan_rows(op, p.B * p.Hkv * p.Lq, [&](std::int64_t r, std::vector<std::int64_t>& scratch) {
    return list_row_fault(s.idx, arg, p, false, r, scratch);
  });
}

void validate(const TokenLists& s, const ProblemShape& p, const std::string& op, const std::string& name) {
  check_problem(op, p);
  const std::string arg = name + ".idx";
  check_list_meta(op, arg, s.idx, p);
  if (s.idx.device != Device::cpu) return;
  scan_rows(op, p.B * p.Hkv * p.Lq, [&](std::int64_t r, std::vector<std::int64_t>& scratch) {
    return list_row_fault(s.idx, arg, p, true, r, scratch);
  });
}

void validate(const Selection& s, const ProblemShape& p, const std::string& op) {
  std::visit(
      [&](const auto& sel) {
        using T = std::decay_t<decltype(sel)>;
        if constexpr (std::is_same_v<T, AllBlocks>) {
          check_problem(op, p);
        } else {
          validate(sel, p, op);
        }
      },
      s);
}

std::int64_t selection_groups(const Selection& s, const ProblemShape& p, const std::string& op) {
  check_problem(op, p);
  return std::visit(
      [&](const auto& sel) -> std::int64_t {
        using T = std::decay_t<decltype(sel)>;
        if constexpr (std::is_same_v<T, AllBlocks>) {
          return p.Hkv;
        } else if constexpr (std::is_same_v<T, TileLists>) {
          detail::check_tensor(op, "tiles.idx", sel.idx, 4, {DType::i32});
          return check_groups(op, "tiles.idx", sel.idx, p);
        } else if constexpr (std::is_same_v<T, BlockBits>) {
          detail::check_tensor(op, "bits.bits", sel.bits, 4, {DType::u32});
          return check_groups(op, "bits.bits", sel.bits, p);
        } else {
          // Per-query formats are always per GQA group.
          const std::string arg = std::is_same_v<T, QueryLists> ? "lists.idx" : "tokens.idx";
          detail::check_tensor(op, arg, sel.idx, 4, {DType::i32});
          require(sel.idx.shape[1] == p.Hkv, op, arg,
                  [&] { return "dimension 1 (groups) is " + std::to_string(sel.idx.shape[1]) + " but must be Hkv = " +
                      std::to_string(p.Hkv); });
          return p.Hkv;
        }
      },
      s);
}

// ---- masks -------------------------------------------------------------------------------------

namespace {

/// Marks keys [j0, j1) ∩ [0, end) of the row.
void mark(std::uint8_t* row, std::int64_t j0, std::int64_t j1, std::int64_t end) {
  j1 = std::min(j1, end);
  if (j0 < j1) std::fill(row + j0, row + j1, std::uint8_t{1});
}

void mark_block(std::uint8_t* row, std::int64_t block, const ProblemShape& p, std::int64_t end) {
  mark(row, block * kBlockK, std::min(p.Lk, (block + 1) * kBlockK), end);
}

/// Checks the metadata selection_row relies on (shapes, dtypes, CPU), without content checks.
void check_row_meta(const std::string& op, const Selection& s, const ProblemShape& p) {
  std::visit(
      [&](const auto& sel) {
        using T = std::decay_t<decltype(sel)>;
        if constexpr (std::is_same_v<T, TileLists>) {
          check_tile_meta(op, "tiles", sel, p);
          require_cpu(op, "tiles.idx", sel.idx);
        } else if constexpr (std::is_same_v<T, BlockBits>) {
          check_bits_meta(op, "bits", sel, p);
          require_cpu(op, "bits.bits", sel.bits);
        } else if constexpr (std::is_same_v<T, QueryLists>) {
          check_list_meta(op, "lists.idx", sel.idx, p);
          require_cpu(op, "lists.idx", sel.idx);
        } else if constexpr (std::is_same_v<T, TokenLists>) {
          check_list_meta(op, "tokens.idx", sel.idx, p);
          require_cpu(op, "tokens.idx", sel.idx);
        }
      },
      s);
}

/// Fills the row; the contents it reads are checked so that a bad selection throws rather than
/// writing out of bounds (full validation is the caller's choice).
void fill_row(const std::string& op, const Selection& s, const ProblemShape& p, std::int64_t b, std::int64_t h,
              std::int64_t i, std::uint8_t* row) {
  std::fill(row, row + p.Lk, std::uint8_t{0});
  const std::int64_t end = p.key_end(i);
  const std::int64_t t = i / kTileQ, hk = h / p.group_size();
  std::visit(
      [&](const auto& sel) {
        using T = std::decay_t<decltype(sel)>;
        if constexpr (std::is_same_v<T, AllBlocks>) {
          mark(row, 0, p.Lk, end);
        } else if constexpr (std::is_same_v<T, TileLists>) {
          const std::int64_t G = sel.idx.shape[1];
          const std::int64_t g = G == p.Hq ? h : hk;
          if (auto f = tile_row_fault(sel, "tiles", p, G, (b * G + g) * p.Tq() + t))
            throw Error(op, f->argument, f->message);
          const std::int32_t c = load3_i32(sel.cnt, b, g, t);
          for (std::int64_t k = 0; k < c; ++k) mark_block(row, load4<std::int32_t>(sel.idx, b, g, t, k), p, end);
        } else if constexpr (std::is_same_v<T, BlockBits>) {
          const std::int64_t G = sel.bits.shape[1];
          const std::int64_t g = G == p.Hq ? h : hk;
          if (auto f = bits_row_fault(sel, "bits", p, G, (b * G + g) * p.Tq() + t))
            throw Error(op, f->argument, f->message);
          const auto* words = reinterpret_cast<const std::uint32_t*>(detail::addr4(sel.bits, b, g, t, 0));
          for (std::int64_t w = 0; w < bit_words(p); ++w)
            for (std::uint32_t x = words[w]; x != 0; x &= x - 1u) mark_block(row, w * 32 + std::countr_zero(x), p, end);
        } else {
          constexpr bool tokens = std::is_same_v<T, TokenLists>;
          const std::int64_t K = sel.idx.shape[3];
          const auto* ids = reinterpret_cast<const std::int32_t*>(detail::addr4(sel.idx, b, hk, i, 0));
          const std::int64_t extent = tokens ? p.Lk : p.Tk();
          for (std::int64_t k = 0; k < K; ++k) {
            const std::int32_t v = ids[k];
            if (v == -1) continue;
            if (v < -1 || v >= extent) {
              std::vector<std::int64_t> scratch;
              auto f = list_row_fault(sel.idx, tokens ? "tokens.idx" : "lists.idx", p, tokens,
                                      (b * p.Hkv + hk) * p.Lq + i, scratch);
              throw Error(op, f->argument, f->message);
            }
            if constexpr (tokens) {
              if (v < end) row[v] = 1;
            } else {
              mark_block(row, v, p, end);
            }
          }
        }
      },
      s);
}

}  // namespace

void selection_row(const Selection& s, const ProblemShape& p, std::int64_t b, std::int64_t h, std::int64_t i,
                   std::uint8_t* row) {
  const std::string op = "selection_row";
  check_problem(op, p);
  require(b >= 0 && b < p.B, op, "b", [&] { return std::to_string(b) + " is out of range " + range_string(p.B); });
  require(h >= 0 && h < p.Hq, op, "h", [&] { return std::to_string(h) + " is out of range " + range_string(p.Hq); });
  require(i >= 0 && i < p.Lq, op, "i", [&] { return std::to_string(i) + " is out of range " + range_string(p.Lq); });
  require(row != nullptr, op, "row", "is null");
  check_row_meta(op, s, p);
  fill_row(op, s, p, b, h, i, row);
}

HostTensor expand_mask(const Selection& s, const ProblemShape& p) {
  const std::string op = "expand_mask";
  check_problem(op, p);
  check_row_meta(op, s, p);
  validate(s, p, op);
  HostTensor mask(DType::u8, {p.B, p.Hq, p.Lq, p.Lk});
  auto* base = mask.data<std::uint8_t>();
  detail::parallel_for(p.B * p.Hq, [&](std::int64_t bh) {
    const std::int64_t b = bh / p.Hq, h = bh % p.Hq;
    for (std::int64_t i = 0; i < p.Lq; ++i) fill_row(op, s, p, b, h, i, base + (bh * p.Lq + i) * p.Lk);
  });
  return mask;
}

}  // namespace sparse_attn
