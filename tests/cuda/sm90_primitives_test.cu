// The sm_90a primitives of src/kernels/cuda/sm90/ptx.h against a host reference, on one H100 or
// H200: TMA loads of 128-byte-swizzled tiles completing on an mbarrier, then
//   S = Q K^T  with wgmma m64n128k16, both operands K-major from shared memory (the QK^T product);
//   O = P V    with wgmma m64n128k16, P from registers and V MN-major (transposed) from shared
//              memory (the PV product).
// Build and run (CUDA 13, on the GPU machine):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc tests/cuda/sm90_primitives_test.cu \
//     -o /tmp/sm90_test && /tmp/sm90_test
// Exit status 0 when every product matches.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/sm90/ptx.h"

namespace {

using bf16 = __nv_bfloat16;
using namespace ringflash::cuda::sm90;

constexpr int kM = 64, kN = 128, kD = 128;  // queries, keys, head dim
constexpr int kBlockCols = 64;              // elements in one 128-byte swizzled row

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

// A (rows x kD) row-major bf16 matrix as a 4-D tensor map (kD, rows, 1, 1) with boxes of
// 64 x rows and the 128-byte swizzle.
CUtensorMap tile_map(const bf16* data, int rows) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || !fn) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(2);
  }
  CUtensorMap map{};
  const cuuint64_t dims[4] = {kD, static_cast<cuuint64_t>(rows), 1, 1};
  const cuuint64_t strides[3] = {kD * sizeof(bf16), rows * kD * sizeof(bf16), rows * kD * sizeof(bf16)};
  const cuuint32_t box[4] = {kBlockCols, static_cast<cuuint32_t>(rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult rc = reinterpret_cast<Encode>(fn)(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<bf16*>(data), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(rc));
    std::exit(2);
  }
  return map;
}

__device__ unsigned char* align1024(unsigned char* p) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(p) + 1023) & ~uintptr_t{1023});
}

// Loads a (rows x kD) tile as kD / 64 column blocks of rows x 128 bytes, one after another.
__device__ void load_tile(bf16* dst, const CUtensorMap* map, uint64_t* bar, int rows) {
  for (int block = 0; block < kD / kBlockCols; ++block)
    tma_load_4d(dst + block * rows * kBlockCols, map, bar, block * kBlockCols, 0, 0, 0);
}

// Writes this thread's accumulators (m64n128 layout) to out (kM x kN row-major, fp32).
__device__ void store_d(float* out, const float (&d)[64]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < kN / 8; ++j)
    for (int i = 0; i < 4; ++i) out[(16 * warp + g + 8 * (i / 2)) * kN + 8 * j + 2 * t + i % 2] = d[4 * j + i];
}

// S = Q K^T.
__global__ void __launch_bounds__(128, 1) qk_kernel(const __grid_constant__ CUtensorMap q_map,
                                                    const __grid_constant__ CUtensorMap k_map, float* s) {
  extern __shared__ unsigned char raw[];
  unsigned char* smem = align1024(raw);
  bf16* sq = reinterpret_cast<bf16*>(smem);  // 2 blocks of 64 x 64
  bf16* sk = sq + kM * kD;                    // 2 blocks of 128 x 64
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect(&bar, (kM + kN) * kD * sizeof(bf16));
    load_tile(sq, &q_map, &bar, kM);
    load_tile(sk, &k_map, &bar, kN);
  }
  mbarrier_wait(&bar, 0);
  float d[64] = {};
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const int block = ks / 4, step = ks % 4;  // 4 k-steps of 32 bytes in a 128-byte row
    const uint64_t a = k_major_desc(smem_u32(sq + block * kM * kBlockCols) + step * 32);
    const uint64_t b = k_major_desc(smem_u32(sk + block * kN * kBlockCols) + step * 32);
    Wgmma<bf16, 128>::ss<0, 0>(d, a, b, ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  keep(d);
  store_d(s, d);
}

// O = P V, P (kM x kN) read from global memory into A fragments; V (kN keys x kD) MN-major.
__global__ void __launch_bounds__(128, 1) pv_kernel(const float* p, const __grid_constant__ CUtensorMap v_map,
                                                    float* o) {
  extern __shared__ unsigned char raw[];
  bf16* sv = reinterpret_cast<bf16*>(align1024(raw));  // 2 column blocks of 128 keys x 64
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect(&bar, kN * kD * sizeof(bf16));
    load_tile(sv, &v_map, &bar, kN);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t a[kN / 16][4];
  for (int ks = 0; ks < kN / 16; ++ks)
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * warp + g + 8 * (r % 2), col = 16 * ks + 2 * t + 8 * (r / 2);
      const __nv_bfloat162 pair = __floats2bfloat162_rn(p[row * kN + col], p[row * kN + col + 1]);
      a[ks][r] = *reinterpret_cast<const uint32_t*>(&pair);
    }
  mbarrier_wait(&bar, 0);
  float d[64] = {};
  wgmma_fence();
  const uint32_t block_bytes = kN * kBlockCols * sizeof(bf16);
#pragma unroll
  for (int ks = 0; ks < kN / 16; ++ks) {
    const uint32_t start = smem_u32(sv) + ks * 16 * 128;  // 16 keys = two 8-row atoms
    Wgmma<bf16, 128>::rs<1>(d, a[ks], mn_major_desc(start, block_bytes), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  keep(d);
  store_d(o, d);
}

float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// max |got - want| / max |want|.
double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff = std::fmax(diff, std::fabs(got[i] - want[i]));
    scale = std::fmax(scale, std::fabs(want[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace

int main() {
  std::vector<bf16> q(kM * kD), k(kN * kD), v(kN * kD);
  std::vector<float> p(kM * kN);
  unsigned state = 12345;
  const auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
  };
  for (auto& x : q) x = __float2bfloat16_rn(next());
  for (auto& x : k) x = __float2bfloat16_rn(next());
  for (auto& x : v) x = __float2bfloat16_rn(next());
  for (auto& x : p) x = bf16_round(next());

  bf16 *dq, *dk, *dv;
  float *dp, *ds, *dout;
  CHECK_CUDA(cudaMalloc(&dq, q.size() * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&dk, k.size() * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&dv, v.size() * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&dp, p.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&ds, kM * kN * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, kM * kD * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp, p.data(), p.size() * sizeof(float), cudaMemcpyHostToDevice));

  const int qk_smem = (kM + kN) * kD * sizeof(bf16) + 1024, pv_smem = kN * kD * sizeof(bf16) + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(qk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, qk_smem));
  CHECK_CUDA(cudaFuncSetAttribute(pv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pv_smem));
  const CUtensorMap q_map = tile_map(dq, kM), k_map = tile_map(dk, kN), v_map = tile_map(dv, kN);

  int failures = 0;
  qk_kernel<<<1, 128, qk_smem>>>(q_map, k_map, ds);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> s(kM * kN);
  CHECK_CUDA(cudaMemcpy(s.data(), ds, s.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<double> s_ref(kM * kN, 0.0);
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN; ++j)
      for (int c = 0; c < kD; ++c)
        s_ref[i * kN + j] += double(__bfloat162float(q[i * kD + c])) * __bfloat162float(k[j * kD + c]);
  const double s_err = rel_error(s, s_ref);
  std::printf("S = Q K^T (SS, K-major, 128B swizzle): rel error %.2e %s\n", s_err, s_err < 1e-4 ? "ok" : "WRONG");
  failures += s_err >= 1e-4;

  std::vector<double> o_ref(kM * kD, 0.0);
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN; ++j)
      for (int c = 0; c < kD; ++c) o_ref[i * kD + c] += double(p[i * kN + j]) * __bfloat162float(v[j * kD + c]);
  pv_kernel<<<1, 128, pv_smem>>>(dp, v_map, dout);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> o(kM * kD);
  CHECK_CUDA(cudaMemcpy(o.data(), dout, o.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const double o_err = rel_error(o, o_ref);
  std::printf("O = P V (RS, V MN-major): rel error %.2e %s\n", o_err, o_err < 1e-4 ? "ok" : "WRONG");
  failures += o_err >= 1e-4;
  return failures ? 1 : 0;
}
