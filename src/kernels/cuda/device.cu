// CUDA backend entry points. The attention kernels themselves are not written yet: calls on CUDA
// tensors report NotSupported with that reason.
#include <cuda_runtime.h>

#include "../../core/backends.h"
#include "ringflash/errors.h"

namespace ringflash::cuda {

bool is_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string describe() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  return "compiled in (CUDA " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10) + "), " + std::to_string(count) + " device(s)";
}

std::string unsupported_reason(const core::AttentionArgs&) {
  if (!is_available()) return "no CUDA device is present";
  return "the CUDA attention kernels are not implemented yet";
}

void attention_forward(const core::AttentionArgs&) {
  throw NotSupported("[attention_forward] the CUDA attention kernels are not implemented yet");
}
void attention_backward(const core::AttentionArgs&) {
  throw NotSupported("[attention_backward] the CUDA attention kernels are not implemented yet");
}

}  // namespace ringflash::cuda
