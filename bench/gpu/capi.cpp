// A C entry point over the CUDA backend's dense / tile_sparse for the Python benchmark (ctypes):
// torch allocates the tensors and passes data pointers, shapes and the current stream. Contiguous
// [B, L, H, D] tensors; idx == nullptr means dense. The shapes come from the caller, who built the
// tensors from them, so the backend is called directly.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>

#include "cuda/backend.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;

extern "C" int sa_bench_attention(int dtype_code, void* q, void* k, void* v, void* out, float* lse, std::int64_t B,
                                  std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv, std::int64_t D,
                                  int causal, std::int32_t* idx, std::int32_t* cnt, std::int64_t G, std::int64_t Kmax,
                                  int trusted, void* stream, char* err, int err_len) {
  try {
    const sa::DType dt = dtype_code == 0 ? sa::DType::bf16 : sa::DType::f16;
    const auto qv = sa::TensorView::contiguous(q, dt, {B, Lq, Hq, D}, sa::Device::cuda);
    const auto kv = sa::TensorView::contiguous(k, dt, {B, Lk, Hkv, D}, sa::Device::cuda);
    const auto vv = sa::TensorView::contiguous(v, dt, {B, Lk, Hkv, D}, sa::Device::cuda);
    const auto ov = sa::TensorView::contiguous(out, dt, {B, Lq, Hq, D}, sa::Device::cuda);
    std::optional<sa::TensorView> lv;
    if (lse) lv = sa::TensorView::contiguous(lse, sa::DType::f32, {B, Hq, Lq}, sa::Device::cuda);
    sa::AttentionOptions opt;
    opt.causal = causal != 0;
    opt.trusted = trusted != 0;
    opt.stream = stream;
    sa::ProblemShape p;
    p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = opt.causal;
    if (idx == nullptr) {
      sa::cuda_backend::dense(p, qv, kv, vv, ov, lv, opt);
    } else {
      const std::int64_t Tq = sa::ceil_div(Lq, sa::kTileQ);
      const sa::TileLists tiles{sa::TensorView::contiguous(idx, sa::DType::i32, {B, G, Tq, Kmax}, sa::Device::cuda),
                                sa::TensorView::contiguous(cnt, sa::DType::i32, {B, G, Tq}, sa::Device::cuda)};
      sa::cuda_backend::tile_sparse(p, qv, kv, vv, tiles, ov, lv, opt);
    }
    return 0;
  } catch (const std::exception& e) {
    if (err && err_len > 0) {
      const std::size_t n = std::min<std::size_t>(std::strlen(e.what()), static_cast<std::size_t>(err_len - 1));
      std::memcpy(err, e.what(), n);
      err[n] = '\0';
    }
    return 1;
  }
}
