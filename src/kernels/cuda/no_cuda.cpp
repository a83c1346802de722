// Stub for builds without CUDA.
#include "../../core/backends.h"
#include "ringflash/errors.h"

namespace ringflash::cuda {

bool is_available() { return false; }
std::string describe() { return "no (built without CUDA)"; }
std::string unsupported_reason(const core::AttentionArgs&) {
  return "CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)";
}

void attention_forward(const core::AttentionArgs&) {
  throw NotSupported("[attention_forward] CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)");
}
void attention_backward(const core::AttentionArgs&) {
  throw NotSupported("[attention_backward] CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)");
}

}  // namespace ringflash::cuda
