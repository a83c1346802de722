// ringflash error types.
//
// Every failure the library reports is one of the four types below. Messages name the op, the
// argument, what was expected and what came, e.g.
//   "[flash_attn] q must have shape (B, S, H, D), got (2, 4096, 32)".
// The library never calls exit() or abort().
#pragma once

#include <stdexcept>
#include <string>

namespace ringflash {

// Base of every ringflash error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed a tensor or option that is wrong: shape, dtype, device, stride, value.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The input is valid, but this build or backend does not implement the case.
class NotSupported : public Error {
 public:
  using Error::Error;
};

// A device runtime (CUDA) reported an error.
class DeviceError : public Error {
 public:
  using Error::Error;
};

// A transport failed: a peer died, a deadline passed, or the transport library reported an error.
class CommError : public Error {
 public:
  using Error::Error;
};

}  // namespace ringflash
