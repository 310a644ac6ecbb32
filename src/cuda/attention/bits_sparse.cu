// bits_sparse on the GPU: the bit sets become ascending TileLists in a workspace of this (device,
// stream) (block_bits_to_tile_lists' kernel, which also checks the bits unless a.trusted), and
// the Q-centric kernel runs over them as over any TileLists.
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "core/check.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/workspace_cache.hpp"
#include "cuda/convert/backend.hpp"

namespace sparse_attn::cuda_backend {
namespace {

// The converted lists per (device, stream): idx [B, G, Tq, Tk] (room for every block of a tile), then
// cnt [B, G, Tq] on a 256-byte boundary.
WorkspaceCache g_list_workspaces;

}  // namespace

void bits_sparse(const detail::AttentionCall& a, const BlockBits& bits) {
  const std::string op = "bits_sparse";
  const ProblemShape& p = a.p;
  const std::int64_t G = bits.bits.shape[1], Tq = p.Tq(), Tk = p.Tk();
  const std::size_t idx_bytes = (static_cast<std::size_t>(p.B * G * Tq * Tk) * sizeof(std::int32_t) + 255) / 256 * 256;
  const std::size_t need = idx_bytes + static_cast<std::size_t>(p.B * G * Tq) * sizeof(std::int32_t);
  cuda_kernels::DeviceGuard guard(a.device, op);
  std::lock_guard<std::mutex> lock(g_list_workspaces.mutex());
  char* ws = static_cast<char*>(g_list_workspaces.get(op, a.device, a.stream, need));
  const TileLists tiles{TensorView::contiguous(ws, DType::i32, {p.B, G, Tq, Tk}, Device::cuda, a.device),
                        TensorView::contiguous(ws + idx_bytes, DType::i32, {p.B, G, Tq}, Device::cuda, a.device)};
  ConvertOptions convert;
  convert.trusted = a.trusted;
  convert.stream = a.stream;
  block_bits_to_tile_lists(bits, tiles, p, convert, op, "bits");
  detail::AttentionCall run = a;
  run.trusted = true;  // ascending, in range and within capacity by construction
  tile_sparse(run, detail::TileCall{tiles, G, Tk});
}

}  // namespace sparse_attn::cuda_backend
