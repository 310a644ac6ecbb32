// Plain parameter struct of the Q-centric block-sparse attention kernel (passed by value as a
// __grid_constant__ argument together with the TMA maps).
#pragma once

#include <cstdint>

namespace sparse_attn::cuda_kernels {

struct DeviceFault;  // fault_word.hpp

struct TileAttentionParams {
  int B = 0, Lq = 0, Lk = 0, Hq = 0, Hkv = 0;
  int Tq = 0, Tk = 0;
  int group_size = 1;      // Hq / Hkv: query heads per KV head
  int heads_per_list = 1;  // Hq / G: query heads sharing one list (group_size for G = Hkv, 1 for G = Hq)
  bool causal = false;
  bool dense = false;  // every block of every tile; idx and cnt are unused
  float scale_log2 = 0.0f;  // softmax scale * log2(e): scores go through exp2

  // TileLists: idx [B, G, Tq, Kmax], cnt [B, G, Tq], strides in elements.
  const std::int32_t* idx = nullptr;
  const std::int32_t* cnt = nullptr;
  int Kmax = 0;
  std::int64_t idx_stride[4] = {0, 0, 0, 0};
  std::int64_t cnt_stride[3] = {0, 0, 0};
  // Validated calls: the device's fault record and the device address of its host flag (fault_word.hpp,
  // FaultSink), for the list check that follows the attention (list_check.cu). The attention kernel does
  // not read them: its walk clamps counts to [0, Kmax] and skips ids out of range whatever the lists hold.
  DeviceFault* fault = nullptr;
  int* fault_flag = nullptr;

  // out [B, Lq, Hq, D] (D contiguous), lse [B, Hq, Lq] float32 or null; strides in elements.
  void* out = nullptr;
  std::int64_t out_stride[3] = {0, 0, 0};
  float* lse = nullptr;
  std::int64_t lse_stride[3] = {0, 0, 0};

  int num_units = 0;  // scheduling units: B * Hq * Tq, or B * Hq * ceil(Tq / 2) tile pairs when causal
  bool tma_store = false;  // out is written through shared memory by TMA (tm_out); else from registers

  // Split tail (scheduler.cuh): units [dp_units, num_units) are computed in pieces by tail_ctas CTAs,
  // tail_len walk positions per unit (tail_ctas = 0: no split). Each piece leaves its unnormalised
  // output and (m, l) in a slot of tail_part; per tail unit and consumer warpgroup, tail_count counts
  // the pieces that have arrived (the last one resets it to 0 as it combines).
  int dp_units = 0;
  int tail_ctas = 0;
  int tail_len = 0;
  unsigned* tail_count = nullptr;  // [num_units - dp_units][2]
  float* tail_part = nullptr;      // [slots][2][kTailPartFloats]
};

// One piece of one consumer warpgroup: its 64 x D output fragment (D / 2 floats per thread, up to 64)
// as float4 columns [D / 8][128 threads], then (m0, m1, l0, l1) per thread. Sized for D = 128.
inline constexpr int kTailPartFloats = (128 / 8 + 1) * 128 * 4;

}  // namespace sparse_attn::cuda_kernels
