// Instrumentation of the CUDA lightning indexer, token form (tests and timing only; not part of the
// public API). Every setting is process-wide and applies to later calls.
#pragma once

#include <cuda_runtime.h>

namespace sparse_attn::cuda_backend {

/// While non-null, every TokenLists call on the device adds to device_counters[0] the number of query rows
/// screened on the tensor cores (rows seeing more than top_k keys), to [1] the number of (row, key) pairs
/// whose screened score was too close to the row's k-th to decide, so they were re-scored in float64, and
/// to [2] the number of rows handed to the float64 streaming path (candidate buffer or undecided list
/// overflowed, non-finite inputs, shapes beyond the screening kernel), and to [3] the number of candidate
/// buffer compactions. Four unsigned long long of device memory; nullptr stops counting.
void set_lightning_stats(unsigned long long* device_counters);

/// 0: automatic (screen, then float64 for the undecided); 1: every row on the float64 streaming path.
/// Both give the same ids.
void set_lightning_path(int path);

/// Caps the per-query candidate buffer of the screening kernel (0: as large as shared memory allows).
/// A small cap makes short rows exercise the buffer compaction; values below top_k + 32 are raised to it.
void set_lightning_capacity(int capacity);

/// Screening kernel of later calls: 0 = wgmma (m64n128k16, four queries per CTA), 1 = mma.sync (m16n8k16,
/// eight queries per CTA). Both give the same ids.
void set_lightning_screen(int kernel);

/// While non-null, later calls record events[0 .. 4] on their stream: at the start, after the index
/// preparation, after the screen, after the resolve kernel and after the fallback kernel.
void set_lightning_events(cudaEvent_t* events);

}  // namespace sparse_attn::cuda_backend
