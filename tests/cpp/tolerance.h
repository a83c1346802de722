// The one tolerance table and the pass rule (DESIGN.md, "Tests").
//
// A kernel result passes when its max-abs error against the float64 reference is at most
//   2 x (max-abs error of naive attention computed in the test dtype) + the absolute term below.
// The absolute term only matters where the naive computation happens to be (nearly) exact, e.g.
// one visible key. Beyond that rule, masking must be exact: a row that sees no key has out = 0,
// lse = -inf and dq = 0 exactly, a key no row sees has dk = dv = 0 exactly, and nothing may be NaN. No gtest here, so the benchmarks can use it too.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "ringflash/tensor.h"

namespace ringflash::test {

// Which quantity is being checked; each has its own column.
enum class Quantity { kOut, kLse, kGrad };

struct Tolerance {
  double out;   // forward output
  double lse;   // log-sum-exp (fp32 for every dtype)
  double grad;  // dq, dk, dv
};

// Absolute terms, by the dtype of q, k and v. The Python tests read these lines too
// (tests/python/reference.py), so keep each case on one line of this form.
inline Tolerance tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return {2e-4, 1e-5, 2e-4};
    case DType::kBFloat16: return {2e-3, 1e-5, 2e-3};
    default: return {1e-5, 1e-5, 2e-5};
  }
}

inline double absolute_term(DType dtype, Quantity what) {
  const Tolerance t = tolerance(dtype);
  return what == Quantity::kOut ? t.out : what == Quantity::kLse ? t.lse : t.grad;
}

struct CheckResult {
  bool ok = true;
  double error = 0;        // max-abs error of the result
  double naive_error = 0;  // max-abs error of naive attention in the test dtype
  double tolerance = 0;
  std::string message;     // empty when ok
};

// Applies the pass rule to `got` against the float64 reference `want`, with `naive` the naive
// in-dtype result. Elements where `masked` is true (a row that sees no key, a key no row sees)
// must equal `want` (0, or -inf for lse) exactly. `where(e)` names flat element e, e.g.
// "(b=1, i=5, h=2, d=7)".
inline CheckResult check_pass_rule(const std::string& name, const std::vector<double>& got,
                                   const std::vector<double>& want, const std::vector<double>& naive,
                                   const std::vector<bool>& masked, DType dtype, Quantity what,
                                   const std::function<std::string(size_t)>& where) {
  CheckResult r;
  std::ostringstream msg;
  msg.precision(9);
  if (got.size() != want.size() || naive.size() != want.size() || masked.size() != want.size()) {
    r.ok = false;
    msg << name << ": " << got.size() << " elements, reference has " << want.size();
    r.message = msg.str();
    return r;
  }
  size_t worst = 0, exact_fail = 0, exact_failures = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    const double w = want[e], g = got[e];
    if (masked[e]) {
      if (!(g == w)) {
        if (exact_failures++ == 0) exact_fail = e;
      }
      continue;
    }
    const double err = std::isnan(g) || std::isinf(g) ? INFINITY : std::fabs(g - w);
    if (err > r.error) {
      r.error = err;
      worst = e;
    }
    r.naive_error = std::fmax(r.naive_error, std::fabs(naive[e] - w));
  }
  r.tolerance = 2.0 * r.naive_error + absolute_term(dtype, what);
  if (exact_failures) {
    r.ok = false;
    msg << name << ": " << exact_failures << " element(s) must be exactly " << want[exact_fail]
        << " (masked), first at " << where(exact_fail) << ", got " << got[exact_fail] << "\n";
  }
  if (!(r.error <= r.tolerance)) {
    r.ok = false;
    msg << name << ": max error " << r.error << " at " << where(worst) << " (got " << got[worst] << ", want "
        << want[worst] << ") exceeds tolerance " << r.tolerance << " = 2 x naive " << dtype_name(dtype)
        << " error " << r.naive_error << " + " << absolute_term(dtype, what) << "\n";
  }
  r.message = msg.str();
  return r;
}

}  // namespace ringflash::test
