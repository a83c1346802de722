// The float64 and naive references (reference.h), instantiated out of line for the kernel tests.
//
// CMake compiles this one file without sanitizers: the reference is the oracle, not the code under
// test, and instrumented it takes nine tenths of a sanitizer run. The library, the harness and the
// reference's own tests (test_reference.cpp) stay instrumented.
#include "harness.h"

namespace ringflash::test {

RefForward oracle_forward(const RefOptions& o, const RefSequence& s, const Precision& p) {
  return reference_forward(o, s, p);
}

RefGrads oracle_backward(const RefOptions& o, const RefSequence& s, const std::vector<double>& out,
                         const std::vector<double>& lse, const Precision& p) {
  return reference_backward(o, s, out, lse, p);
}

}  // namespace ringflash::test
