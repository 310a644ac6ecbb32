// Argument checks shared by every operator. Each throws sparse_attn::Error naming the operator and
// the argument.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sparse_attn/error.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::detail {

inline void require(bool ok, const std::string& op, const std::string& arg, const std::string& message) {
  if (!ok) throw Error(op, arg, message);
}

/// As above with the message built only on failure: `message` is a callable returning it. Checks run on
/// every call of every operator, and a message that formats numbers or shapes costs allocations (a
/// stream-formatted shape about a microsecond) whether or not it is thrown.
template <class Message>
  requires std::is_invocable_r_v<std::string, Message>
inline void require(bool ok, const std::string& op, const std::string& arg, Message&& message) {
  if (!ok) throw Error(op, arg, std::forward<Message>(message)());
}

/// "[0, 3, 17]"
std::string coord_string(std::initializer_list<std::int64_t> c);
std::string shape_string(const TensorView& t);

/// The tensor is defined, has `ndim` dimensions and one of `dtypes`.
void check_tensor(const std::string& op, const std::string& name, const TensorView& t, int ndim,
                  std::initializer_list<DType> dtypes);
/// Every extent equals `shape` (-1 matches anything).
void check_shape(const std::string& op, const std::string& name, const TensorView& t,
                 std::initializer_list<std::int64_t> shape);
/// The last dimension is contiguous (stride 1).
void check_last_contiguous(const std::string& op, const std::string& name, const TensorView& t);

/// GQA: every KV head serves the same number of query heads. Throws Error(op, name) otherwise.
void check_head_ratio(const std::string& op, const std::string& name, std::int64_t Hq, std::int64_t Hkv);
/// `t` is on the same device as `ref`.
void check_same_device(const std::string& op, const std::string& name, const TensorView& t,
                       const std::string& ref_name, const TensorView& ref);
/// q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D]: ranks, dtypes among `dtypes` (each tensor on its own),
/// devices, extents, GQA divisibility, contiguous last dims and the softmax scale. Returns the shape, and
/// the scale in effect (resolve_scale) in *resolved_scale when given.
ProblemShape check_qkv(const std::string& op, const TensorView& q, const TensorView& k, const TensorView& v,
                       std::initializer_list<DType> dtypes, bool causal, const std::optional<float>& scale,
                       float* resolved_scale = nullptr);
/// Messages shared by the CPU and device checks of BlockBits (formats.cpp, src/convert, cuda/convert): the
/// lowest bit at or past Tk set in the last word of row (b, g, t), and a tile whose bit set holds n > Kmax
/// blocks ("the bit set", "the union" as `what`).
std::string stray_bit_message(int bit, std::int64_t W, std::int64_t b, std::int64_t g, std::int64_t t, std::int64_t Tk);
std::string over_capacity_message(const char* what, std::int64_t b, std::int64_t g, std::int64_t t, std::int64_t n,
                                  std::int64_t Kmax);

/// The first fault of TileLists row (b, g, t) as validate() reports it: its count c against [0, Kmax],
/// then its first c ids (`stride` elements apart) against [0, Tk) and strict ascent. Returns the
/// argument's part ("cnt" or "idx") and the message; nullopt for a valid row.
std::optional<std::pair<std::string, std::string>> tile_row_message(const std::int32_t* ids, std::int64_t stride,
                                                                    std::int32_t c, std::int64_t Kmax, std::int64_t Tk,
                                                                    std::int64_t b, std::int64_t g, std::int64_t t);
/// Its two kinds of message, for a fault found elsewhere (the CUDA kernel's record): count c of row
/// (b, g, t) outside [0, Kmax]; id `id` at slot k out of [0, Tk) or, when in range, not above `prev`
/// (the id at slot k - 1).
std::pair<std::string, std::string> tile_count_message(std::int32_t c, std::int64_t Kmax, std::int64_t b,
                                                       std::int64_t g, std::int64_t t);
std::pair<std::string, std::string> tile_id_message(std::int32_t id, std::int32_t prev, std::int64_t Tk,
                                                    std::int64_t b, std::int64_t g, std::int64_t t, std::int64_t k);

/// The first fault of one row of a QueryLists (`tokens` false: block ids below `extent` = Tk) or
/// TokenLists (key positions below `extent` = Lk) of K contiguous entries, as validate() reports it
/// (entries >= -1, in range, no repeat: a repeat at its second occurrence), with the row's coordinates
/// (b, g, i) and the slot in the message; nullopt for a valid row. `scratch` holds duplicate stamps
/// keyed by the row number r (reused across rows).
std::optional<std::string> list_row_message(const std::int32_t* row, std::int64_t K, std::int64_t extent, bool tokens,
                                            std::int64_t b, std::int64_t g, std::int64_t i, std::int64_t r,
                                            std::vector<std::int64_t>& scratch);

/// The bytes a view can touch, [begin, end): from base + the sum of (extent - 1) * stride * itemsize
/// over its negative strides to one element past base + that sum over its positive strides. Empty
/// (begin == end) when an extent is 0 or the view is undefined.
struct ByteSpan {
  std::uintptr_t begin = 0, end = 0;
};
ByteSpan byte_span(const TensorView& t);
/// An output must not share memory with another argument of the call: throws Error(op, out_name)
/// when the byte spans of `out` and `other` (on the same device) overlap, naming both and the bytes
/// they share. Views that interleave without sharing an element are refused too.
void check_no_overlap(const std::string& op, const std::string& out_name, const TensorView& out,
                      const std::string& other_name, const TensorView& other);
/// check_no_overlap of an executor's two outputs, "out" and (when given) "lse", against `other`.
void check_outputs_apart(const std::string& op, const TensorView& out, const std::optional<TensorView>& lse,
                         const std::string& other_name, const TensorView& other);

/// Throws the standard "no implementation on this device" error.
[[noreturn]] void unsupported_device(const std::string& op, const std::string& name, const TensorView& t);

}  // namespace sparse_attn::detail
