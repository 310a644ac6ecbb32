// Host side of the Q-centric kernel: the checks specific to the CUDA backend (32-bit ranges, out's
// alignment), the fault sink of validated TileLists, tensor maps, parameters and the dtype dispatch;
// dense and tile_sparse launch it with NoGate, gated with BlockMaxGate (gate_policy.cuh).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "core/check.hpp"
#include "cuda/attention/kernel.cuh"
#include "cuda/attention/list_check.hpp"
#include "cuda/attention/params.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/fault_word.hpp"
#include "cuda/common/tma.hpp"
#include "cuda/common/workspace_cache.hpp"
#include "schedule/split_tail.hpp"

namespace sparse_attn::cuda_kernels {
namespace {

// The split tail's counters and partials per (device, stream), sized once for the device's SM count:
// counters for up to one tail unit per SM (2 per unit: one per consumer warpgroup), then up to two
// slots per SM. The counters start at zero and every launch leaves them at zero.
cuda_backend::WorkspaceCache g_tail_workspaces;

std::size_t tail_counter_bytes(int sms) { return (static_cast<std::size_t>(sms) * 2 * sizeof(unsigned) + 255) / 256 * 256; }
std::size_t tail_workspace_bytes(int sms) {
  return tail_counter_bytes(sms) + static_cast<std::size_t>(2 * sms) * 2 * kTailPartFloats * sizeof(float);
}

// gated's counters when the caller gives no device tensor for them: four uint64 per (device, stream),
// read back after the call.
cuda_backend::WorkspaceCache g_gate_counters;

/// `gate` non-null: gated (causal, every block walked, BlockMaxGate). `entmax` non-null: entmax's output
/// pass (trusted lists, EntmaxTransform; the caller turns the split off).
void run(const std::string& op, const detail::AttentionCall& a, const detail::TileCall* tiles,
         const detail::AttentionTuning& tuning, const GateParams* gate = nullptr,
         const EntmaxTransformParams* entmax = nullptr) {
  using detail::require;
  const ProblemShape& s = a.p;
  const TensorView &q = a.q, &k = a.k, &v = a.v, &out = a.out;
  const std::optional<TensorView>& lse = a.lse;
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  require(s.Lq <= kIntMax && s.Lk <= kIntMax && s.B * s.Hq * ceil_div(s.Lq, kTileQ) <= kIntMax, op, "q",
          [&] { return "problem too large for 32-bit tile indices: " + s.describe(); });
  const auto out_addr = reinterpret_cast<std::uintptr_t>(out.data);
  require(out_addr % 4 == 0 && out.stride[0] % 2 == 0 && out.stride[1] % 2 == 0 && out.stride[2] % 2 == 0, op, "out",
          [&] { return "needs a 4-byte aligned base and even strides (pairs of elements are stored at once), got " +
              out.describe(); });

  DeviceGuard guard(a.device, op);
  const auto stream = static_cast<cudaStream_t>(a.stream);

  TileAttentionParams p;
  p.B = static_cast<int>(s.B);
  p.Lq = static_cast<int>(s.Lq);
  p.Lk = static_cast<int>(s.Lk);
  p.Hq = static_cast<int>(s.Hq);
  p.Hkv = static_cast<int>(s.Hkv);
  p.Tq = static_cast<int>(s.Tq());
  p.Tk = static_cast<int>(s.Tk());
  p.group_size = static_cast<int>(s.group_size());
  p.causal = s.causal;
  p.scale_log2 = a.scale_log2;
  p.out = out.data;
  for (int i = 0; i < 3; ++i) p.out_stride[i] = out.stride[i];
  if (lse) {
    p.lse = static_cast<float*>(lse->data);
    for (int i = 0; i < 3; ++i) p.lse_stride[i] = lse->stride[i];
  }
  p.num_units = static_cast<int>(s.B * s.Hq * (s.causal ? (s.Tq() + 1) / 2 : s.Tq()));
  // The TMA store needs an output TMA can address; other layouts (odd strides) take the register path.
  p.tma_store = tma_addressable(out);

  if (tiles == nullptr) {
    p.dense = true;
  } else {
    const TensorView& idx = tiles->tiles.idx;
    const TensorView& cnt = tiles->tiles.cnt;
    require(tiles->Kmax <= kIntMax, op, "tiles.idx", [&] { return "Kmax too large: " + idx.describe(); });
    p.idx = static_cast<const std::int32_t*>(idx.data);
    p.cnt = static_cast<const std::int32_t*>(cnt.data);
    p.Kmax = static_cast<int>(tiles->Kmax);
    for (int i = 0; i < 4; ++i) p.idx_stride[i] = idx.stride[i];
    for (int i = 0; i < 3; ++i) p.cnt_stride[i] = cnt.stride[i];
    p.heads_per_list = static_cast<int>(s.Hq / tiles->G);
    if (!a.trusted) {  // checked on the device after the attention (list_check.cu): no synchronisation
      const FaultSink sink = fault_sink(a.device, op);
      p.fault = sink.record;
      p.fault_flag = sink.flag;
    }
  }

  const CUtensorMap tm_q = make_bhld_tensor_map(op, "q", q);
  const CUtensorMap tm_k = make_bhld_tensor_map(op, "k", k);
  const CUtensorMap tm_v = make_bhld_tensor_map(op, "v", v);
  // Each consumer warpgroup stores its 64 rows: the out box is 64 rows. Unused on the register path.
  const CUtensorMap tm_out = p.tma_store ? make_bhld_tensor_map(op, "out", out, kRowsPerConsumer) : tm_q;

  int device = 0, device_sms = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device), op, "device query");
  const int num_sms = tuning.max_ctas > 0 ? std::min(tuning.max_ctas, device_sms) : device_sms;
  int grid = std::min(p.num_units, num_sms);
  p.dp_units = p.num_units;
  // The split tail (split_tail.hpp) is planned for non-causal launches only: causal units of paired
  // tiles already balance the CTAs.
  std::unique_lock<std::mutex> tail_lock;
  if (tuning.split != detail::SplitTail::off && !p.causal && p.num_units > 0) {
    const int walk_len = p.dense ? p.Tk : p.Kmax;
    const TailSplit t = split_tail(p.num_units, num_sms, walk_len, tuning.split == detail::SplitTail::force);
    if (t.tail_ctas > 0) {
      // The workspace is allocated on the first split of a (device, stream). Not while the stream is
      // being captured into a graph, where allocation is not allowed: such a call runs unsplit.
      tail_lock = std::unique_lock<std::mutex>(g_tail_workspaces.mutex());
      const std::size_t need = tail_workspace_bytes(device_sms);
      auto* ws = static_cast<char*>(g_tail_workspaces.find(device, a.stream, need));
      if (ws == nullptr) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        check_cuda(cudaStreamIsCapturing(stream, &capture), op, "stream capture query");
        if (capture == cudaStreamCaptureStatusNone) {
          ws = static_cast<char*>(g_tail_workspaces.get(op, device, a.stream, need));
          check_cuda(cudaMemsetAsync(ws, 0, tail_counter_bytes(device_sms), stream), op, "tail counters");
        }
      }
      if (ws != nullptr) {
        p.dp_units = t.dp_units;
        p.tail_ctas = t.tail_ctas;
        p.tail_len = walk_len;
        p.tail_count = reinterpret_cast<unsigned*>(ws);
        p.tail_part = reinterpret_cast<float*>(ws + tail_counter_bytes(device_sms));
        grid = t.dp_units > 0 ? num_sms : t.tail_ctas;
      }
    }
  }
  const bool bf16 = q.dtype == DType::bf16;
  const auto launch = [&]() {
    return s.D == 128 ? (bf16 ? launch_tile_attention<Bf16Tag, 128>(p, tm_q, tm_k, tm_v, tm_out, grid, stream)
                              : launch_tile_attention<F16Tag, 128>(p, tm_q, tm_k, tm_v, tm_out, grid, stream))
                      : (bf16 ? launch_tile_attention<Bf16Tag, 64>(p, tm_q, tm_k, tm_v, tm_out, grid, stream)
                              : launch_tile_attention<F16Tag, 64>(p, tm_q, tm_k, tm_v, tm_out, grid, stream));
  };
  const auto launch_entmax = [&]() {
    return s.D == 128 ? (bf16 ? launch_entmax_attention<Bf16Tag, 128>(p, *entmax, tm_q, tm_k, tm_v, tm_out, grid, stream)
                              : launch_entmax_attention<F16Tag, 128>(p, *entmax, tm_q, tm_k, tm_v, tm_out, grid, stream))
                      : (bf16 ? launch_entmax_attention<Bf16Tag, 64>(p, *entmax, tm_q, tm_k, tm_v, tm_out, grid, stream)
                              : launch_entmax_attention<F16Tag, 64>(p, *entmax, tm_q, tm_k, tm_v, tm_out, grid, stream));
  };
  const cudaError_t e =
      entmax != nullptr ? launch_entmax()
      : gate != nullptr
          ? (s.D == 128 ? (bf16 ? launch_gated_attention<Bf16Tag, 128>(p, *gate, tm_q, tm_k, tm_v, tm_out, grid, stream)
                                : launch_gated_attention<F16Tag, 128>(p, *gate, tm_q, tm_k, tm_v, tm_out, grid, stream))
                        : (bf16 ? launch_gated_attention<Bf16Tag, 64>(p, *gate, tm_q, tm_k, tm_v, tm_out, grid, stream)
                                : launch_gated_attention<F16Tag, 64>(p, *gate, tm_q, tm_k, tm_v, tm_out, grid, stream)))
      : launch();
  check_cuda(e, op, "kernel launch");
  if (p.fault != nullptr) check_cuda(launch_list_check(p, static_cast<int>(s.D), stream), op, "list check launch");
}

}  // namespace
}  // namespace sparse_attn::cuda_kernels

namespace sparse_attn::cuda_backend {

void dense(const detail::AttentionCall& a, const detail::AttentionTuning& tuning) {
  cuda_kernels::run("dense", a, nullptr, tuning);
}

void tile_sparse(const detail::AttentionCall& a, const detail::TileCall& t, const detail::AttentionTuning& tuning) {
  cuda_kernels::run("tile_sparse", a, &t, tuning);
}

void entmax_output(const detail::AttentionCall& a, const detail::TileCall& t,
                   const cuda_kernels::EntmaxTransformParams& entmax, const detail::AttentionTuning& tuning) {
  detail::AttentionCall run = a;
  run.trusted = true;  // lists made from entmax's support bits: ascending and in range
  detail::AttentionTuning unsplit = tuning;
  unsplit.split = detail::SplitTail::off;  // one instantiation per causal setting
  cuda_kernels::run("entmax", run, &t, unsplit, nullptr, &entmax);
}

GatedStats gated(const detail::AttentionCall& a, const TensorView& thresholds, const GatedOptions& options,
                 const detail::AttentionTuning& tuning) {
  constexpr const char* kOp = "gated";
  using cuda_kernels::g_gate_counters;
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  detail::require(thresholds.shape[1] <= kIntMax, kOp, "thresholds",
                  [&] { return "too many columns for 32-bit indices: " + thresholds.describe(); });
  cuda_kernels::GateParams g;
  g.thresholds = static_cast<const float*>(thresholds.data);
  g.thr_stride[0] = thresholds.stride[0];
  g.thr_stride[1] = thresholds.stride[1];
  g.T = static_cast<int>(thresholds.shape[1]);
  g.scale = a.scale;
  g.sink_blocks = static_cast<int>(std::min<std::int64_t>(options.sink_blocks, kIntMax));
  if (options.kept_per_tile) {
    g.kept_per_tile = static_cast<int*>(options.kept_per_tile->data);
    for (int i = 0; i < 3; ++i) g.kept_stride[i] = options.kept_per_tile->stride[i];
  }
  cuda_kernels::DeviceGuard guard(a.device, kOp);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  std::unique_lock<std::mutex> lock;
  if (options.counts) {
    g.counts32 = static_cast<int*>(options.counts->data);
    g.counts32_stride = options.counts->stride[0];
    if (g.counts32_stride == 1) {  // one launch for the four counters where they are contiguous
      cuda_kernels::check_cuda(cudaMemsetAsync(g.counts32, 0, 4 * sizeof(int), stream), kOp, "options.counts");
    } else {
      for (int i = 0; i < 4; ++i)
        cuda_kernels::check_cuda(cudaMemsetAsync(g.counts32 + i * g.counts32_stride, 0, sizeof(int), stream), kOp,
                                 "options.counts");
    }
  } else {
    lock = std::unique_lock<std::mutex>(g_gate_counters.mutex());
    g.counts64 = static_cast<unsigned long long*>(g_gate_counters.get(kOp, a.device, a.stream, 4 * sizeof(unsigned long long)));
    cuda_kernels::check_cuda(cudaMemsetAsync(g.counts64, 0, 4 * sizeof(unsigned long long), stream), kOp, "counters");
  }
  cuda_kernels::run(kOp, a, nullptr, tuning, &g);
  GatedStats stats;
  if (options.counts) {
    stats.deferred = true;
    return stats;
  }
  unsigned long long host[4] = {0, 0, 0, 0};
  cuda_kernels::check_cuda(cudaMemcpyAsync(host, g.counts64, sizeof(host), cudaMemcpyDeviceToHost, stream), kOp, "counters");
  cuda_kernels::check_cuda(cudaStreamSynchronize(stream), kOp, "stream synchronisation");
  stats.kept_blocks = static_cast<std::int64_t>(host[0]);
  stats.visible_blocks = static_cast<std::int64_t>(host[1]);
  stats.gated_candidates = static_cast<std::int64_t>(host[2]);
  stats.gated_kept = static_cast<std::int64_t>(host[3]);
  return stats;
}

}  // namespace sparse_attn::cuda_backend
