// SPARSE_ATTN_HD: a function that nvcc compiles for host and device, plain inline under a host compiler
// (headers shared by kernels and the CPU tests that check their arithmetic: fast_div.hpp,
// entmax/bracket.hpp).
#pragma once

#if defined(__CUDACC__)
#define SPARSE_ATTN_HD __host__ __device__ __forceinline__
#else
#define SPARSE_ATTN_HD inline
#endif
