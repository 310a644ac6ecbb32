// Downstream smoke test of the installed package: only the public headers and the exported target.
// Runs dense causal GQA attention on a small problem, checks the output is finite and agrees with a
// float64 computation, and checks that bad input surfaces as sparse_attn::Error.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <sparse_attn/sparse_attn.hpp>

namespace {

// Deterministic values in [-1, 1) without <random>'s implementation-defined distributions.
struct Lcg {
  std::uint64_t s;
  float next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((s >> 40) & 0xffffff) / float(1 << 23) - 1.0f;
  }
};

}  // namespace

int main() {
  namespace sa = sparse_attn;
  // Lq < Lk and an odd length exercise the bottom-right causal alignment and a partial block.
  const std::int64_t B = 2, Lq = 37, Lk = 150, Hq = 4, Hkv = 2, D = 64;
  std::vector<float> q(B * Lq * Hq * D), k(B * Lk * Hkv * D), v(B * Lk * Hkv * D), out(B * Lq * Hq * D, NAN);
  Lcg rng{42};
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = rng.next();

  const auto qv = sa::TensorView::contiguous(q.data(), sa::DType::f32, {B, Lq, Hq, D});
  const auto kv = sa::TensorView::contiguous(k.data(), sa::DType::f32, {B, Lk, Hkv, D});
  const auto vv = sa::TensorView::contiguous(v.data(), sa::DType::f32, {B, Lk, Hkv, D});
  const auto ov = sa::TensorView::contiguous(out.data(), sa::DType::f32, {B, Lq, Hq, D});
  sa::AttentionOptions opt;
  opt.causal = true;
  sa::dense(qv, kv, vv, ov, std::nullopt, opt);

  const double scale = 1.0 / std::sqrt(double(D));
  double err2 = 0.0, ref2 = 0.0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Lq; ++i)
      for (std::int64_t h = 0; h < Hq; ++h) {
        const std::int64_t g = h / (Hq / Hkv), end = i + (Lk - Lq) + 1;
        std::vector<double> s(static_cast<std::size_t>(end));
        double m = -INFINITY, den = 0.0;
        for (std::int64_t j = 0; j < end; ++j) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += double(q[((b * Lq + i) * Hq + h) * D + d]) * k[((b * Lk + j) * Hkv + g) * D + d];
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        for (auto& x : s) den += (x = std::exp(x - m));
        for (std::int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (std::int64_t j = 0; j < end; ++j) acc += s[j] * v[((b * Lk + j) * Hkv + g) * D + d];
          const double ref = acc / den, got = out[((b * Lq + i) * Hq + h) * D + d];
          if (!std::isfinite(got)) {
            std::fprintf(stderr, "output not finite at b=%lld i=%lld h=%lld d=%lld\n", (long long)b, (long long)i,
                         (long long)h, (long long)d);
            return 1;
          }
          err2 += (got - ref) * (got - ref);
          ref2 += ref * ref;
        }
      }
  const double rel = std::sqrt(err2 / ref2);
  if (!(rel <= 1e-5)) {
    std::fprintf(stderr, "dense output relative error %.3g exceeds 1e-5\n", rel);
    return 1;
  }

  // Errors cross the library boundary as sparse_attn::Error naming the argument.
  bool threw = false;
  try {
    const auto bad = sa::TensorView::contiguous(out.data(), sa::DType::f32, {B, Lq, Hq, D + 1});
    sa::dense(qv, kv, vv, bad, std::nullopt, opt);
  } catch (const sa::Error& e) {
    threw = e.argument() == "out";
  }
  if (!threw) {
    std::fprintf(stderr, "a mis-shaped 'out' was not rejected with sparse_attn::Error naming 'out'\n");
    return 1;
  }

  const auto info = sa::build_info();
  std::printf("downstream OK: sparse_attn %s, dense relerr %.2e\n", info.version.c_str(), rel);
  return 0;
}
