// Stub for builds without CUDA.
#include "../../core/backends.h"
#include "ringflash/errors.h"

namespace ringflash::cuda {

bool is_available() { return false; }
std::string describe() { return "no (built without CUDA)"; }
std::string unsupported_reason(const core::AttentionArgs&) {
  return "CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)";
}

std::string kernels_used(const core::AttentionArgs&) { return ""; }

void attention_forward(const core::AttentionArgs&) {
  throw NotSupported("[attention_forward] CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)");
}
void attention_backward(const core::AttentionArgs&) {
  throw NotSupported("[attention_backward] CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)");
}

namespace {
[[noreturn]] void no_cuda(const char* op) {
  throw NotSupported(std::string("[") + op + "] CUDA tensors need a build with CUDA (RINGFLASH_CUDA=ON)");
}
}  // namespace

void elementwise(const core::ElementwiseArgs&) { no_cuda("elementwise"); }
void upload(const void*, size_t, void*, int, void*) { no_cuda("upload"); }
bool capturing(int, void*) { return false; }
void* allocate(int, size_t, void*) { no_cuda("Workspace"); }
void release(int, void*, void*) noexcept {}
void release_unused() {}

}  // namespace ringflash::cuda
