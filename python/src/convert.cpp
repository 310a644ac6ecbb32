#include <nanobind/stl/string.h>

#include <string>

#include "binding.hpp"

namespace sparse_attn::python {

namespace {

std::string python_type_name(nb::handle h) {
  return nb::cast<std::string>(h.type().attr("__module__")) + "." +
         nb::cast<std::string>(h.type().attr("__qualname__"));
}

bool is_numpy_bfloat16(nb::handle h) {
  if (!nb::hasattr(h, "dtype") || !nb::hasattr(h, "view")) return false;
  if (nb::cast<std::string>(h.type().attr("__module__")) != "numpy") return false;
  nb::object dtype = h.attr("dtype");
  return nb::hasattr(dtype, "name") && nb::cast<std::string>(dtype.attr("name")) == "bfloat16";
}

std::string dlpack_dtype_name(const nb::dlpack::dtype& t) {
  using C = nb::dlpack::dtype_code;
  std::string base;
  switch (static_cast<C>(t.code)) {
    case C::Int: base = "int"; break;
    case C::UInt: base = "uint"; break;
    case C::Float: base = "float"; break;
    case C::Bfloat: base = "bfloat"; break;
    case C::Complex: base = "complex"; break;
    case C::Bool: return "bool";
    default: base = "dlpack code " + std::to_string(t.code) + " of "; break;
  }
  std::string s = base + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

std::optional<DType> map_dtype(const nb::dlpack::dtype& t) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<C>(t.code);
  if (code == C::Float && t.bits == 32) return DType::f32;
  if (code == C::Float && t.bits == 16) return DType::f16;
  if (code == C::Float && t.bits == 64) return DType::f64;
  if (code == C::Bfloat && t.bits == 16) return DType::bf16;
  if (code == C::Int && t.bits == 32) return DType::i32;
  if (code == C::UInt && t.bits == 32) return DType::u32;
  if (code == C::UInt && t.bits == 8) return DType::u8;
  return std::nullopt;
}

template <class Array>
TensorView view_of(const Array& a, const std::string& op, const char* name, bool bf16_bits) {
  TensorView v;
  const auto dt = a.dtype();
  if (bf16_bits) {
    v.dtype = DType::bf16;
  } else if (auto mapped = map_dtype(dt)) {
    v.dtype = *mapped;
  } else {
    throw Error(op, name, "unsupported dtype " + dlpack_dtype_name(dt) +
                              " (expected float32, float16, bfloat16, int32, uint32, uint8 or float64)");
  }
  if (a.ndim() > static_cast<std::size_t>(kMaxDims))
    throw Error(op, name, "has " + std::to_string(a.ndim()) + " dimensions; at most " + std::to_string(kMaxDims) +
                              " are supported");
  switch (a.device_type()) {
    case nb::device::cpu::value: v.device = Device::cpu; break;
    case nb::device::cuda::value: v.device = Device::cuda; break;
    default:
      throw Error(op, name, "unsupported device (DLPack device type " + std::to_string(a.device_type()) +
                                "); expected cpu or cuda");
  }
  v.device_index = a.device_id();
  v.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[static_cast<std::size_t>(d)] = static_cast<std::int64_t>(a.shape(static_cast<std::size_t>(d)));
    v.stride[static_cast<std::size_t>(d)] = a.stride(static_cast<std::size_t>(d));
  }
  v.data = static_cast<char*>(const_cast<void*>(static_cast<const void*>(a.data_handle()))) + a.byte_offset();
  return v;
}

/// Why an array that nanobind cannot import is refused, where it can tell: a non-native byte order.
void explain_refused(nb::handle h, const std::string& op, const char* name) {
  if (!nb::hasattr(h, "dtype") || !nb::hasattr(h.attr("dtype"), "isnative")) return;
  nb::object dtype = h.attr("dtype");
  if (!nb::cast<bool>(dtype.attr("isnative")))
    throw Error(op, name, "byte order: non-native (big-endian) arrays are not supported (dtype " +
                              nb::cast<std::string>(nb::str(dtype)) + "), convert with .astype(dtype.newbyteorder('='))");
}

}  // namespace

TensorView Imports::import(nb::handle h, const char* name, bool writable) {
  if (h.is_none()) throw Error(op_, name, "is None; an array is required");
  nb::object src = nb::borrow(h);
  const bool bf16_bits = is_numpy_bfloat16(h);
  if (bf16_bits) src = h.attr("view")("uint16");
  objects_.push_back(src);
  if (writable) {
    nb::ndarray<> a;
    if (!nb::try_cast(src, a, false)) {
      explain_refused(h, op_, name);
      if (nb::hasattr(h, "flags") && nb::hasattr(h.attr("flags"), "writeable") &&
          !nb::cast<bool>(h.attr("flags").attr("writeable")))
        throw Error(op_, name, "is read-only; an output array must be writable");
      throw Error(op_, name, "expected a writable array (numpy.ndarray, torch.Tensor or DLPack capsule), got " +
                                 python_type_name(h));
    }
    writable_.push_back(a);
    return view_of(a, op_, name, bf16_bits);
  }
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(src, a, false)) {
    explain_refused(h, op_, name);
    throw Error(op_, name, "expected an array (numpy.ndarray, torch.Tensor or DLPack capsule), got " + python_type_name(h));
  }
  readonly_.push_back(a);
  return view_of(a, op_, name, bf16_bits);
}

TensorView Imports::in(nb::handle h, const char* name) { return import(h, name, false); }
TensorView Imports::out(nb::handle h, const char* name) { return import(h, name, true); }

IndexPrecision parse_precision(const std::string& op, const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return IndexPrecision::bf16;
  if (s == "fp8" || s == "fp8_e4m3" || s == "e4m3") return IndexPrecision::fp8_e4m3;
  if (s == "fp4" || s == "fp4_e2m1" || s == "e2m1" || s == "nvfp4") return IndexPrecision::fp4_e2m1;
  throw Error(op, "precision", "unknown precision '" + s + "' (expected 'bf16', 'fp8_e4m3' or 'fp4_e2m1')");
}

PartialPrecision parse_partials(const std::string& op, const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return PartialPrecision::f32;
  if (s == "bf16" || s == "bfloat16") return PartialPrecision::bf16;
  throw Error(op, "partials", "unknown partial precision '" + s + "' (expected 'f32' or 'bf16')");
}

QuerySchedule parse_schedule(const std::string& op, const std::string& s) {
  if (s == "kv_centric") return QuerySchedule::kv_centric;
  if (s == "group_centric") return QuerySchedule::group_centric;
  throw Error(op, "schedule", "unknown schedule '" + s + "' (expected 'kv_centric' or 'group_centric')");
}

Selection make_selection(Imports& im, const std::string& kind, nb::handle a, nb::handle b) {
  if (kind == "dense") return AllBlocks{};
  if (kind == "tiles") return TileLists{im.in(a, "tiles.idx"), im.in(b, "tiles.cnt")};
  if (kind == "bits") return BlockBits{im.in(a, "bits.bits")};
  if (kind == "query_lists") return QueryLists{im.in(a, "lists.idx")};
  if (kind == "token_lists") return TokenLists{im.in(a, "tokens.idx")};
  throw Error(im.op(), "selection",
              "unknown selection kind '" + kind + "' (expected dense, tiles, bits, query_lists or token_lists)");
}

}  // namespace sparse_attn::python
