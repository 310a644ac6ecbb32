// Selection quality in float64 on the CPU (docs/design.md §5.8).
//
// Work is split over (batch, query head); each job walks its queries one row at a time, so the
// memory held is O(Lk) per job and never the [Lq, Lk] matrix. Per-job partial sums are reduced in
// job order afterwards, so the report does not depend on the thread count.
//
// Conventions for degenerate cases:
// - a query that sees no key (causal, Lq > Lk) has no dense mass: it is left out of the kept-mass
//   statistics, and both of its outputs are 0; with no such query at all the kept mass is 1;
// - a query whose selection holds no visible key keeps mass 0 and its sparse output is 0;
// - a relative error whose reference norm is 0 is 0 when the difference is 0, else +inf;
// - with no visible pair (or tile) at all the sparsities are 0.
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.hpp"
#include "core/cpu.hpp"
#include "selectors/select_common.hpp"
#include "sparse_attn/evaluation.hpp"
#include "sparse_attn/ops.hpp"

namespace sparse_attn {

namespace {

using detail::require;

struct Partial {
  double kept_sum = 0.0;
  double kept_min = std::numeric_limits<double>::infinity();
  std::int64_t kept_n = 0;
  double err_sq = 0.0;  // sum (sparse - dense)^2
  double ref_sq = 0.0;  // sum dense^2
  std::int64_t selected_pairs = 0;
  std::int64_t visible_pairs = 0;
  std::int64_t selected_tiles = 0;
  std::int64_t visible_tiles = 0;
};

double relative(double err_sq, double ref_sq) {
  if (ref_sq > 0.0) return std::sqrt(err_sq / ref_sq);
  return err_sq == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
}

// k or v of every (batch, KV head) as float [B, Hkv, Lk, D]: every supported dtype converts to
// float exactly, and the contiguous layout keeps the row loops streaming.
std::vector<float> gather_kv(const TensorView& t, const ProblemShape& p) {
  std::vector<float> out(static_cast<std::size_t>(p.B * p.Hkv * p.Lk * p.D));
  detail::parallel_for(p.B * p.Hkv, [&](std::int64_t bg) {
    const std::int64_t b = bg / p.Hkv, g = bg % p.Hkv;
    for (std::int64_t j = 0; j < p.Lk; ++j) detail::load_bhld(t, b, j, g, out.data() + (bg * p.Lk + j) * p.D);
  });
  return out;
}

}  // namespace

QualityReport evaluate_selection(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const Selection& selection, const QualityOptions& options) {
  const std::string op = "evaluate_selection";
  float resolved_scale = 1.0f;
  const ProblemShape p = detail::check_qkv(op, q, k, v, {DType::bf16, DType::f16, DType::f32}, options.causal,
                                           options.softmax_scale, &resolved_scale);
  if (q.device != Device::cpu) detail::unsupported_device(op, "q", q);
  validate(selection, p, op);
  const double scale = resolved_scale;

  const std::vector<float> kf = gather_kv(k, p), vf = gather_kv(v, p);
  const std::int64_t group = p.Hq / p.Hkv, Tq = p.Tq(), Tk = p.Tk(), D = p.D;
  std::vector<Partial> parts(static_cast<std::size_t>(p.B * p.Hq));

  detail::parallel_for(p.B * p.Hq, [&](std::int64_t bh) {
    const std::int64_t b = bh / p.Hq, h = bh % p.Hq, g = h / group;
    const float* kb = kf.data() + (b * p.Hkv + g) * p.Lk * D;
    const float* vb = vf.data() + (b * p.Hkv + g) * p.Lk * D;
    Partial& part = parts[static_cast<std::size_t>(bh)];
    std::vector<std::uint8_t> row(static_cast<std::size_t>(p.Lk));
    std::vector<std::uint8_t> tile_hit(static_cast<std::size_t>(Tk));
    std::vector<float> qf(static_cast<std::size_t>(D));
    constexpr std::int64_t kChunk = 32;
    const float* rows[kChunk];
    std::vector<double> s(static_cast<std::size_t>(p.Lk)), dense(static_cast<std::size_t>(D)),
        sparse(static_cast<std::size_t>(D));
    for (std::int64_t t = 0; t < Tq; ++t) {
      const std::int64_t i0 = t * kTileQ, i1 = std::min(p.Lq, i0 + kTileQ);
      std::fill(tile_hit.begin(), tile_hit.end(), 0);
      part.visible_tiles += ceil_div(p.key_end(i1 - 1), kBlockK);  // key_end is monotone in i
      for (std::int64_t i = i0; i < i1; ++i) {
        const std::int64_t end = p.key_end(i);
        part.visible_pairs += end;
        std::fill(dense.begin(), dense.end(), 0.0);
        std::fill(sparse.begin(), sparse.end(), 0.0);
        if (end > 0) {
          selection_row(selection, p, b, h, i, row.data());
          detail::load_bhld(q, b, i, h, qf.data());
          double m = -std::numeric_limits<double>::infinity(), ms = m;
          for (std::int64_t j0 = 0; j0 < end; j0 += kChunk) {
            const std::int64_t n = std::min(kChunk, end - j0);
            for (std::int64_t r = 0; r < n; ++r) rows[r] = kb + (j0 + r) * D;
            detail::dots_f64(qf.data(), rows, n, D, s.data() + j0);
          }
          for (std::int64_t j = 0; j < end; ++j) {
            s[static_cast<std::size_t>(j)] *= scale;
            m = std::max(m, s[static_cast<std::size_t>(j)]);
            if (row[static_cast<std::size_t>(j)]) ms = std::max(ms, s[static_cast<std::size_t>(j)]);
          }
          // Dense and sparse softmax each against their own maximum, so a selection of keys whose
          // dense weights underflow still gets its exactly renormalised output.
          double z = 0.0, kept = 0.0, zs = 0.0;
          std::int64_t selected = 0;
          for (std::int64_t j = 0; j < end; ++j) {
            const double e = std::exp(s[static_cast<std::size_t>(j)] - m);
            z += e;
            const float* vr = vb + j * D;
            for (std::int64_t d = 0; d < D; ++d) dense[static_cast<std::size_t>(d)] += e * vr[d];
            if (!row[static_cast<std::size_t>(j)]) continue;
            kept += e;
            ++selected;
            tile_hit[static_cast<std::size_t>(j / kBlockK)] = 1;
            const double es = std::exp(s[static_cast<std::size_t>(j)] - ms);
            zs += es;
            for (std::int64_t d = 0; d < D; ++d) sparse[static_cast<std::size_t>(d)] += es * vr[d];
          }
          for (std::int64_t d = 0; d < D; ++d) {
            dense[static_cast<std::size_t>(d)] /= z;
            if (zs > 0.0) sparse[static_cast<std::size_t>(d)] /= zs;
          }
          const double mass = kept / z;
          part.kept_sum += mass;
          part.kept_min = std::min(part.kept_min, mass);
          ++part.kept_n;
          part.selected_pairs += selected;
        }
        for (std::int64_t d = 0; d < D; ++d) {
          const double diff = sparse[static_cast<std::size_t>(d)] - dense[static_cast<std::size_t>(d)];
          part.err_sq += diff * diff;
          part.ref_sq += dense[static_cast<std::size_t>(d)] * dense[static_cast<std::size_t>(d)];
        }
      }
      for (std::uint8_t hit : tile_hit) part.selected_tiles += hit;
    }
  });

  QualityReport r;
  r.kept_mass_mean_per_head.assign(static_cast<std::size_t>(p.Hq), 1.0);
  r.kept_mass_min_per_head.assign(static_cast<std::size_t>(p.Hq), 1.0);
  r.out_rel_err_per_head.assign(static_cast<std::size_t>(p.Hq), 0.0);
  Partial all;
  for (std::int64_t h = 0; h < p.Hq; ++h) {
    Partial head;
    for (std::int64_t b = 0; b < p.B; ++b) {
      const Partial& x = parts[static_cast<std::size_t>(b * p.Hq + h)];
      for (Partial* acc : {&head, &all}) {
        acc->kept_sum += x.kept_sum;
        acc->kept_min = std::min(acc->kept_min, x.kept_min);
        acc->kept_n += x.kept_n;
        acc->err_sq += x.err_sq;
        acc->ref_sq += x.ref_sq;
        acc->selected_pairs += x.selected_pairs;
        acc->visible_pairs += x.visible_pairs;
        acc->selected_tiles += x.selected_tiles;
        acc->visible_tiles += x.visible_tiles;
      }
    }
    if (head.kept_n > 0) {
      r.kept_mass_mean_per_head[static_cast<std::size_t>(h)] = head.kept_sum / static_cast<double>(head.kept_n);
      r.kept_mass_min_per_head[static_cast<std::size_t>(h)] = head.kept_min;
    }
    r.out_rel_err_per_head[static_cast<std::size_t>(h)] = relative(head.err_sq, head.ref_sq);
  }
  r.kept_mass_mean = all.kept_n > 0 ? all.kept_sum / static_cast<double>(all.kept_n) : 1.0;
  r.kept_mass_min = all.kept_n > 0 ? all.kept_min : 1.0;
  r.out_rel_err = relative(all.err_sq, all.ref_sq);
  r.selected_pairs = all.selected_pairs;
  r.visible_pairs = all.visible_pairs;
  r.token_sparsity =
      all.visible_pairs > 0 ? 1.0 - static_cast<double>(all.selected_pairs) / static_cast<double>(all.visible_pairs) : 0.0;
  r.block_sparsity =
      all.visible_tiles > 0 ? 1.0 - static_cast<double>(all.selected_tiles) / static_cast<double>(all.visible_tiles) : 0.0;
  return r;
}

}  // namespace sparse_attn
