#include "sparse_attn/tensor.hpp"

#include <cstring>
#include <sstream>

#include "sparse_attn/error.hpp"

namespace sparse_attn {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::u32: return 4;
    case DType::u8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::u32: return "u32";
    case DType::u8: return "u8";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

namespace {
template <class Range>
TensorView make_contiguous(void* data, DType dtype, const Range& shape, Device device, int device_index) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  v.ndim = static_cast<int>(shape.size());
  if (v.ndim > kMaxDims) throw Error("TensorView", "shape", "at most " + std::to_string(kMaxDims) + " dimensions are supported");
  int d = 0;
  for (std::int64_t s : shape) {
    if (s < 0) throw Error("TensorView", "shape", "negative extent " + std::to_string(s));
    v.shape[static_cast<std::size_t>(d++)] = s;
  }
  std::int64_t st = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.stride[static_cast<std::size_t>(i)] = st;
    st *= v.shape[static_cast<std::size_t>(i)];
  }
  return v;
}
}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device, int device_index) {
  return make_contiguous(data, dtype, shape, device, device_index);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<std::int64_t>& shape,
                                  Device device, int device_index) {
  return make_contiguous(data, dtype, shape, device, device_index);
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[static_cast<std::size_t>(i)];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t st = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    const auto u = static_cast<std::size_t>(i);
    if (shape[u] != 1 && stride[u] != st) return false;
    st *= shape[u];
  }
  return true;
}

void* TensorView::at(std::initializer_list<std::int64_t> coords) const {
  std::int64_t off = 0;
  std::size_t d = 0;
  for (std::int64_t c : coords) off += c * stride[d++];
  return static_cast<char*>(data) + off * static_cast<std::int64_t>(dtype_size(dtype));
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[static_cast<std::size_t>(i)];
  os << "] " << dtype_name(dtype) << ' ' << device_name(device);
  if (device == Device::cuda) os << ':' << device_index;
  return os.str();
}

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape) : shape_(std::move(shape)) {
  view_ = TensorView::contiguous(nullptr, dtype, shape_);
  storage_.resize(static_cast<std::size_t>(view_.numel()) * dtype_size(dtype));
  rebind();
}

HostTensor::HostTensor(const HostTensor& other)
    : shape_(other.shape_), storage_(other.storage_), view_(other.view_) {
  rebind();
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) {
    shape_ = other.shape_;
    storage_ = other.storage_;
    view_ = other.view_;
    rebind();
  }
  return *this;
}

HostTensor::HostTensor(HostTensor&& other) noexcept
    : shape_(std::move(other.shape_)), storage_(std::move(other.storage_)), view_(other.view_) {
  rebind();
  other.view_ = TensorView{};
}

HostTensor& HostTensor::operator=(HostTensor&& other) noexcept {
  if (this != &other) {
    shape_ = std::move(other.shape_);
    storage_ = std::move(other.storage_);
    view_ = other.view_;
    rebind();
    other.view_ = TensorView{};
  }
  return *this;
}

void HostTensor::rebind() { view_.data = storage_.empty() ? nullptr : storage_.data(); }

}  // namespace sparse_attn
