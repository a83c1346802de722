// fp16 and bf16 <-> float conversions for the tests, and rounding of a value to a test dtype.
//
// The library has no public half type, so the tests carry their own: bit-exact IEEE binary16 and
// bfloat16 with round-to-nearest-even, subnormals, infinities and NaN. No gtest here: the
// benchmarks may include it too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ringflash/tensor.h"

namespace ringflash::test {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float -> IEEE binary16, round to nearest even.
inline uint16_t float_to_half(float f) {
  constexpr uint32_t kAbsMask = 0x7fffffffu;
  constexpr uint32_t kFloatInf = 0x7f800000u;
  constexpr uint32_t kHalfOverflow = 0x477ff000u;  // 65520: ties to even round up to infinity
  constexpr uint32_t kHalfMinNormal = 0x38800000u;  // 2^-14
  constexpr uint32_t kExponentRebias = (127u - 15u) << 23;
  constexpr float kSubnormalScale = 16777216.0f;  // 2^24: one half subnormal step is 2^-24
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & kAbsMask;
  if (abs > kFloatInf) return sign | 0x7e00u;  // quiet NaN
  if (abs >= kHalfOverflow) return sign | 0x7c00u;
  if (abs < kHalfMinNormal)  // subnormal or zero; the product is exact, nearbyint rounds to even
    return sign | static_cast<uint16_t>(std::nearbyint(bits_float(abs) * kSubnormalScale));
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round the 13 dropped bits to even
  return sign | static_cast<uint16_t>((rounded - kExponentRebias) >> 13);
}

// IEEE binary16 -> float (exact).
inline float half_to_float(uint16_t h) {
  constexpr float kSubnormalStep = 5.9604644775390625e-08f;  // 2^-24
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float f = static_cast<float>(mantissa) * kSubnormalStep;
    return sign ? -f : f;
  }
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> bfloat16, round to nearest even.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// bfloat16 -> float (exact).
inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// `x` rounded to `dtype` and back, as a double. Through float first: the double rounding this
// can cause (about once in 2^29 values) is far below any tolerance used here.
inline double round_to(DType dtype, double x) {
  const float f = static_cast<float>(x);
  switch (dtype) {
    case DType::kFloat16: return half_to_float(float_to_half(f));
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(f));
    case DType::kFloat64: return x;
    default: return f;
  }
}

// Float-valued element `i` of a buffer of `dtype` (fp32, fp16, bf16 or fp64).
inline double load_element(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat64: return static_cast<const double*>(data)[i];
    case DType::kInt32: return static_cast<const int32_t*>(data)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

// Stores `x`, rounded to nearest even, as element `i` of a buffer of `dtype`.
inline void store_element(void* data, DType dtype, int64_t i, double x) {
  switch (dtype) {
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = float_to_half(static_cast<float>(x)); break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(x)); break;
    case DType::kFloat64: static_cast<double*>(data)[i] = x; break;
    case DType::kInt32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(x); break;
    case DType::kInt64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(x); break;
    default: static_cast<float*>(data)[i] = static_cast<float>(x); break;
  }
}

}  // namespace ringflash::test
