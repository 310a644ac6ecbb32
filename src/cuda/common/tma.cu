#include "cuda/common/tma.hpp"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "core/check.hpp"

namespace sparse_attn::cuda_kernels {
namespace {

// The encoder is a driver entry point. Reaching it through the runtime keeps libcuda out of the link,
// so programs built with the CUDA backend still start (and run on the CPU) where no driver exists.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(const std::string& op) {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  detail::require(fn != nullptr, op, "", "the CUDA driver does not provide cuTensorMapEncodeTiled (driver too old?)");
  return fn;
}

// Why TMA cannot address `t` as a [B, L, H, D] map of make_bhld_tensor_map; empty when it can.
std::string tma_obstacle(const TensorView& t) {
  if (dtype_size(t.dtype) != 2) return std::string("TMA maps here take 16-bit elements, got ") + dtype_name(t.dtype);
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  if (base % 16 != 0) return "data pointer must be 16-byte aligned for TMA, got address " + std::to_string(base);
  // Map dims innermost first: {D, H, L, B}. Strides of dims 1..3 in bytes, multiples of 16, nonzero.
  const char* dim_names[3] = {"h", "l", "b"};
  const std::int64_t strides[3] = {t.stride[2], t.stride[1], t.stride[0]};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t bytes = strides[i] * 2;
    if (!(bytes > 0 && bytes % 16 == 0 && bytes < (std::int64_t(1) << 40)))
      return std::string("stride of dim ") + dim_names[i] + " must be a positive multiple of 8 elements for TMA, got " +
             std::to_string(strides[i]);
  }
  return {};
}

}  // namespace

bool tma_addressable(const TensorView& t) { return tma_obstacle(t).empty(); }

CUtensorMap make_bhld_tensor_map(const std::string& op, const std::string& name, const TensorView& t,
                                 std::uint32_t box_rows) {
  const std::string obstacle = tma_obstacle(t);
  detail::require(obstacle.empty(), op, name, obstacle);
  constexpr std::int64_t elem = 2;
  const std::int64_t strides[3] = {t.stride[2], t.stride[1], t.stride[0]};
  CUtensorMap map;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(t.shape[3]), static_cast<cuuint64_t>(t.shape[2]),
                              static_cast<cuuint64_t>(t.shape[1]), static_cast<cuuint64_t>(t.shape[0])};
  const cuuint64_t gstrides[3] = {static_cast<cuuint64_t>(strides[0] * elem), static_cast<cuuint64_t>(strides[1] * elem),
                                  static_cast<cuuint64_t>(strides[2] * elem)};
  const cuuint32_t box[4] = {kTmaBoxCols, 1, box_rows, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dtype =
      t.dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = tensor_map_encoder(op)(&map, dtype, 4, t.data, dims, gstrides, box, elem_strides,
                                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  detail::require(r == CUDA_SUCCESS, op, name,
                  [&] { return
                      "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(r)) + " for " +
                      t.describe(); });
  return map;
}

}  // namespace sparse_attn::cuda_kernels
