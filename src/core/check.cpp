#include "core/check.hpp"

#include <algorithm>
#include <sstream>

namespace sparse_attn::detail {

std::string coord_string(std::initializer_list<std::int64_t> c) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (std::int64_t x : c) {
    os << (first ? "" : ", ") << x;
    first = false;
  }
  os << ']';
  return os.str();
}

std::string stray_bit_message(int bit, std::int64_t W, std::int64_t b, std::int64_t g, std::int64_t t, std::int64_t Tk) {
  return "stray bit " + std::to_string(bit) + " (block " + std::to_string((W - 1) * 32 + bit) +
         ") set in the word at " + coord_string({b, g, t, W - 1}) + ": bits of blocks at or past Tk = " +
         std::to_string(Tk) + " must be zero";
}

std::string over_capacity_message(const char* what, std::int64_t b, std::int64_t g, std::int64_t t, std::int64_t n,
                                  std::int64_t Kmax) {
  return std::string(what) + " of tile " + coord_string({b, g, t}) + " holds " + std::to_string(n) +
         " blocks but Kmax is " + std::to_string(Kmax);
}

std::string shape_string(const TensorView& t) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.shape[static_cast<std::size_t>(i)];
  os << ']';
  return os.str();
}

// The checks below run on every call of every operator: each builds its message only when it fails
// (formatting a shape through a stream costs about a microsecond).
void check_tensor(const std::string& op, const std::string& name, const TensorView& t, int ndim,
                  std::initializer_list<DType> dtypes) {
  if (!t.defined()) throw Error(op, name, "is missing (null data pointer)");
  if (t.ndim != ndim)
    throw Error(op, name, "expected " + std::to_string(ndim) + " dimensions, got " + std::to_string(t.ndim) +
                              " (shape " + shape_string(t) + ")");
  bool ok = false;
  for (DType d : dtypes) ok = ok || d == t.dtype;
  if (!ok) {
    std::string allowed;
    for (DType d : dtypes) allowed += (allowed.empty() ? "" : ", ") + std::string(dtype_name(d));
    throw Error(op, name,
                std::string("dtype ") + dtype_name(t.dtype) + " is not supported (expected one of " + allowed + ")");
  }
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[static_cast<std::size_t>(i)] < 0) throw Error(op, name, "negative extent in shape " + shape_string(t));
}

void check_shape(const std::string& op, const std::string& name, const TensorView& t,
                 std::initializer_list<std::int64_t> shape) {
  bool ok = static_cast<int>(shape.size()) == t.ndim;
  int i = 0;
  for (std::int64_t s : shape) {
    if (ok && s >= 0 && t.shape[static_cast<std::size_t>(i)] != s) ok = false;
    ++i;
  }
  if (ok) return;
  std::ostringstream want;
  want << '[';
  i = 0;
  for (std::int64_t s : shape) want << (i++ ? ", " : "") << (s >= 0 ? std::to_string(s) : std::string("*"));
  want << ']';
  throw Error(op, name, "expected shape " + want.str() + ", got " + shape_string(t));
}

void check_last_contiguous(const std::string& op, const std::string& name, const TensorView& t) {
  const auto last = static_cast<std::size_t>(t.ndim - 1);
  if (t.ndim == 0 || t.shape[last] <= 1 || t.stride[last] == 1) return;
  throw Error(op, name, "the last dimension must be contiguous (stride 1), got stride " + std::to_string(t.stride[last]));
}

void check_head_ratio(const std::string& op, const std::string& name, std::int64_t Hq, std::int64_t Hkv) {
  if (Hkv > 0 && Hq % Hkv == 0) return;
  throw Error(op, name,
              "query heads (" + std::to_string(Hq) + ") must be a multiple of KV heads (" + std::to_string(Hkv) + ")");
}

void check_same_device(const std::string& op, const std::string& name, const TensorView& t,
                       const std::string& ref_name, const TensorView& ref) {
  if (t.device == ref.device && t.device_index == ref.device_index) return;
  throw Error(op, name, std::string("is on ") + device_name(t.device) + ":" + std::to_string(t.device_index) +
                            " but '" + ref_name + "' is on " + device_name(ref.device) + ":" +
                            std::to_string(ref.device_index));
}

ByteSpan byte_span(const TensorView& t) {
  if (!t.defined()) return {};
  std::int64_t lo = 0, hi = 0;
  for (int i = 0; i < t.ndim; ++i) {
    const std::int64_t n = t.shape[static_cast<std::size_t>(i)], st = t.stride[static_cast<std::size_t>(i)];
    if (n == 0) return {};
    (st < 0 ? lo : hi) += (n - 1) * st;
  }
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype));
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  return {base + static_cast<std::uintptr_t>(lo * size), base + static_cast<std::uintptr_t>((hi + 1) * size)};
}

void check_no_overlap(const std::string& op, const std::string& out_name, const TensorView& out,
                      const std::string& other_name, const TensorView& other) {
  if (out.device != other.device || out.device_index != other.device_index) return;
  const ByteSpan a = byte_span(out), b = byte_span(other);
  const std::uintptr_t lo = std::max(a.begin, b.begin), hi = std::min(a.end, b.end);
  if (a.begin == a.end || b.begin == b.end || lo >= hi) return;
  const auto hex = [](std::uintptr_t x) {
    std::ostringstream os;
    os << "0x" << std::hex << x;
    return os.str();
  };
  throw Error(op, out_name,
              "overlaps '" + other_name + "' in memory: " + out_name + " spans bytes [" + hex(a.begin) + ", " +
                  hex(a.end) + "), " + other_name + " [" + hex(b.begin) + ", " + hex(b.end) + "), " +
                  std::to_string(hi - lo) + " bytes shared; an output must not share memory with any other argument");
}

void check_outputs_apart(const std::string& op, const TensorView& out, const std::optional<TensorView>& lse,
                         const std::string& other_name, const TensorView& other) {
  check_no_overlap(op, "out", out, other_name, other);
  if (lse) check_no_overlap(op, "lse", *lse, other_name, other);
}

void unsupported_device(const std::string& op, const std::string& name, const TensorView& t) {
  throw Error(op, name, std::string("no ") + device_name(t.device) + " implementation of " + op +
                            " in this build (tensor " + t.describe() + ")");
}

}  // namespace sparse_attn::detail
