// DSA lightning indexer on the CPU (docs/design.md §5.7).
//
// One query row at a time: the scores of its visible keys are streamed through a bounded heap
// (token top-k) or max-pooled into one value per block (block top-k), so memory stays O(k + Tk)
// per row and the [Lq, Lk] score matrix never exists.
#include <algorithm>
#include <limits>
#include <vector>

#include "selectors/select_common.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/selectors/backend.hpp"
#endif
#include "sparse_attn/selectors.hpp"

namespace sparse_attn {

namespace {

using detail::require;
using detail::Scored;

struct LightningShape {
  std::int64_t B, Lq, Lk, HI, Di, sink;
  bool causal;
  std::int64_t key_end(std::int64_t t) const {
    return causal ? std::clamp<std::int64_t>(t + (Lk - Lq) + 1, 0, Lk) : Lk;
  }
  // Sink keys rank above every scored key (+inf), so ties among them go to the lower id.
  bool forced(std::int64_t key) const { return key < sink; }
};

LightningShape check_lightning_args(const std::string& op, const TensorView& qI, const TensorView& w,
                                    const TensorView& kI, const TensorView& idx, const LightningOptions& o) {
  require(o.top_k >= 1, op, "options.top_k", [&] { return "must be >= 1, got " + std::to_string(o.top_k); });
  require(o.sink_keys >= 0, op, "options.sink_keys",
          [&] { return "must be >= 0, got " + std::to_string(o.sink_keys); });
  detail::check_precision(op, o.precision);
  require(o.precision != IndexPrecision::fp4_e2m1, op, "options.precision",
          "fp4_e2m1 is not supported by the lightning indexer (use bf16 or fp8_e4m3)");
  detail::check_tensor(op, "qI", qI, 4, {DType::bf16, DType::f16, DType::f32});
  detail::check_tensor(op, "w", w, 3, {DType::f32});
  detail::check_tensor(op, "kI", kI, 3, {DType::bf16, DType::f16, DType::f32});
  detail::check_same_device(op, "w", w, "qI", qI);
  detail::check_same_device(op, "kI", kI, "qI", qI);
  LightningShape s{};
  s.B = qI.shape[0];
  s.Lq = qI.shape[1];
  s.HI = qI.shape[2];
  s.Di = qI.shape[3];
  s.Lk = kI.shape[1];
  s.causal = o.causal;
  s.sink = o.sink_keys;
  require(s.B > 0 && s.Lq > 0 && s.HI > 0 && s.Di > 0, op, "qI",
          [&] { return "every extent must be > 0, got " + detail::shape_string(qI); });
  require(s.Lk > 0, op, "kI", [&] { return "every extent must be > 0, got " + detail::shape_string(kI); });
  detail::check_shape(op, "w", w, {s.B, s.Lq, s.HI});
  detail::check_shape(op, "kI", kI, {s.B, -1, s.Di});
  detail::check_last_contiguous(op, "qI", qI);
  detail::check_last_contiguous(op, "kI", kI);
  detail::check_tensor(op, "out.idx", idx, 4, {DType::i32});
  detail::check_shape(op, "out.idx", idx, {s.B, -1, s.Lq, -1});
  require(idx.shape[1] > 0, op, "out.idx",
          [&] { return "needs at least one group, got shape " + detail::shape_string(idx); });
  require(idx.shape[3] >= o.top_k, op, "out.idx",
          [&] { return
              "capacity " + std::to_string(idx.shape[3]) + " is smaller than options.top_k = " +
              std::to_string(o.top_k); });
  detail::check_same_device(op, "out.idx", idx, "qI", qI);
  return s;
}

struct LightningInputs {
  detail::QuantizedTensor q, k;
  std::vector<double> w;  // [B, Lq, HI]
};

LightningInputs prepare(const std::string& op, const TensorView& qI, const TensorView& w, const TensorView& kI,
                        const LightningShape& s, IndexPrecision p) {
  LightningInputs in{detail::load_quantized(op, "qI", qI, p), detail::load_quantized(op, "kI", kI, p), {}};
  in.w.resize(static_cast<std::size_t>(s.B * s.Lq * s.HI));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t t = 0; t < s.Lq; ++t)
      for (std::int64_t j = 0; j < s.HI; ++j) {
        const float x = *static_cast<const float*>(w.at({b, t, j}));
        require(std::isfinite(x), op, "w",
                [&] { return
                    "holds the non-finite value " + std::to_string(x) + " at " + detail::coord_string({b, t, j}); });
        in.w[static_cast<std::size_t>((b * s.Lq + t) * s.HI + j)] = x;
      }
  return in;
}

// I[t, s] for one query row, in float64 with the heads summed in order. `qrows` holds the row's
// HI index query pointers and `dots` HI doubles of scratch.
double index_score(const LightningInputs& in, const LightningShape& s, std::int64_t b, std::int64_t t,
                   std::int64_t key, const float* const* qrows, double* dots) {
  detail::dots_f64(in.k.row(b, key, 0), qrows, s.HI, s.Di, dots);
  const double* w = in.w.data() + (b * s.Lq + t) * s.HI;
  double acc = 0.0;
  // An explicit fma: w * ReLU(dot) is not exact in float64, so whether a compiler contracts the
  // multiply-add would change the rounding; the CUDA indexer evaluates the same fma chain.
  for (std::int64_t j = 0; j < s.HI; ++j) acc = std::fma(w[j], std::max(0.0, dots[j]), acc);
  return detail::sanitize(acc);
}

struct RowScratch {
  std::vector<const float*> qrows;
  std::vector<double> dots;
  RowScratch(const LightningInputs& in, const LightningShape& s, std::int64_t b, std::int64_t t)
      : qrows(static_cast<std::size_t>(s.HI)), dots(static_cast<std::size_t>(s.HI)) {
    for (std::int64_t j = 0; j < s.HI; ++j) qrows[static_cast<std::size_t>(j)] = in.q.row(b, t, j);
  }
};

void write_all_groups(const TensorView& idx, std::int64_t b, std::int64_t t, const std::vector<std::int32_t>& ids) {
  for (std::int64_t g = 0; g < idx.shape[1]; ++g)
    detail::write_padded(detail::idx_ptr4(idx, b, g, t, 0), idx.stride[3], idx.shape[3], ids);
}

}  // namespace

void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const TokenLists& out,
                      const LightningOptions& options) {
  const std::string op = "lightning_select";
  const LightningShape s = check_lightning_args(op, qI, w, kI, out.idx, options);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (qI.device == Device::cuda) return cuda_backend::lightning_select(qI, w, kI, out, options);
#endif
  if (qI.device != Device::cpu) detail::unsupported_device(op, "qI", qI);

  const LightningInputs in = prepare(op, qI, w, kI, s, options.precision);
  const auto k = static_cast<std::size_t>(options.top_k);
  detail::parallel_for(s.B * s.Lq, [&](std::int64_t bt) {
    const std::int64_t b = bt / s.Lq, t = bt % s.Lq;
    // Heap ordered by ranks_before: its front is the worst of the kept keys.
    RowScratch scratch(in, s, b, t);
    std::vector<Scored> heap;
    heap.reserve(std::min<std::size_t>(k, static_cast<std::size_t>(s.key_end(t))));
    for (std::int64_t key = 0; key < s.key_end(t); ++key) {
      const double v = s.forced(key) ? std::numeric_limits<double>::infinity()
                                     : index_score(in, s, b, t, key, scratch.qrows.data(), scratch.dots.data());
      const Scored c{v, static_cast<std::int32_t>(key)};
      if (heap.size() < k) {
        heap.push_back(c);
        std::push_heap(heap.begin(), heap.end(), detail::ranks_before);
      } else if (detail::ranks_before(c, heap.front())) {
        std::pop_heap(heap.begin(), heap.end(), detail::ranks_before);
        heap.back() = c;
        std::push_heap(heap.begin(), heap.end(), detail::ranks_before);
      }
    }
    std::vector<std::int32_t> ids(heap.size());
    for (std::size_t i = 0; i < heap.size(); ++i) ids[i] = heap[i].id;
    std::sort(ids.begin(), ids.end());
    write_all_groups(out.idx, b, t, ids);
  });
}

void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const QueryLists& out,
                      const LightningOptions& options) {
  const std::string op = "lightning_select";
  const LightningShape s = check_lightning_args(op, qI, w, kI, out.idx, options);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (qI.device == Device::cuda) return cuda_backend::lightning_select(qI, w, kI, out, options);
#endif
  if (qI.device != Device::cpu) detail::unsupported_device(op, "qI", qI);

  const LightningInputs in = prepare(op, qI, w, kI, s, options.precision);
  const std::int64_t Tk = ceil_div(s.Lk, kBlockK);
  detail::parallel_for(s.B * s.Lq, [&](std::int64_t bt) {
    const std::int64_t b = bt / s.Lq, t = bt % s.Lq;
    const std::int64_t end = s.key_end(t);
    RowScratch scratch(in, s, b, t);
    std::vector<Scored> cand;
    cand.reserve(static_cast<std::size_t>(Tk));
    for (std::int64_t key = 0; key < end; ++key) {
      const double v = s.forced(key) ? std::numeric_limits<double>::infinity()
                                     : index_score(in, s, b, t, key, scratch.qrows.data(), scratch.dots.data());
      const auto j = static_cast<std::int32_t>(key / kBlockK);
      if (cand.empty() || cand.back().id != j) cand.push_back({v, j});
      else cand.back().score = std::max(cand.back().score, v);
    }
    std::vector<std::int32_t> ids;
    detail::top_k_ascending(cand, options.top_k, ids);
    write_all_groups(out.idx, b, t, ids);
  });
}

std::size_t lightning_workspace_bytes(const TensorView& qI, const TensorView& kI, bool token_lists,
                                      const LightningOptions& options) {
  const std::string op = "lightning_workspace_bytes";
  detail::require(qI.ndim == 4, op, "qI", [&] { return "expected [B, Lq, HI, Di], got " + qI.describe(); });
  detail::require(kI.ndim == 3, op, "kI", [&] { return "expected [B, Lk, Di], got " + kI.describe(); });
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (qI.device == Device::cuda)
    return cuda_backend::lightning_scratch_bytes(qI.shape[0], qI.shape[1], kI.shape[1], qI.shape[2], qI.shape[3],
                                                 options.top_k, options.precision, !token_lists);
#else
  (void)token_lists, (void)options;
#endif
  return 0;
}

}  // namespace sparse_attn
