// Error checks. Every message names the op and the argument, and says what was expected and
// what came: "[attention_forward] q must have 4 dimensions (B, S, H, D), got (2, 4096, 32)".
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "ringflash/errors.h"

namespace ringflash::core {

template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream s;
  (s << ... << std::forward<Args>(args));
  return s.str();
}

}  // namespace ringflash::core

// Throws `ErrorType` (one of ringflash's error types) with the concatenated message when `cond`
// is false. Later backends (CUDA, NCCL, MPI) build their status checks on this one macro.
#define RINGFLASH_CHECK(cond, ErrorType, ...)                          \
  do {                                                                 \
    if (!(cond)) throw ::ringflash::ErrorType(::ringflash::core::str_cat(__VA_ARGS__)); \
  } while (0)
