// Scratch memory of one call, from allocate() (ringflash's pool) and released stream-ordered when
// the call returns or throws, so that graph capture works.
#pragma once

#include <cstddef>

#include "../../core/backends.h"

namespace ringflash::cuda {

struct Scratch {
  int device;
  void* stream;
  void* data = nullptr;
  Scratch(int device, size_t bytes, void* stream) : device(device), stream(stream) {
    if (bytes > 0) data = allocate(device, bytes, stream);
  }
  ~Scratch() {
    if (data) release(device, data, stream);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

}  // namespace ringflash::cuda
