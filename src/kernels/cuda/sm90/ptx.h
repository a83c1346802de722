// Thin wrappers over the sm_90a instructions of the Hopper kernels: warpgroup MMA (wgmma) with
// shared-memory descriptors, the bulk tensor copy (TMA) completing on an mbarrier, the async-proxy
// fence and setmaxnreg. Built only for the sm_90a target (-gencode=arch=compute_90a,code=sm_90a).
//
// Shared-memory tiles are K-major with the 128-byte swizzle, the layout both TMA (CU_TENSOR_MAP_
// SWIZZLE_128B) and wgmma read: a tile of R rows x 64 16-bit elements (128 bytes a row) is R / 8
// atoms of 8 rows x 128 bytes (1024 bytes, 1024-aligned), the 16-byte chunks of row r permuted by
// (chunk ^ (r % 8)). A head dim of 128 or 256 is 2 or 4 such column blocks, one after another.
//
// wgmma m64nNk16 (a warpgroup of 4 warps, warp w owning rows 16w..16w+15):
//   D, N / 2 floats per thread: for each 8-column block j, d[4j..4j+3] hold (g, 8j + 2t),
//     (g, 8j + 2t + 1), (g + 8, 8j + 2t), (g + 8, 8j + 2t + 1) of the warp's 16 rows (lane = 4g + t),
//     the C fragment of mma.sync m16n8k16 per block.
//   A from registers: the A fragment of mma.sync m16n8k16 for the warp's 16 rows, so two adjacent
//     8-column blocks of D, rounded, are the A operand of the next product (P = softmax(S) for P V).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace ringflash::cuda::sm90 {

// ---- shared-memory matrix descriptors -------------------------------------------------------

// The descriptor of a K-major, 128-byte-swizzled operand whose first row starts at `smem` (a
// shared-memory address at a 1024-byte boundary, plus a multiple of 32 bytes to step along K
// inside the 128-byte row). Rows are 128 bytes apart; groups of 8 rows 1024 bytes apart (the
// stride byte offset). The leading byte offset is unused for swizzled K-major operands.
__device__ __forceinline__ uint64_t k_major_desc(uint32_t smem) {
  constexpr uint64_t kSwizzle128B = 1;
  return (static_cast<uint64_t>(smem & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (kSwizzle128B << 62);
}

// `desc` with its start address moved by `bytes` (a multiple of 16). The address is the low 14
// bits in 16-byte units, and no shared-memory address carries out of them, so one add of a
// constant steps a descriptor along its tile (instead of a new descriptor per product).
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// The descriptor of an MN-major (transposed, kTransB = 1), 128-byte-swizzled operand: N runs along
// the 128-byte rows (64 elements a block), K down the rows. 8-row groups along K are 1024 bytes
// apart (stride byte offset); 64-element blocks along N are `block_bytes` apart (leading byte
// offset).
__device__ __forceinline__ uint64_t mn_major_desc(uint32_t smem, uint32_t block_bytes) {
  constexpr uint64_t kSwizzle128B = 1;
  return (static_cast<uint64_t>(smem & 0x3FFFF) >> 4) | (static_cast<uint64_t>(block_bytes >> 4) << 16) |
         (uint64_t{1024 >> 4} << 32) | (kSwizzle128B << 62);
}

// ---- warpgroup MMA ------------------------------------------------------------------------

// Orders this thread's register accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Holds the computation of `x` ahead of the next wgmma wait. ptxas moves arithmetic across a wait
// as it likes (it sank the softmax's exponentials below the wait for P V, where they no longer
// overlap it) but keeps shared-memory accesses on their side: x is stored to a scratch word.
__device__ __forceinline__ void ahead_of_wait(uint32_t scratch, float x) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scratch), "f"(x) : "memory");
}
// Keeps the compiler from moving accesses of wgmma's register operands across a fence or a wait:
// call it on the accumulators (and register A operands) right before wgmma_fence() and right after
// wgmma_wait().
template <int N>
__device__ __forceinline__ void keep(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void keep(uint32_t (&a)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// wgmma m64nNk16 with fp32 accumulators and T (bf16 or fp16) operands; `accumulate` false
// overwrites D. kTransB = 1 reads B MN-major (mn_major_desc), 0 K-major (k_major_desc); kTransA
// likewise for an A in shared memory.
template <typename T, int N>
struct Wgmma;

// The accumulator operands of wgmma m64n32, m64n64, m64n128 and m64n256: the register list and
// its constraints.
#define RINGFLASH_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define RINGFLASH_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define RINGFLASH_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define RINGFLASH_WGMMA_D16_OPS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define RINGFLASH_WGMMA_D32_OPS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define RINGFLASH_WGMMA_D64_OPS(d) \
  RINGFLASH_WGMMA_D32_OPS(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define RINGFLASH_WGMMA_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define RINGFLASH_WGMMA_D128_OPS(d) \
  RINGFLASH_WGMMA_D64_OPS(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// Wgmma<T, N> for T spelled `type` in PTX, with accumulators D (RINGFLASH_WGMMA_D32, _D64 or _D128,
// and D##_OPS). The operands after the accumulators are numbered from N / 2: ss takes a, b, accumulate
// and the transposes; rs the four A registers, b, accumulate and trans-b.
#define RINGFLASH_WGMMA(T, N, type, D, a0, a1, a2, a3, a4, a5, a6)                                              \
  template <>                                                                                                  \
  struct Wgmma<T, N> {                                                                                         \
    static constexpr int kAccumulators = N / 2;                                                                \
    /* D (+)= A B, A and B in shared memory. */                                                                \
    template <int kTransA, int kTransB>                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b, bool accumulate) {    \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" a2 ", 0;\n"                                           \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." type "." type " " D ", %" a0 ", %" a1       \
                   ", p, 1, 1, %" a3 ", %" a4 ";\n}\n"                                                          \
                   : D##_OPS(d)                                                                                \
                   : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(kTransA), "n"(kTransB));            \
    }                                                                                                          \
    /* D (+)= A B, A in registers (the A fragment of mma.sync m16n8k16 for this warp's 16 rows), B in     */  \
    /* shared memory.                                                                                     */  \
    template <int kTransB>                                                                                     \
    static __device__ __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,            \
                                              bool accumulate) {                                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" a5 ", 0;\n"                                           \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." type "." type " " D ", {%" a0 ", %" a1      \
                   ", %" a2 ", %" a3 "}, %" a4 ", p, 1, 1, %" a6 ";\n}\n"                                        \
                   : D##_OPS(d)                                                                                \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)),     \
                     "n"(kTransB));                                                                            \
    }                                                                                                          \
  };

RINGFLASH_WGMMA(__nv_bfloat16, 32, "bf16", RINGFLASH_WGMMA_D16, "16", "17", "18", "19", "20", "21", "22")
RINGFLASH_WGMMA(__half, 32, "f16", RINGFLASH_WGMMA_D16, "16", "17", "18", "19", "20", "21", "22")
RINGFLASH_WGMMA(__nv_bfloat16, 64, "bf16", RINGFLASH_WGMMA_D32, "32", "33", "34", "35", "36", "37", "38")
RINGFLASH_WGMMA(__half, 64, "f16", RINGFLASH_WGMMA_D32, "32", "33", "34", "35", "36", "37", "38")
RINGFLASH_WGMMA(__nv_bfloat16, 128, "bf16", RINGFLASH_WGMMA_D64, "64", "65", "66", "67", "68", "69", "70")
RINGFLASH_WGMMA(__half, 128, "f16", RINGFLASH_WGMMA_D64, "64", "65", "66", "67", "68", "69", "70")
RINGFLASH_WGMMA(__nv_bfloat16, 256, "bf16", RINGFLASH_WGMMA_D128, "128", "129", "130", "131", "132", "133", "134")
RINGFLASH_WGMMA(__half, 256, "f16", RINGFLASH_WGMMA_D128, "128", "129", "130", "131", "132", "133", "134")

#undef RINGFLASH_WGMMA
#undef RINGFLASH_WGMMA_D16
#undef RINGFLASH_WGMMA_D32
#undef RINGFLASH_WGMMA_D64
#undef RINGFLASH_WGMMA_D128
#undef RINGFLASH_WGMMA_D16_OPS
#undef RINGFLASH_WGMMA_D32_OPS
#undef RINGFLASH_WGMMA_D64_OPS
#undef RINGFLASH_WGMMA_D128_OPS

// ---- mbarriers and the bulk tensor copy ----------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (the copy engine); then a block barrier.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Generic-proxy writes to shared memory (ordinary stores, stmatrix) before the async proxy (wgmma,
// TMA) reads them; each writing thread, before the block barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// One arrival that also expects `bytes` more to land by transaction (the TMA loads of a stage).
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the phase with parity `phase` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}

// A 4-D tile of the tensor map `map` (a __grid_constant__ kernel parameter) at coordinates
// (c0 innermost .. c3) into shared memory at `dst`, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}

// A 2-D tile of `map` at (c0 innermost, c1) into shared memory at `dst`, completing on `bar`. The
// tile's first element must lie at a 16-byte boundary.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// Adds a 4-D tile of fp32 in shared memory at `src` into the tensor map `map` at (c0 .. c3), by
// the copy engine (a bulk group: commit, then wait before `src` is written again).
__device__ __forceinline__ void tma_reduce_add_4d(const void* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src))
      : "memory");
}
// Stores a 4-D tile in shared memory at `src` to the tensor map `map` at (c0 .. c3), by the copy
// engine (a bulk group: commit, then wait for its reads before `src` is reused or the block exits).
__device__ __forceinline__ void tma_store_4d(const void* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src))
               : "memory");
}
// Starts fetching a tensor map (a kernel parameter) for the copy engine, ahead of its first use.
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Stores a 32-bit word at shared-memory address `smem`.
__device__ __forceinline__ void st_shared_b32(uint32_t smem, uint32_t x) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem), "r"(x) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the committed bulk groups have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until the committed bulk groups are complete.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Adds n to the counter at `count` once this thread's completed bulk writes (the copy engine's,
// by bulk_wait) and its own are visible on the GPU: a reader that sees the sum by
// ld.acquire.gpu sees them too.
__device__ __forceinline__ void count_done(int* count, int n) {
  asm volatile(
      "fence.proxy.async.global;\n"
      "red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(count),
      "r"(n)
      : "memory");
}

// Stores x, y at shared-memory address `smem` (8-byte aligned).
__device__ __forceinline__ void st_shared_v2(uint32_t smem, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(smem), "f"(x), "f"(y) : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on barrier `id` (counted among `threads`) without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- registers ----------------------------------------------------------------------------

// Moves this warpgroup's register budget to kRegs per thread (producers give registers up,
// consumers take them); the kernel needs a register cap at entry (__launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Whether a block of `threads` (a producer warpgroup, the rest consumers) can move to `producer`
// and `consumer` registers per thread. setmaxnreg.inc waits on a pool per block, which holds what
// the block launched with (65536 / threads per thread, in steps of 8): beyond it the consumers
// would wait forever.
constexpr bool fits_block_registers(int threads, int producer, int consumer) {
  return producer * 128 + consumer * (threads - 128) <= 65536 / threads / 8 * 8 * threads;
}
static_assert(fits_block_registers(384, 24, 240) && !fits_block_registers(384, 32, 240), "168 x 384 = 64512");
static_assert(fits_block_registers(512, 32, 160), "128 x 512 = 65536");

}  // namespace ringflash::cuda::sm90
