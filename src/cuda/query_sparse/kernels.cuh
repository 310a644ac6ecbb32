// Kernels of the KV-centric query_sparse (backend.hpp gives the pipeline). Plain parameter struct,
// raw pointers and element strides; every index that can exceed 32 bits is computed in 64 bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sparse_attn::cuda_kernels::qs {

// Rows (query, head pairs) of one attention work item: 8 warps of 16 rows (one m16 MMA tile each).
// 128 keeps K/V reloads (from L2) per row low while the CTA's shared memory (Q, K, V^T of 128 rows
// of D = 128 with padding: 102 KB) still lets two CTAs share an SM.
inline constexpr int kRowsPerItem = 128;
inline constexpr int kWarps = kRowsPerItem / 16;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kKeys = 128;  // keys per KV block (kBlockK)
// 8 halves (16 bytes) of padding per shared row: a row stride of 4 (mod 32) words makes the 8 rows x
// 4 columns that a quad-organised fragment load touches fall on 32 distinct banks.
inline constexpr int kPad = 8;

enum : unsigned { kBadRange = 0, kBadDuplicate = 1 };

struct Params {
  int B = 0, Lq = 0, Lk = 0, Hq = 0, Hkv = 0, Tk = 0, Kq = 0, group = 0;
  long long offset = 0;  // Lk - Lq: query i sees key j iff j <= i + offset (causal)
  bool causal = false;
  long long nblk = 0;   // B * Hkv * Tk
  long long slots = 0;  // B * Hkv * Lq * Kq

  const std::int32_t* idx = nullptr;
  long long idx_stride[4] = {};

  // workspace
  int* counts = nullptr;        // [nblk]: counts, then fill cursors
  int* offsets = nullptr;       // [nblk + 1]: CSR offsets of entries
  int* item_offsets = nullptr;  // [nblk + 1]: first work item of each block; [nblk] = number of items
  int* entries = nullptr;       // [slots]: query * Kq + slot
  int2* items = nullptr;        // [max items]: (block x, first row)
  unsigned long long* bad = nullptr;
  float* lse_part = nullptr;    // [B, Hkv, Lq, Kq, group]
  void* part = nullptr;         // [B, Hkv, Lq, Kq, group, D], f32 or bf16

  // attention
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  long long q_stride[3] = {}, k_stride[3] = {}, v_stride[3] = {};
  float scale = 1.0f;       // natural-log units
  float scale_log2 = 1.0f;  // scale * log2(e)

  // combine
  void* out = nullptr;
  long long out_stride[3] = {};
  float* lse = nullptr;
  long long lse_stride[3] = {};
};

/// Whether slot entry j of query i is a block the pipeline computes: a valid id, not entirely in the
/// query's causal future. count, fill and combine all ask this one question, so a slot is combined
/// iff its partial was written.
__device__ __forceinline__ bool chosen(const Params& p, int i, int j) {
  return j >= 0 && j < p.Tk && (!p.causal || static_cast<long long>(j) * kKeys <= i + p.offset);
}

__device__ __forceinline__ int slot_block(const Params& p, long long f, int& i, int& s, long long& bg) {
  s = static_cast<int>(f % p.Kq);
  const long long r = f / p.Kq;
  i = static_cast<int>(r % p.Lq);
  bg = r / p.Lq;
  const long long b = bg / p.Hkv, g = bg % p.Hkv;
  return p.idx[b * p.idx_stride[0] + g * p.idx_stride[1] + i * p.idx_stride[2] + s * p.idx_stride[3]];
}

__device__ __forceinline__ long long items_of(const Params& p, long long count) {
  return (count * p.group + kRowsPerItem - 1) / kRowsPerItem;
}

}  // namespace sparse_attn::cuda_kernels::qs
