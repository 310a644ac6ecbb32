// Host side of query_sparse on the GPU: for the KV-centric schedule the workspace layout, argument
// checks specific to this backend, device validation of QueryLists, the phase launches and the
// per-(device, stream) workspace of the one-call entry point; for the group-centric schedule its
// checks and its one launch (no workspace beyond the validation's fault word).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "core/check.hpp"
#include "cuda/common/tma.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/workspace_cache.hpp"
#include "cuda/query_sparse/backend.hpp"
#include "cuda/query_sparse/launch.hpp"
#include "schedule/merge_window.hpp"

namespace sparse_attn::cuda_backend {
namespace {

namespace qs = cuda_kernels::qs;
using detail::require;

const std::string kOp = "query_sparse";

void check_cuda(cudaError_t e, const std::string& what) { cuda_kernels::check_cuda(e, kOp, what); }

struct DeviceGuard : cuda_kernels::DeviceGuard {
  explicit DeviceGuard(int device) : cuda_kernels::DeviceGuard(device, kOp) {}
};

// Query bands of the reverse index's bins with merge window `win` (merge_window.hpp); `forced` as
// QuerySparseTuning::query_bands.
int bands_of(const ProblemShape& p, std::int64_t Kq, int win, int forced) {
  return resolve_query_bands(p.Lq, p.group_size(), p.D, 2, p.Tk(), Kq, win, forced);
}

// Byte offsets of the workspace's arrays; each starts on a 256-byte boundary. The index arrays are
// sized for the most bins any merge window the lists allow makes (max_merge_bins), or `bands` bands
// of blocks if those are more: sized with the bands the tuning gives without merging, one workspace
// serves every window, and a plan's bins (whose bands are no more) fit it. merged holds the merged
// lists (absent when Kq is too large to merge).
struct Layout {
  std::int64_t nblk = 0, slots = 0, rows = 0, max_items = 0;
  std::size_t counts = 0, offsets = 0, item_offsets = 0, entries = 0, items = 0, bad = 0, lse = 0, part = 0,
              merged = 0, queue = 0, total = 0;
};

Layout layout(const ProblemShape& p, std::int64_t Kq, PartialPrecision prec, int bands) {
  Layout l;
  const bool can_merge = Kq <= kMaxMergeSlots;
  l.nblk = p.B * p.Hkv * std::max(max_merge_bins(p.Tk(), Kq), bands * p.Tk());
  l.slots = p.B * p.Hkv * p.Lq * Kq;
  l.rows = l.slots * p.group_size();
  l.max_items = ceil_div(l.rows, qs::kRowsPerItem) + l.nblk;
  std::size_t at = 0;
  auto take = [&](std::int64_t n, std::size_t elem) {
    const std::size_t start = at;
    at += (static_cast<std::size_t>(n) * elem + 255) / 256 * 256;
    return start;
  };
  l.counts = take(l.nblk, sizeof(int));
  l.offsets = take(l.nblk + 1, sizeof(int));
  l.item_offsets = take(l.nblk + 1, sizeof(int));
  l.entries = take(l.slots, sizeof(int));
  l.items = take(l.max_items, sizeof(int2));
  l.bad = take(1, sizeof(unsigned long long));
  l.lse = take(l.rows, sizeof(float));
  l.part = take(l.rows * p.D, prec == PartialPrecision::f32 ? 4 : 2);
  l.merged = take(can_merge ? l.slots : 0, sizeof(int));
  l.queue = take(2, sizeof(int));
  l.total = at;
  return l;
}

void check_shape(const ProblemShape& p, std::int64_t Kq, int bands) {
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  const Layout l = layout(p, Kq, PartialPrecision::f32, bands);
  require(p.Lq <= kIntMax && p.Lk <= kIntMax && p.Lq * Kq <= kIntMax && l.rows <= kIntMax && l.max_items <= kIntMax,
          kOp, "lists.idx",
          [&] { return
              "problem too large for 32-bit entry indices: " + p.describe() + " with " + std::to_string(Kq) +
              " slots per query"; });
}

qs::Params base_params(const ProblemShape& p, const detail::QueryCall& c, const QuerySparseBins& bins,
                       void* workspace, std::size_t bytes) {
  const QueryLists& lists = c.lists;
  const std::int64_t Kq = c.Kq;
  const PartialPrecision prec = c.partials;
  // Bins a plan can have made: a window the lists allow, and bands that resolve to themselves.
  const int win = resolve_merge_window(p, Kq, bins.window, kOp, "bins.window");
  require(bins.bands >= 1 && bands_of(p, Kq, win, bins.bands) == bins.bands, kOp, "bins.bands",
          [&] { return std::to_string(bins.bands) + " query bands are not a plan's for merge window " +
                       std::to_string(win) + " and " + p.describe(); });
  check_shape(p, Kq, bins.bands);
  const Layout l = layout(p, Kq, prec, bins.bands);
  require(workspace != nullptr || l.total == 0, kOp, "workspace",
          [&] { return "is empty; it needs " + std::to_string(l.total) + " bytes"; });
  require(bytes >= l.total, kOp, "workspace",
          [&] { return "holds " + std::to_string(bytes) + " bytes; this problem needs " + std::to_string(l.total); });
  require(reinterpret_cast<std::uintptr_t>(workspace) % 16 == 0, kOp, "workspace", "must be 16-byte aligned");
  qs::Params q;
  q.B = static_cast<int>(p.B);
  q.Lq = static_cast<int>(p.Lq);
  q.Lk = static_cast<int>(p.Lk);
  q.Hq = static_cast<int>(p.Hq);
  q.Hkv = static_cast<int>(p.Hkv);
  q.Tk = static_cast<int>(p.Tk());
  q.Kq = static_cast<int>(Kq);
  q.group = static_cast<int>(p.group_size());
  q.offset = p.offset();
  q.causal = p.causal;
  q.win = win;
  q.bands = bins.bands;
  q.band_queries = static_cast<int>(ceil_div(p.Lq, static_cast<std::int64_t>(q.bands)));
  q.bins = static_cast<int>(merge_bins(p.Tk(), win) * q.bands);
  q.nblk = p.B * p.Hkv * q.bins;
  q.slots = l.slots;
  q.idx = static_cast<const std::int32_t*>(lists.idx.data);
  for (int i = 0; i < 4; ++i) q.idx_stride[i] = lists.idx.stride[i];
  char* w = static_cast<char*>(workspace);
  q.counts = reinterpret_cast<int*>(w + l.counts);
  q.offsets = reinterpret_cast<int*>(w + l.offsets);
  q.item_offsets = reinterpret_cast<int*>(w + l.item_offsets);
  q.entries = reinterpret_cast<int*>(w + l.entries);
  q.items = reinterpret_cast<int2*>(w + l.items);
  q.bad = reinterpret_cast<unsigned long long*>(w + l.bad);
  q.lse_part = reinterpret_cast<float*>(w + l.lse);
  q.part = w + l.part;
  q.merged = win > 1 ? reinterpret_cast<std::int32_t*>(w + l.merged) : nullptr;
  q.queue = reinterpret_cast<int*>(w + l.queue);
  return q;
}

// Rows are moved by 16-byte vector loads.
void check_rows(const std::string& name, const TensorView& t) {
  require(reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 &&
              t.stride[2] % 8 == 0,
          kOp, name,
          [&] { return
              "needs a 16-byte aligned base and strides that are multiples of 8 elements, got " + t.describe(); });
}

std::int32_t read_index(const std::int32_t* ptr, cudaStream_t stream) {
  std::int32_t v = 0;
  check_cuda(cudaMemcpyAsync(&v, ptr, sizeof(v), cudaMemcpyDeviceToHost, stream), "reading lists");
  check_cuda(cudaStreamSynchronize(stream), "reading lists");
  return v;
}

void validate_on_device(const qs::Params& q, cudaStream_t stream) {
  const unsigned long long none = std::numeric_limits<unsigned long long>::max();
  check_cuda(cudaMemcpyAsync(q.bad, &none, sizeof(none), cudaMemcpyHostToDevice, stream), "list validation");
  check_cuda(qs::launch_validate(q, stream), "list validation launch");
  unsigned long long found = none;
  check_cuda(cudaMemcpyAsync(&found, q.bad, sizeof(found), cudaMemcpyDeviceToHost, stream), "list validation");
  check_cuda(cudaStreamSynchronize(stream), "list validation");
  if (found == none) return;
  const unsigned code = static_cast<unsigned>(found & 1u);
  const long long pos = static_cast<long long>(found >> 1);
  const int s = static_cast<int>(pos % q.Kq);
  const long long r = pos / q.Kq;
  const int i = static_cast<int>(r % q.Lq);
  const long long bg = r / q.Lq, b = bg / q.Hkv, g = bg % q.Hkv;
  const std::int32_t* row = q.idx + b * q.idx_stride[0] + g * q.idx_stride[1] + i * q.idx_stride[2];
  const int j = read_index(row + s * q.idx_stride[3], stream);
  const std::string at = detail::coord_string({b, g, i, s});
  if (code == qs::kBadRange)
    throw Error(kOp, "lists.idx", "block id " + std::to_string(j) + " at " + at + " is out of range [0, " +
                                      std::to_string(q.Tk) + ") (-1 marks an empty slot)");
  throw Error(kOp, "lists.idx", "block id " + std::to_string(j) + " at " + at +
                                    " repeats an earlier slot of the same query: ids must be distinct");
}

// The one-call entry point's workspace (and the validation's fault word) per (device, stream).
WorkspaceCache g_workspaces;

// ---- group-centric ---------------------------------------------------------------------------------

qs::GroupParams group_params(const ProblemShape& p, const QueryLists& lists, int device) {
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  const std::int64_t Kq = lists.idx.shape[3], G = p.group_size();
  const std::int64_t head_tiles = ceil_div(G, 16);
  require(head_tiles <= qs::kGroupWarps, kOp, "options.schedule",
          [&] { return
              "group_centric runs one query's heads of a group in one CTA of " + std::to_string(qs::kGroupWarps) +
              " x 16 rows: at most " + std::to_string(16 * qs::kGroupWarps) + " query heads per KV head, got " +
              std::to_string(G) + " (use kv_centric)"; });
  qs::GroupParams g;
  g.B = static_cast<int>(p.B);
  g.Lq = static_cast<int>(p.Lq);
  g.Lk = static_cast<int>(p.Lk);
  g.Hq = static_cast<int>(p.Hq);
  g.Hkv = static_cast<int>(p.Hkv);
  g.Tk = static_cast<int>(p.Tk());
  g.Kq = static_cast<int>(Kq);
  g.group = static_cast<int>(G);
  g.head_tiles = static_cast<int>(head_tiles);
  g.cta_queries = qs::kGroupWarps / g.head_tiles;
  const std::int64_t per_bg = ceil_div(p.Lq, static_cast<std::int64_t>(g.cta_queries));
  require(p.Lq <= kIntMax && p.Lk <= kIntMax && Kq * g.cta_queries <= kIntMax && p.B * p.Hkv * per_bg <= kIntMax, kOp,
          "lists.idx",
          [&] { return "problem too large for the group-centric grid: " + p.describe() + " with " + std::to_string(Kq) +
              " slots per query"; });
  g.ctas_per_bg = static_cast<int>(per_bg);
  g.words = static_cast<int>(ceil_div(p.Tk(), 32));
  g.union_cap = static_cast<int>(std::min<std::int64_t>(p.Tk(), Kq * g.cta_queries));
  g.offset = p.offset();
  g.causal = p.causal;
  g.idx = static_cast<const std::int32_t*>(lists.idx.data);
  for (int i = 0; i < 4; ++i) g.idx_stride[i] = lists.idx.stride[i];
  int optin = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  const std::size_t smem = qs::group_smem_bytes(g, static_cast<int>(p.D));
  require(smem <= static_cast<std::size_t>(optin), kOp, "lists.idx",
          [&] { return "group_centric keeps the union of " + std::to_string(g.cta_queries) + " queries' lists (" +
              std::to_string(Kq) + " slots each, " + std::to_string(p.Tk()) + " KV blocks) in shared memory: " +
              std::to_string(smem) + " bytes exceed the device's " + std::to_string(optin) + " (use kv_centric)"; });
  return g;
}

}  // namespace

void query_sparse_group(const detail::AttentionCall& a, const detail::QueryCall& c) {
  const ProblemShape& p = a.p;
  const TensorView &q = a.q, &k = a.k, &v = a.v, &out = a.out;
  const std::optional<TensorView>& lse = a.lse;
  const QueryLists& lists = c.lists;
  check_rows("q", q);
  check_rows("k", k);
  check_rows("v", v);
  require(reinterpret_cast<std::uintptr_t>(out.data) % 4 == 0 && out.stride[0] % 2 == 0 && out.stride[1] % 2 == 0 &&
              out.stride[2] % 2 == 0,
          kOp, "out",
          [&] { return "group_centric writes pairs of elements: it needs a 4-byte aligned base and even strides, got " +
                          out.describe(); });
  DeviceGuard guard(a.device);
  qs::GroupParams g = group_params(p, lists, a.device);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  const std::int64_t Kq = c.Kq;
  if (!a.trusted && p.B * p.Hkv * p.Lq * Kq > 0) {
    // Validation needs one device word for the first fault; it lives in the cached workspace.
    std::lock_guard<std::mutex> lock(g_workspaces.mutex());
    qs::Params vq;
    vq.B = g.B, vq.Lq = g.Lq, vq.Lk = g.Lk, vq.Hq = g.Hq, vq.Hkv = g.Hkv, vq.Tk = g.Tk, vq.Kq = g.Kq, vq.group = g.group;
    vq.idx = g.idx;
    for (int i = 0; i < 4; ++i) vq.idx_stride[i] = g.idx_stride[i];
    vq.bad = static_cast<unsigned long long*>(g_workspaces.get(kOp, a.device, a.stream, 256));
    validate_on_device(vq, stream);
  }
  g.q = q.data;
  g.k = k.data;
  g.v = v.data;
  for (int i = 0; i < 3; ++i) {
    g.q_stride[i] = q.stride[i];
    g.k_stride[i] = k.stride[i];
    g.v_stride[i] = v.stride[i];
    g.out_stride[i] = out.stride[i];
  }
  g.out = out.data;
  if (lse) {
    g.lse = static_cast<float*>(lse->data);
    for (int i = 0; i < 3; ++i) g.lse_stride[i] = lse->stride[i];
  }
  g.scale = a.scale;
  g.scale_log2 = a.scale_log2;
  const CUtensorMap tm_k = cuda_kernels::make_bhld_tensor_map(kOp, "k", k);
  const CUtensorMap tm_v = cuda_kernels::make_bhld_tensor_map(kOp, "v", v);
  check_cuda(qs::launch_group(g, q.dtype == DType::bf16, static_cast<int>(p.D), tm_k, tm_v, stream),
             "group_centric launch");
}

QuerySparseBins query_sparse_bins(const ProblemShape& p, std::int64_t Kq, int merge_window,
                                  const detail::QuerySparseTuning& tuning) {
  return {merge_window, bands_of(p, Kq, merge_window, tuning.query_bands)};
}

std::size_t query_sparse_workspace_bytes(const ProblemShape& p, std::int64_t Kq, PartialPrecision partials,
                                         const detail::QuerySparseTuning& tuning) {
  return layout(p, Kq, partials, bands_of(p, Kq, 1, tuning.query_bands)).total;
}

void query_sparse_plan(const detail::AttentionCall& a, const detail::QueryCall& c, const QuerySparseBins& bins,
                       void* workspace, std::size_t bytes) {
  DeviceGuard guard(a.device);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  const qs::Params q = base_params(a.p, c, bins, workspace, bytes);
  if (!a.trusted && q.slots > 0) validate_on_device(q, stream);
  check_cuda(qs::launch_reverse_index(q, stream), "reverse index launch");
}

void query_sparse_attend(const detail::AttentionCall& a, const detail::QueryCall& c, const QuerySparseBins& bins,
                         void* workspace, std::size_t bytes, const detail::QuerySparseTuning& tuning) {
  const ProblemShape& p = a.p;
  const TensorView &q = a.q, &k = a.k, &v = a.v;
  check_rows("q", q);
  check_rows("k", k);
  check_rows("v", v);
  DeviceGuard guard(a.device);
  qs::Params prm = base_params(p, c, bins, workspace, bytes);
  if (prm.slots == 0) return;
  prm.q = q.data;
  prm.k = k.data;
  prm.v = v.data;
  for (int i = 0; i < 3; ++i) {
    prm.q_stride[i] = q.stride[i];
    prm.k_stride[i] = k.stride[i];
    prm.v_stride[i] = v.stride[i];
  }
  prm.scale = a.scale;
  prm.scale_log2 = a.scale_log2;
  const Layout l = layout(p, c.Kq, c.partials, bins.bands);
  const CUtensorMap tm_k = cuda_kernels::make_bhld_tensor_map(kOp, "k", k);
  const CUtensorMap tm_v = cuda_kernels::make_bhld_tensor_map(kOp, "v", v);
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, a.device), "cudaDeviceGetAttribute");
  int optin = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, a.device),
             "cudaDeviceGetAttribute");
  const std::size_t smem = qs::attend_smem(static_cast<int>(p.D));
  require(smem <= static_cast<std::size_t>(optin), kOp, "q",
          [&] { return
              "the KV-centric attention kernel needs " + std::to_string(smem) + " bytes of shared memory per CTA, the "
              "device offers " + std::to_string(optin) + " (it is built for Hopper, sm_90a)"; });
  const int ctas = tuning.attend_max_ctas > 0 ? std::min(tuning.attend_max_ctas, sms) : sms;
  check_cuda(qs::launch_attend(prm, q.dtype == DType::bf16, static_cast<int>(p.D),
                               c.partials == PartialPrecision::bf16, &tm_k, &tm_v, ctas, l.max_items,
                               static_cast<cudaStream_t>(a.stream)),
             "attention launch");
}

void query_sparse_combine(const detail::AttentionCall& a, const detail::QueryCall& c, const QuerySparseBins& bins,
                          void* workspace, std::size_t bytes) {
  const TensorView& out = a.out;
  const std::optional<TensorView>& lse = a.lse;
  DeviceGuard guard(a.device);
  qs::Params prm = base_params(a.p, c, bins, workspace, bytes);
  prm.out = out.data;
  for (int i = 0; i < 3; ++i) prm.out_stride[i] = out.stride[i];
  if (lse) {
    prm.lse = static_cast<float*>(lse->data);
    for (int i = 0; i < 3; ++i) prm.lse_stride[i] = lse->stride[i];
  }
  check_cuda(qs::launch_combine(prm, out.dtype == DType::bf16, static_cast<int>(a.p.D),
                                c.partials == PartialPrecision::bf16, static_cast<cudaStream_t>(a.stream)),
             "combine launch");
}

void query_sparse(const detail::AttentionCall& a, const detail::QueryCall& c, const detail::QuerySparseTuning& tuning) {
  if (c.schedule == QuerySchedule::group_centric) return query_sparse_group(a, c);
  const ProblemShape& p = a.p;
  check_rows("q", a.q);
  const QuerySparseBins bins = query_sparse_bins(p, c.Kq, c.merge_window, tuning);
  check_shape(p, c.Kq, bins.bands);
  const std::size_t need = query_sparse_workspace_bytes(p, c.Kq, c.partials, tuning);
  DeviceGuard guard(a.device);
  std::lock_guard<std::mutex> lock(g_workspaces.mutex());
  void* ws = g_workspaces.get(kOp, a.device, a.stream, need);
  query_sparse_plan(a, c, bins, ws, need);
  query_sparse_attend(a, c, bins, ws, need, tuning);
  query_sparse_combine(a, c, bins, ws, need);
}

}  // namespace sparse_attn::cuda_backend
