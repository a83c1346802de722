// CUDA backend entry points: the choice of kernel (one function behind dispatch and
// unsupported_reason), the derived constants, the workspace and the device guard.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "../../core/backends.h"
#include "check.h"
#include "instances.h"
#include "params.h"
#include "ringflash/errors.h"
#include "scratch.h"

namespace ringflash::cuda {
namespace {

using core::AttentionArgs;
using ringflash::DType;
using core::str_cat;

#ifdef RINGFLASH_DISABLE_BACKWARD
#define RINGFLASH_BACKWARD_OR_NULL(...) nullptr
#else
#define RINGFLASH_BACKWARD_OR_NULL(...) __VA_ARGS__
#endif

using ForwardFn = void (*)(const Params&, cudaStream_t);
using BackwardFn = void (*)(const Params&, int64_t, cudaStream_t);

struct Kernels {
  ForwardFn forward = nullptr;
  BackwardFn backward = nullptr;
  bool backward_writes_dq = false;  // dQ by query tiles: no fp32 accumulator
};

// Kernels are built for head dims 64, 128 and 256; a smaller head dim (a multiple of 8) runs on
// the next one up, its missing columns zero-filled in shared memory and never written.
constexpr int kHeadDimStep = 8;
constexpr int kMaxHeadDim = 256;

int instance_head_dim(int64_t head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

template <typename T>
Kernels kernels_for(int64_t head_dim) {
  switch (instance_head_dim(head_dim)) {
#ifndef RINGFLASH_DISABLE_HDIM64
    case 64:
      return {run_forward<T, 64>, RINGFLASH_BACKWARD_OR_NULL(run_backward<T, 64>)};
#endif
#ifndef RINGFLASH_DISABLE_HDIM128
    case 128:
      return {run_forward<T, 128>, RINGFLASH_BACKWARD_OR_NULL(run_backward<T, 128>)};
#endif
#ifndef RINGFLASH_DISABLE_HDIM256
    case 256:
      return {run_forward<T, 256>, RINGFLASH_BACKWARD_OR_NULL(run_backward<T, 256>)};
#endif
    default:
      return {};
  }
}

// The compute capability of `device`, as 10 * major + minor.
int compute_capability(int device) {
  int major = 0, minor = 0;
  RINGFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  RINGFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

#ifdef RINGFLASH_SM90
// The sm_90a kernels run a case on a device of compute capability 9.0 unless hopper_gap() says why
// not; RINGFLASH_SM90=0 in the environment turns them off (for comparisons).
bool hopper(int capability) {
  static const bool off = [] {
    const char* v = std::getenv("RINGFLASH_SM90");
    return v && std::string(v) == "0";
  }();
  return !off && capability == 90;
}

// Why the sm_90a kernels do not run this case (the forward, or the backward when `backward`), or
// "" when they do.
std::string hopper_gap(const AttentionArgs& a, bool backward) {
  if (a.rows_q == 0 || a.rows_k == 0) return "they take no empty q or k";  // a tensor map has no empty dimension
  for (auto [o, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}})
    if (o->head_stride > o->row_stride)
      return str_cat("they read ", name, " by TMA, which needs its heads inside its rows (head stride ",
                     o->head_stride, " > row stride ", o->row_stride, ")");
  if (backward && a.dout.head_stride > a.dout.row_stride)
    return str_cat("they read dout by TMA, which needs its heads inside its rows (head stride ", a.dout.head_stride,
                   " > row stride ", a.dout.row_stride, ")");
  // At head dim 256 the sm_90a backward adds nothing into memory (dQ has its own kernel), so it is
  // deterministic as it is; below, it adds dQ by TMA reduce-adds, in no fixed order.
  if (backward && a.deterministic && instance_head_dim(a.head_dim) != 256)
    return "the deterministic backward below head dim 256 is the sm_80 one";
  return "";
}

// The sm_90a kernels of a head dim that hopper_gap() accepts (built where the sm_80 ones are).
template <typename T>
Kernels hopper_kernels(int64_t head_dim) {
  switch (instance_head_dim(head_dim)) {
#ifndef RINGFLASH_DISABLE_HDIM64
    case 64:
      return {sm90::run_forward<T, 64>, RINGFLASH_BACKWARD_OR_NULL(sm90::run_backward<T, 64>)};
#endif
#ifndef RINGFLASH_DISABLE_HDIM128
    case 128:
      return {sm90::run_forward<T, 128>, RINGFLASH_BACKWARD_OR_NULL(sm90::run_backward<T, 128>)};
#endif
#ifndef RINGFLASH_DISABLE_HDIM256
    case 256:
      return {sm90::run_forward<T, 256>, RINGFLASH_BACKWARD_OR_NULL(sm90::run_backward<T, 256>), true};
#endif
    default:
      return {};
  }
}
#endif

std::string built_head_dims() {
  std::string dims;
  for (int d : {64, 128, 256})
    if (kernels_for<__nv_bfloat16>(d).forward) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  return dims.empty() ? "none" : dims;
}

constexpr int64_t kMaxGridYZ = 65535;
constexpr int kVectorBytes = 16;

bool aligned(const AttentionArgs::Operand& o, int element_bytes) {
  const auto ok = [&](int64_t stride) { return stride * element_bytes % kVectorBytes == 0; };
  return reinterpret_cast<uintptr_t>(o.data) % kVectorBytes == 0 && ok(o.batch_stride) && ok(o.row_stride) &&
         ok(o.head_stride);
}

int bytes_of(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Why the kernels cannot run this case ("" when they can); otherwise the kernels that run it and
// the tensors' device.
std::string choose(const AttentionArgs& a, bool backward, Kernels* chosen, int* device_out) {
  if (!is_available()) return "no CUDA device is present";
  if (a.dtype != DType::kFloat16 && a.dtype != DType::kBFloat16)
    return "the CUDA kernels take float16 or bfloat16 inputs";
  if (a.head_dim % kHeadDimStep != 0 || a.head_dim > kMaxHeadDim)
    return str_cat("the CUDA kernels take head_dim a multiple of ", kHeadDimStep, " up to ", kMaxHeadDim, ", got ",
                   a.head_dim);
  const Kernels k = a.dtype == DType::kFloat16 ? kernels_for<__half>(a.head_dim) : kernels_for<__nv_bfloat16>(a.head_dim);
  if (!k.forward)
    return str_cat("head_dim ", a.head_dim, " needs the head-dim ", instance_head_dim(a.head_dim),
                   " CUDA kernels, which this build leaves out (built: ", built_head_dims(), ")");
  if (backward && !k.backward) return "this build has no CUDA backward kernels (RINGFLASH_DISABLE_BACKWARD)";
  // The tensors' device, not a pointer query: memory that a CUDA graph allocates during capture
  // has no attributes until the graph runs.
  const int device = a.device;
  const int capability = device >= 0 ? compute_capability(device) : 0;
  if (device >= 0 && capability < 80)
    return str_cat("the CUDA kernels need compute capability 8.0 or newer, device ", device, " has ", capability / 10,
                   ".", capability % 10);
  if (a.heads_q > kMaxGridYZ || a.batch > kMaxGridYZ)
    return str_cat("the CUDA kernels take at most ", kMaxGridYZ, " heads and sequences, got ", a.heads_q, " heads and ",
                   a.batch, " sequences");
  const int in_bytes = bytes_of(a.dtype);
  for (auto [o, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}})
    if (o->data && !aligned(*o, in_bytes))
      return str_cat(name, " must be 16-byte aligned with strides of whole 16-byte units for the CUDA kernels");
  *chosen = k;
#ifdef RINGFLASH_SM90
  if (hopper(capability)) {
    const Kernels h = a.dtype == DType::kFloat16 ? hopper_kernels<__half>(a.head_dim)
                                                 : hopper_kernels<__nv_bfloat16>(a.head_dim);
    if (h.forward && hopper_gap(a, false).empty()) chosen->forward = h.forward;
    if (h.backward && backward && hopper_gap(a, true).empty()) {
      chosen->backward = h.backward;
      chosen->backward_writes_dq = h.backward_writes_dq;
    }
  }
#endif
  *device_out = device;
  return "";
}

Params make_params(const AttentionArgs& a) {
  Params p;
  p.a = a;
  p.group = static_cast<int>(a.heads_q / a.heads_kv);
  const bool packed = a.cu_seqlens_q != nullptr;
  p.max_rows_q = packed ? a.rows_q : a.seqlen_q;
  p.max_rows_k = packed ? a.rows_k : a.seqlen_k;
  const bool softcap = a.softcap > 0.0f;
  p.qk_scale = softcap ? a.scale / a.softcap : a.scale * kLog2e;
  p.softcap_log2 = softcap ? a.softcap * kLog2e : 0.0f;
  p.softmax_scale = a.scale;
  return p;
}

void check_aligned(const char* op, std::initializer_list<std::pair<const AttentionArgs::Operand*, const char*>> list,
                   DType dtype) {
  for (auto [o, name] : list)
    RINGFLASH_CHECK(!o->data || aligned(*o, bytes_of(dtype)), NotSupported, "[", op, "] ", name,
                    " must be 16-byte aligned with strides of whole 16-byte units for the CUDA kernels");
}

}  // namespace

bool is_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string describe() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  return "compiled in (CUDA " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10) + "; head dims " + built_head_dims() + "), " +
         std::to_string(count) + " device(s)";
}

std::string unsupported_reason(const AttentionArgs& args) {
  Kernels k;
  int device = -1;
  return choose(args, false, &k, &device);
}

std::string kernels_used(const AttentionArgs& args) {
#ifdef RINGFLASH_SM90
  if (args.device < 0 || !hopper(compute_capability(args.device))) return "sm80";
  const std::string forward = hopper_gap(args, false), backward = hopper_gap(args, true);
  if (!forward.empty()) return "sm80 (the sm_90a kernels do not run this case: " + forward + ")";
  if (!backward.empty()) return "sm90 forward, sm80 backward (" + backward + ")";
  return "sm90";
#else
  (void)args;
  return "sm80";
#endif
}

void attention_forward(const AttentionArgs& args) {
  Kernels k;
  int device = -1;
  const std::string reason = choose(args, false, &k, &device);
  RINGFLASH_CHECK(reason.empty(), NotSupported, "[attention_forward] ", reason);
  check_aligned("attention_forward", {{&args.out, "out"}}, args.out_dtype);
  DeviceGuard guard(device);
  const Params p = make_params(args);
  k.forward(p, static_cast<cudaStream_t>(args.stream));
}

void attention_backward(const AttentionArgs& args) {
  Kernels k;
  int device = -1;
  const std::string reason = choose(args, true, &k, &device);
  RINGFLASH_CHECK(reason.empty(), NotSupported, "[attention_backward] ", reason);
  check_aligned("attention_backward", {{&args.out, "out"}}, args.out_dtype);
  check_aligned("attention_backward", {{&args.dout, "dout"}}, args.dtype);
  check_aligned("attention_backward", {{&args.dq, "dq"}, {&args.dk, "dk"}, {&args.dv, "dv"}}, args.grad_dtype);
  DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(args.stream);
  Params p = make_params(args);

  // Workspace: dsum and lse2 (rows x heads each) and, unless dq itself is fp32 or dQ is computed
  // per query tile, the fp32 dq accumulator (rows x heads x head_dim). From ringflash's pool, which
  // keeps its memory between calls (the default pool gives it back at every synchronisation, and
  // the next call maps it again); stream-ordered, so graph capture works.
  const bool packed = args.cu_seqlens_q != nullptr;
  const int64_t total_rows = packed ? args.rows_q : args.batch * args.rows_q;
  // Each array starts at a 128-byte boundary: the conversion pass reads dq_accum in 16-byte vectors.
  constexpr int64_t kAlignFloats = 32;
  // Each (sequence, head) has stat_rows entries, a multiple of 4: the sm_90a backward reads them by
  // TMA, whose copies start at 16-byte boundaries.
  const int64_t stat_rows = (args.rows_q + 3) / 4 * 4;
  const int64_t stat_elements =
      ((packed ? 1 : args.batch) * args.heads_q * stat_rows + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
  const bool dq_buffer = !args.accumulate && !args.deterministic && !k.backward_writes_dq;
  const int64_t dq_elements = dq_buffer ? stat_elements * args.head_dim : 0;
  // dq_done's counters after the accumulator.
  const int64_t done_counts = dq_buffer ? (packed ? 1 : args.batch) * args.heads_kv : 0;
  const size_t workspace_bytes = (2 * stat_elements + dq_elements) * sizeof(float) + done_counts * sizeof(int);
  const Scratch workspace(device, workspace_bytes, args.stream);
  p.dsum = static_cast<float*>(workspace.data);
  p.lse2 = p.dsum + stat_elements;
  p.stat_batch_stride = packed ? 0 : args.heads_q * stat_rows;
  p.stat_head_stride = stat_rows;
  if (dq_buffer) {
    p.dq_accum = p.lse2 + stat_elements;
    p.dq_accum_batch_stride = packed ? 0 : args.rows_q * args.heads_q * args.head_dim;
    p.dq_accum_row_stride = args.heads_q * args.head_dim;
    p.dq_accum_head_stride = args.head_dim;
    p.dq_done = reinterpret_cast<int*>(p.dq_accum + dq_elements);
  } else if (p.dq_in_place()) {
    p.dq_accum = static_cast<float*>(args.dq.data);
    p.dq_accum_batch_stride = args.dq.batch_stride;
    p.dq_accum_row_stride = args.dq.row_stride;
    p.dq_accum_head_stride = args.dq.head_stride;
  }
  k.backward(p, total_rows, stream);  // its dsum pass zeroes the accumulator's rows and the counts
}

}  // namespace ringflash::cuda
