// Read floor of the pooled selector at the tile16 shape (Lk = 16K): how long one launch takes to read q
// (bf16 [2, 4096, 16, 128]) and k (bf16 [2, 16384, 1, 128]), 42 MB, against the R1 representatives' own
// loop (float64 column sums over 128-token spans, the library's mapping: a warp per row of means, 8 bytes
// per lane, two batches of 16 tokens in flight) and variants that stream the same bytes through a
// shared-memory ring by bulk copies. Every variant that computes means is checked bit for bit against the
// library-like one. Each time is the median of 30 single launches between events, with q and k evicted
// from L2 before each (by reading 256 MB: no dirty lines), and once more after a kernel that leaves L2 full
// of dirty lines (as the attention does before a selector in a pipeline). The slice loop also runs with
// unused dynamic shared memory per CTA and with the maximum shared-memory carveout: whether the L1 that
// a large carveout leaves limits the loads in flight (docs/notes/selectors_pooled.md, version 9).
//
// Build and run on the GPU machine (a standalone program: it does not link the library):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o read_floor dev/bench/read_floor.cu
//   ./read_floor <name>.json
#include <cuda_runtime.h>
#include <cuda/ptx>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cstring>
#include <algorithm>
#include <string>
namespace ptx = cuda::ptx;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int B = 2, LQ = 4096, HQ = 16, D = 128, LK = 16384, HK = 1, SPAN = 128;

__device__ __forceinline__ void add8(double (&acc)[8], uint4 u) {
  unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += (double)__uint_as_float(w[i] << 16);
    acc[2 * i + 1] += (double)__uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void add4(double (&acc)[4], uint2 u) {
  acc[0] += (double)__uint_as_float(u.x << 16);
  acc[1] += (double)__uint_as_float(u.x & 0xffff0000u);
  acc[2] += (double)__uint_as_float(u.y << 16);
  acc[3] += (double)__uint_as_float(u.y & 0xffff0000u);
}

// Float64 column sums over the SPAN tokens at base, base + stride, ...: each token one vector load (Vec,
// added by add), two batches of U tokens in flight, the tokens added in order.
template <class Vec, int U, int W>
__device__ __forceinline__ void sum_span(const char* base, int stride, double (&acc)[W], void (*add)(double (&)[W], Vec)) {
  Vec b0[U], b1[U];
#pragma unroll
  for (int u = 0; u < U; ++u) b0[u] = __ldg((const Vec*)(base + (size_t)u * stride));
  for (int s = 0; s < SPAN; s += 2 * U) {
#pragma unroll
    for (int u = 0; u < U; ++u) b1[u] = __ldg((const Vec*)(base + (size_t)(s + U + u) * stride));
#pragma unroll
    for (int u = 0; u < U; ++u) add(acc, b0[u]);
    if (s + 2 * U < SPAN) {
#pragma unroll
      for (int u = 0; u < U; ++u) b0[u] = __ldg((const Vec*)(base + (size_t)(s + 2 * U + u) * stride));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) add(acc, b1[u]);
  }
}

// Segment s: q rows (b, tile) -> 128 tokens x 4096 B, stride 4096; k rows (b, block) -> 128 x 256 B.
// Output: mean[s][col] floats, q segments first (64 x 2048 floats), then k (256 x 128).
constexpr int QSEG = B * (LQ / SPAN), KSEG = B * (LK / SPAN);
constexpr int QW = HQ * D * 2, KW = HK * D * 2;  // bytes per token of a segment

// V0: as the library's kernel: a warp per (segment, head), lane 8 bytes, two batches of 16 tokens.
__global__ void __launch_bounds__(64) v0(const char* q, const char* k, float* mq, float* mk) {
  const int item = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = item / 32, c = item % 32;
  const int qrows = QSEG * HQ;
  const char* base; int stride; float* dst;
  if (row < qrows) { int s = row / HQ, h = row % HQ; base = q + (size_t)s * SPAN * QW + h * 256 + c * 8; stride = QW; dst = mq + (size_t)s * HQ * D + h * D + c * 4; }
  else { int s = row - qrows; if (s >= KSEG) return; base = k + (size_t)s * SPAN * KW + c * 8; stride = KW; dst = mk + (size_t)s * D + c * 4; }
  double acc[4] = {0, 0, 0, 0};
  sum_span<uint2, 16>(base, stride, acc, add4);
  for (int e = 0; e < 4; ++e) dst[e] = (float)(acc[e] / 128.0);
}

// V1: bulk copies into a shared ring. A CTA takes one segment's column slice of W bytes per token
// (q: W = 4096 / hsplit; k: a group of KPER blocks, 256 B each). Stage = T tokens. Warp 0 lane 0 is the
// producer (extra warp); consumer threads own 16 bytes each.
template <int W, int T, int S>
__global__ void v1(const char* q, const char* k, float* mq, float* mk, int hsplit, int qctas) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t full[S], empty[S];
  constexpr int NC = W / 16;  // consumer threads
  const bool isq = blockIdx.x < qctas;
  // q: CTA = (segment, slice); k: CTA = W / 256 consecutive blocks.
  const char* src[16]; int nsrc, chunk, stride;
  float* dst;
  if (isq) {
    const int s = blockIdx.x / hsplit, sl = blockIdx.x % hsplit;
    src[0] = q + (size_t)s * SPAN * QW + (size_t)sl * W; nsrc = 1; chunk = W; stride = QW;
    dst = mq + (size_t)s * HQ * D + (size_t)sl * (W / 2);
  } else {
    const int kb = (blockIdx.x - qctas) * (W / KW);
    nsrc = W / KW; chunk = KW; stride = KW;
    for (int i = 0; i < nsrc && i < 16; ++i) src[i] = k + (size_t)(kb + i) * SPAN * KW;
    dst = mk + (size_t)kb * D;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) { ptx::mbarrier_init(&full[i], 1); ptx::mbarrier_init(&empty[i], NC); }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncthreads();
  constexpr int NST = SPAN / T;
  if (threadIdx.x >= NC) {  // producer warp
    if (threadIdx.x != NC) return;
    for (int st = 0; st < NST; ++st) {
      const int slot = st % S;
      if (st >= S) while (!ptx::mbarrier_try_wait_parity(&empty[slot], ((st / S) - 1) & 1)) {}
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[slot], T * W);
      unsigned char* d = sm + (size_t)slot * T * W;
      if (nsrc == 1 && chunk == stride) {
        ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, d, src[0] + (size_t)st * T * stride, T * W, &full[slot]);
      } else if (nsrc == 1) {
        for (int t = 0; t < T; ++t)
          ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, d + t * W, src[0] + (size_t)(st * T + t) * stride, W, &full[slot]);
      } else {  // k: per block its T tokens are contiguous: T * 256 bytes; layout in smem [block][t][256]
        for (int i = 0; i < nsrc; ++i)
          ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, d + i * T * KW, src[i] + (size_t)st * T * KW, T * KW, &full[slot]);
      }
    }
    return;
  }
  const int tid = threadIdx.x;
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int st = 0; st < NST; ++st) {
    const int slot = st % S;
    while (!ptx::mbarrier_try_wait_parity(&full[slot], (st / S) & 1)) {}
    const unsigned char* d = sm + (size_t)slot * T * W;
    if (isq) {
#pragma unroll
      for (int t = 0; t < T; ++t) add8(acc, *(const uint4*)(d + t * W + tid * 16));
    } else {
      const int blk = tid / (KW / 16), c = tid % (KW / 16);
#pragma unroll
      for (int t = 0; t < T; ++t) add8(acc, *(const uint4*)(d + blk * T * KW + t * KW + c * 16));
    }
    (void)ptx::mbarrier_arrive(&empty[slot]);
  }
  float* o = isq ? dst + tid * 8 : dst + (size_t)(tid / (KW / 16)) * D + (tid % (KW / 16)) * 8;
  for (int e = 0; e < 8; ++e) o[e] = (float)(acc[e] / 128.0);
}

// V2: plain loads, thread per 16 bytes of a q segment (all heads of a tile in a CTA of 256), 2 x U tokens in flight.
template <int U>
__global__ void __launch_bounds__(256) v2(const char* q, const char* k, float* mq, float* mk) {
  const int item = blockIdx.x * 256 + threadIdx.x;
  const int qitems = QSEG * (QW / 16);
  const char* base; int stride; float* dst;
  if (item < qitems) { int s = item / (QW / 16), c = item % (QW / 16); base = q + (size_t)s * SPAN * QW + c * 16; stride = QW; dst = mq + (size_t)s * HQ * D + c * 8; }
  else { int it = item - qitems; int s = it / (KW / 16), c = it % (KW / 16); if (s >= KSEG) return; base = k + (size_t)s * SPAN * KW + c * 16; stride = KW; dst = mk + (size_t)s * D + c * 8; }
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  sum_span<uint4, U>(base, stride, acc, add8);
  for (int e = 0; e < 8; ++e) dst[e] = (float)(acc[e] / 128.0);
}

__global__ void fill(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed; x ^= x >> 15; x *= 2246822519u; x ^= x >> 13;
    float f = ((x & 0xffff) / 65536.0f - 0.5f) * 4.0f;
    p[i] = (uint16_t)(__float_as_uint(f) >> 16);
  }
}
__global__ void scrub(float* p, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] += 1.0f; }
// Reads n floats (evicts by reading: no dirty lines left behind); one store per CTA when impossible.
__global__ void scrub_read(const float4* p, size_t n4, float* sink) {
  float s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) { float4 v = __ldcg(p + i); s += v.x + v.y + v.z + v.w; }
  if (s == 12345.678f) sink[0] = s;
}
// Pure read of q and k: 16-byte loads, 8 in flight per thread, grid-stride.
__global__ void __launch_bounds__(256) readall(const uint4* a, size_t na, const uint4* b, size_t nb, float* sink) {
  unsigned x = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + 7 * stride < na; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldg(a + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < na; i += stride) { uint4 v = __ldg(a + i); x ^= v.x ^ v.y ^ v.z ^ v.w; }
  for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < nb; j += stride) { uint4 v = __ldg(b + j); x ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (x == 0x12345678u) sink[0] = 1.0f;
}

int main(int argc, char** argv) {
  const size_t qn = (size_t)B * LQ * HQ * D, kn = (size_t)B * LK * HK * D;
  const double bytes = (qn + kn) * 2.0;
  char *q, *k; float *mq, *mk, *junk;
  CK(cudaMalloc(&q, qn * 2)); CK(cudaMalloc(&k, kn * 2));
  CK(cudaMalloc(&mq, QSEG * HQ * D * 4)); CK(cudaMalloc(&mk, KSEG * D * 4));
  const size_t jn = 64ull << 20; CK(cudaMalloc(&junk, jn * 4));
  fill<<<1024, 256>>>((uint16_t*)q, qn, 1); fill<<<1024, 256>>>((uint16_t*)k, kn, 2);
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> hq(QSEG * HQ * D), hk(KSEG * D), rq(hq.size()), rk(hk.size());
  cudaDeviceProp prop{}; CK(cudaGetDeviceProperties(&prop, 0));
  std::string json = std::string("{\"device\": \"") + prop.name + "\", \"bytes\": " + std::to_string((long long)bytes) + ", \"rows\": [";
  bool first = true;
  // kind: "means" (checked against the library-like loop), "read" (no output).
  auto timeit = [&](const char* name, const char* kind, bool dirty, auto launch) {
    CK(cudaMemset(mq, 0, hq.size() * 4)); CK(cudaMemset(mk, 0, hk.size() * 4));
    launch(); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    bool same = true;
    if (std::string(kind) == "means") {
      CK(cudaMemcpy(hq.data(), mq, hq.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hk.data(), mk, hk.size() * 4, cudaMemcpyDeviceToHost));
      same = memcmp(hq.data(), rq.data(), hq.size() * 4) == 0 && memcmp(hk.data(), rk.data(), hk.size() * 4) == 0;
      if (!same) { printf("%s: means differ from the library-like loop\n", name); exit(2); }
    }
    std::vector<float> t;
    for (int rep = 0; rep < 30; ++rep) {
      if (dirty) scrub<<<1024, 256>>>(junk, jn);
      else scrub_read<<<1056, 256>>>((const float4*)junk, jn / 4, junk);
      CK(cudaEventRecord(e0)); launch(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms * 1000);
    }
    std::sort(t.begin(), t.end());
    printf("%-44s %-5s L2 %-5s median %6.2f us (%.2f TB/s), min %6.2f\n", name, kind, dirty ? "dirty" : "clean", t[15], bytes / t[15] / 1e6, t[0]);
    json += std::string(first ? "" : ", ") + "{\"variant\": \"" + name + "\", \"kind\": \"" + kind + "\", \"l2_before\": \"" +
            (dirty ? "dirty" : "clean") + "\", \"median_us\": " + std::to_string(t[15]) + ", \"min_us\": " + std::to_string(t[0]) +
            ", \"tb_per_s\": " + std::to_string(bytes / t[15] / 1e6) + "}";
    first = false;
  };
  const int v0_threads = (QSEG * HQ + KSEG) * 32;
  auto L0 = [&] { v0<<<v0_threads / 64, 64>>>(q, k, mq, mk); };
  L0(); CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(rq.data(), mq, rq.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rk.data(), mk, rk.size() * 4, cudaMemcpyDeviceToHost));
  for (bool dirty : {false, true}) {
    timeit("library-like R1 loop (warp per row, 8 B per lane)", "means", dirty, L0);
    for (int g : {264, 1056, 2112}) {
      const std::string name = "read only, 16 B loads, " + std::to_string(g) + " CTAs";
      timeit(name.c_str(), "read", dirty, [&] { readall<<<g, 256>>>((const uint4*)q, qn * 2 / 16, (const uint4*)k, kn * 2 / 16, junk); });
    }
  }
  const int items = QSEG * (QW / 16) + KSEG * (KW / 16);
  timeit("thread per 16 B column slice, 2 x 16 tokens", "means", false, [&] { v2<16><<<(items + 255) / 256, 256>>>(q, k, mq, mk); });
  // Shared memory against loads in flight: the same kernel with S bytes of unused dynamic shared memory
  // per CTA (the SM's unified L1 / shared array gives that much less to L1), at the CTAs per SM the
  // runtime reports; and with the preferred carveout at its maximum and no dynamic shared memory.
  for (int S : {0, 32 << 10, 64 << 10, 80 << 10, 100 << 10}) {
    auto kern = v2<16>;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 256, S));
    const std::string name = "slice loop, " + std::to_string(S >> 10) + " KB dyn smem (" + std::to_string(per_sm) + " CTA/SM)";
    timeit(name.c_str(), "means", false, [&] { kern<<<(items + 255) / 256, 256, S>>>(q, k, mq, mk); });
  }
  CK(cudaFuncSetAttribute(v2<16>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  timeit("slice loop, carveout 100 %", "means", false, [&] { v2<16><<<(items + 255) / 256, 256>>>(q, k, mq, mk); });
  CK(cudaFuncSetAttribute(v2<16>, cudaFuncAttributePreferredSharedMemoryCarveout, -1));
  auto bulk = [&](const char* name, auto kern, int W, int T, int S, int hsplit) {
    const int smem = T * W * S;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int qctas = QSEG * hsplit, kctas = KSEG / (W / KW);
    timeit(name, "means", false, [&] { kern<<<qctas + kctas, W / 16 + 32, smem>>>(q, k, mq, mk, hsplit, qctas); });
  };
  bulk("bulk ring, CTA per q tile (80 CTAs), 4 x 32 KB", v1<4096, 8, 4>, 4096, 8, 4, 1);
  bulk("bulk ring, CTA per q tile half (160), 6 x 16 KB", v1<2048, 8, 6>, 2048, 8, 6, 2);
  bulk("bulk ring, CTA per q tile quarter (320), 6 x 16 KB", v1<1024, 16, 6>, 1024, 16, 6, 4);
  json += "]}";
  if (argc > 1) {
    FILE* f = fopen(argv[1], "w");
    if (f == nullptr) { printf("cannot write %s\n", argv[1]); return 1; }
    fprintf(f, "%s\n", json.c_str());
    fclose(f);
  }
  return 0;
}
