// Plain parameter structs of entmax's output pass, the Q-centric kernel with the entmax transform
// (entmax_transform.cuh), and the per-row state that entmax's threshold passes (cuda/entmax/) leave it.
#pragma once

#include <cstdint>


namespace sparse_attn::cuda_kernels {

/// Per query row (index (b * Hq + h) * Lq + i), written by the threshold passes.
struct EntmaxRow {
  enum Status : int {
    kSearching = 0,  // live, threshold still bracketed by [lo, hi]
    kLive = 1,       // live, z_tau final
    kNoKey = 2,      // sees no key (causal, Lq > Lk): out = 0
    kPoisoned = 3,   // a visible score is NaN or +inf: out = NaN
  };
  float z_max = 0.0f;  // row max of z = scale * q.k over the visible keys
  float z_tau = 0.0f;  // the threshold in z units: weight ((alpha - 1)(z - z_tau))^r where z > z_tau
  float z_lo = 0.0f;   // z of the bracket's low end, rounded down: the scores a search pass looks at
  int status = kSearching;
  int inside = -1;  // scores in [lo, hi) as the last pass counted them (-1: not counted)
  int marked = 0;   // kLive: its support's block bits and count are in (entmax/threshold.cu)
  double lo = 0.0, hi = 1.0;  // bracket of tau in shifted units u = (alpha - 1)(z - z_max) + 1
};

/// The entmax transform's kernel argument (beside the tile kernel's parameters).
struct EntmaxTransformParams {
  const EntmaxRow* rows = nullptr;  // [B, Hq, Lq]
  float am1 = 0.5f;                 // alpha - 1
  float r = 2.0f;                   // 1 / (alpha - 1)
  float scale = 1.0f;               // z = scale * q.k
  int power = 2;                    // 1: alpha = 2, 2: alpha = 1.5, 0: any other alpha
};

}  // namespace sparse_attn::cuda_kernels
