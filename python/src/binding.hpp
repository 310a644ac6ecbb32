// Shared pieces of the nanobind module: importing arrays as TensorViews, option parsing, and
// building numpy results.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::python {

namespace nb = nanobind;

/// Imports the arrays of one call as TensorViews and keeps every imported object alive until the
/// call returns, so views stay valid while the GIL is released around the compute.
///
/// Accepted: anything speaking DLPack or the buffer protocol (numpy arrays, torch tensors, DLPack
/// capsules). numpy arrays of ml_dtypes.bfloat16 are read through a uint16 view because numpy's
/// DLPack export has no bfloat16. Outputs are imported writable: a read-only array is rejected
/// rather than silently copied.
class Imports {
 public:
  explicit Imports(std::string op) : op_(std::move(op)) {}

  TensorView in(nb::handle h, const char* name);
  TensorView out(nb::handle h, const char* name);
  std::optional<TensorView> in_opt(nb::handle h, const char* name) {
    if (h.is_none()) return std::nullopt;
    return in(h, name);
  }
  std::optional<TensorView> out_opt(nb::handle h, const char* name) {
    if (h.is_none()) return std::nullopt;
    return out(h, name);
  }
  const std::string& op() const { return op_; }

 private:
  TensorView import(nb::handle h, const char* name, bool writable);
  std::string op_;
  std::vector<nb::object> objects_;
  std::vector<nb::ndarray<nb::ro>> readonly_;
  std::vector<nb::ndarray<>> writable_;
};

/// The last constructor overload of a bound class (`.def("__init__", constructor_type_error<T>("T"))`):
/// reached only when no other overload takes the arguments, it raises the TypeError that names the
/// first argument which does not fit (sparse_attn._constructor_type_error), as the functions do.
template <class T>
auto constructor_type_error(const char* cls) {
  return [cls](T*, nb::args args, nb::kwargs kwargs) {
    nb::module_::import_("sparse_attn").attr("_constructor_type_error")(cls, args, kwargs);
  };
}

/// The CUDA stream handed over by Python (an integer: cudaStream_t value, 0 for the default).
inline void* stream_ptr(std::uintptr_t s) { return reinterpret_cast<void*>(s); }

IndexPrecision parse_precision(const std::string& op, const std::string& s);
PartialPrecision parse_partials(const std::string& op, const std::string& s);
QuerySchedule parse_schedule(const std::string& op, const std::string& s);

/// A selection from its Python spelling: kind "dense" | "tiles" | "bits" | "query_lists" |
/// "token_lists" and up to two arrays (a, b): tiles = (idx, cnt), the others (array, None).
Selection make_selection(Imports& im, const std::string& kind, nb::handle a, nb::handle b);

/// A numpy array that owns a moved-in vector.
template <class T>
nb::ndarray<nb::numpy, T> numpy_array(std::vector<T>&& values, const std::vector<std::size_t>& shape) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

void bind_ops(nb::module_& m);
void bind_selectors(nb::module_& m);
void bind_formats(nb::module_& m);
void bind_misc(nb::module_& m);
void bind_plan(nb::module_& m);

}  // namespace sparse_attn::python
