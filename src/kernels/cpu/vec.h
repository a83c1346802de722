// Vector arithmetic for the CPU kernels, on GCC/Clang vector extensions.
//
// The width follows the ISA the kernel files are compiled for (RINGFLASH_NATIVE adds
// -march=native): 16 floats with AVX-512, 8 with AVX, 4 otherwise. All kernel arithmetic is fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ringflash::cpu {

#if defined(__AVX512F__)
inline constexpr int kVecWidth = 16;
inline constexpr int kVecRegisters = 32;
inline constexpr const char* kIsaName = "avx512";
#elif defined(__AVX__)
inline constexpr int kVecWidth = 8;
inline constexpr int kVecRegisters = 16;
inline constexpr const char* kIsaName = "avx2";
#else
inline constexpr int kVecWidth = 4;
inline constexpr int kVecRegisters = 16;
inline constexpr const char* kIsaName = "sse";
#endif

typedef float Vec __attribute__((vector_size(kVecWidth * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kVecWidth * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
template <size_t... I>
inline Vec splat_impl(float x, std::index_sequence<I...>) {
  return Vec{((void)I, x)...};
}
// Every lane = x. (Written as a brace list: `Vec{} + x` would cost an add.)
inline Vec splat(float x) { return splat_impl(x, std::make_index_sequence<kVecWidth>{}); }
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kInf = __builtin_inff();

// 2^f for f in [-0.5, 0.5]: Taylor series of e^(f ln2) to degree 6, relative error below 2e-7.
inline Vec exp2_reduced(Vec f) {
  Vec p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  return p * f + 1.0f;
}

// 2^x. Exact 0 for x < -126 (including -inf), so masked scores contribute nothing.
inline Vec exp2(Vec x) {
#if defined(__AVX512F__)
  // n = round(x), f = x - n; vscalefps multiplies by 2^n and flushes to 0 below the normal
  // range. Clamping first keeps -inf from turning f into NaN.
  // (The zero-masked forms with a full mask avoid GCC's spurious uninitialised warnings.)
  constexpr __mmask16 kAll = 0xffff;
  const Vec xc = vmax(x, splat(-150.0f));
  const Vec n = reinterpret_cast<Vec>(
      _mm512_maskz_roundscale_ps(kAll, reinterpret_cast<__m512>(xc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const Vec p = exp2_reduced(xc - n);
  const Vec r = reinterpret_cast<Vec>(_mm512_maskz_scalef_ps(kAll, reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
  return x < -126.0f ? Vec{} : r;
#else
  // Round to nearest with the 1.5 * 2^23 trick: n = round(x), f = x - n in [-0.5, 0.5].
  constexpr float kRoundMagic = 12582912.0f;
  const Vec xc = vmax(x, splat(-127.0f));
  const Vec t = xc + kRoundMagic;
  const Vec n = t - kRoundMagic;
  const Vec p = exp2_reduced(xc - n);
  // t's low mantissa bits hold n; adding n << 23 to p's bits multiplies p by 2^n.
  const VecI ni = __builtin_bit_cast(VecI, t) - __builtin_bit_cast(VecI, splat(kRoundMagic));
  const Vec r = __builtin_bit_cast(Vec, __builtin_bit_cast(VecI, p) + (ni << 23));
  return x < -126.0f ? Vec{} : r;
#endif
}

// tanh(x) = 1 - 2 / (e^(2x) + 1), saturated where fp32 tanh is already +-1.
inline Vec tanh(Vec x) {
  constexpr float kSaturate = 9.0f;
  const Vec xc = vmax(splat(-kSaturate), x < kSaturate ? x : splat(kSaturate));
  const Vec e = exp2(xc * (2.0f * kLog2e));
  return 1.0f - 2.0f / (e + 1.0f);
}

// Storage types. Conversions to fp32 are exact; conversions from fp32 round to nearest even.
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((bits >> 16) | 0x40)};  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

// dst[0, n) = float(src[0, n)); dst[n, padded) = 0.
template <typename T>
inline void convert_row(const T* src, int64_t n, int64_t padded, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  for (int64_t i = n; i < padded; ++i) dst[i] = 0.0f;
}

// dst[0, n) = T(src[0, n)), or T(dst + src) when `add`.
template <typename T>
inline void store_row(const float* src, int64_t n, bool add, T* dst) {
  if (add) {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(dst[i]) + src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
  }
}

}  // namespace ringflash::cpu
