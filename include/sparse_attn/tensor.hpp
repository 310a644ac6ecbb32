// Tensor views: a pointer, a shape, strides in elements, a dtype and a device.
//
// The library never owns caller memory: every operator takes views of tensors the caller
// allocated (numpy or torch arrays in Python, raw buffers in C++). `HostTensor` is a small owning
// CPU tensor for tools, tests and the CPU backend's scratch space.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace sparse_attn {

enum class DType : std::uint8_t {
  f32,   // IEEE binary32
  f16,   // IEEE binary16
  bf16,  // bfloat16
  f64,   // IEEE binary64 (CPU only; used by references and evaluation)
  i32,   // index tensors
  u32,   // BlockBits words
  u8,    // raw bytes (quantised index vectors)
};

enum class Device : std::uint8_t { cpu, cuda };

/// Bytes per element of `t`.
std::size_t dtype_size(DType t);
/// "bf16", "f32", ... (the spelling used in error messages and on the command line).
const char* dtype_name(DType t);
const char* device_name(Device d);

inline constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> stride{};  // in elements, not bytes

  /// A view of a densely packed (row-major) tensor.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = Device::cpu, int device_index = 0);
  static TensorView contiguous(void* data, DType dtype, const std::vector<std::int64_t>& shape,
                               Device device = Device::cpu, int device_index = 0);

  bool defined() const { return data != nullptr; }
  std::int64_t size(int d) const { return shape[static_cast<std::size_t>(d)]; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  /// Pointer to the element at the given coordinates (as many as ndim).
  void* at(std::initializer_list<std::int64_t> coords) const;
  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
  /// "[2, 4096, 16, 128] bf16 cuda:0"
  std::string describe() const;
};

/// An owning, densely packed CPU tensor. Copyable and movable; `view()` points into its storage.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&& other) noexcept;
  HostTensor& operator=(HostTensor&& other) noexcept;

  const TensorView& view() const { return view_; }
  DType dtype() const { return view_.dtype; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const { return view_.numel(); }
  template <class T>
  T* data() { return static_cast<T*>(view_.data); }
  template <class T>
  const T* data() const { return static_cast<const T*>(view_.data); }

 private:
  void rebind();
  std::vector<std::int64_t> shape_;
  std::vector<std::byte> storage_;
  TensorView view_;
};

}  // namespace sparse_attn
