#include "core/check.hpp"

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

std::string shape_string(const TensorView& t) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.shape[static_cast<std::size_t>(i)];
  os << ']';
  return os.str();
}

void check_tensor(const std::string& op, const std::string& name, const TensorView& t, int ndim,
                  std::initializer_list<DType> dtypes) {
  require(t.defined(), op, name, "is missing (null data pointer)");
  require(t.ndim == ndim, op, name,
          "expected " + std::to_string(ndim) + " dimensions, got " + std::to_string(t.ndim) + " (shape " +
              shape_string(t) + ")");
  bool ok = false;
  std::string allowed;
  for (DType d : dtypes) {
    ok = ok || d == t.dtype;
    allowed += (allowed.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  require(ok, op, name, std::string("dtype ") + dtype_name(t.dtype) + " is not supported (expected one of " + allowed + ")");
  for (int i = 0; i < t.ndim; ++i)
    require(t.shape[static_cast<std::size_t>(i)] >= 0, op, name, "negative extent in shape " + shape_string(t));
}

void check_shape(const std::string& op, const std::string& name, const TensorView& t,
                 std::initializer_list<std::int64_t> shape) {
  bool ok = static_cast<int>(shape.size()) == t.ndim;
  std::ostringstream want;
  want << '[';
  int i = 0;
  for (std::int64_t s : shape) {
    if (ok && s >= 0 && t.shape[static_cast<std::size_t>(i)] != s) ok = false;
    want << (i ? ", " : "") << (s >= 0 ? std::to_string(s) : std::string("*"));
    ++i;
  }
  want << ']';
  require(ok, op, name, "expected shape " + want.str() + ", got " + shape_string(t));
}

void check_last_contiguous(const std::string& op, const std::string& name, const TensorView& t) {
  require(t.ndim == 0 || t.shape[static_cast<std::size_t>(t.ndim - 1)] <= 1 ||
              t.stride[static_cast<std::size_t>(t.ndim - 1)] == 1,
          op, name, "the last dimension must be contiguous (stride 1), got stride " +
                        std::to_string(t.stride[static_cast<std::size_t>(t.ndim - 1)]));
}

void check_same_device(const std::string& op, const std::string& name, const TensorView& t,
                       const std::string& ref_name, const TensorView& ref) {
  require(t.device == ref.device && t.device_index == ref.device_index, op, name,
          std::string("is on ") + device_name(t.device) + ":" + std::to_string(t.device_index) + " but '" + ref_name +
              "' is on " + device_name(ref.device) + ":" + std::to_string(ref.device_index));
}

void unsupported_device(const std::string& op, const std::string& name, const TensorView& t) {
  throw Error(op, name, std::string("no ") + device_name(t.device) + " implementation of " + op +
                            " in this build (tensor " + t.describe() + ")");
}

}  // namespace sparse_attn::detail
