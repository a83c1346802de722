// Vector arithmetic for the CPU kernels, on GCC/Clang vector extensions.
//
// The width follows the ISA the kernel files are compiled for (RINGFLASH_NATIVE adds
// -march=native): 16 floats with AVX-512, 8 with AVX, 4 otherwise. All kernel arithmetic is fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
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

// 2^f for f in [-0.5, 0.5]: a degree-5 minimax polynomial, relative error below 2.4e-7 when
// evaluated in fp32 (about 2 ulp).
inline Vec exp2_reduced(Vec f) {
  Vec p = splat(1.3276471e-3f);
  p = p * f + 9.6755419e-3f;
  p = p * f + 5.5507135e-2f;
  p = p * f + 2.4022120e-1f;
  p = p * f + 6.9314694e-1f;
  return p * f + 1.0000001f;
}

// 2^x for x <= 127 or -inf (never NaN). Exactly 0 for x < -125, so masked scores contribute
// nothing and no result is denormal (what is dropped is below 2^-125 of a row's largest term).
inline Vec exp2(Vec x) {
#if defined(__AVX512F__)
  // n = round(x), f = x - n; vscalefps multiplies by 2^n. The zero mask replaces every lane
  // below -125, which also covers the NaN that x = -inf leaves in f.
  const __mmask16 normal = _mm512_cmp_ps_mask(reinterpret_cast<__m512>(x), _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  constexpr __mmask16 kAll = 0xffff;  // (zero-masked forms avoid GCC's spurious uninitialised warnings)
  const Vec n = reinterpret_cast<Vec>(
      _mm512_maskz_roundscale_ps(kAll, reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const Vec p = exp2_reduced(x - n);
  return reinterpret_cast<Vec>(_mm512_maskz_scalef_ps(normal, reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
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
  return x < -125.0f ? Vec{} : r;
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

// The first n <= kVecWidth elements of src as floats, the other lanes 0.
template <typename T>
inline Vec load_partial(const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    if (n == kVecWidth) return load(src);
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>)
    return reinterpret_cast<Vec>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), src));
#endif
  float tmp[kVecWidth];
  convert_row(src, n, kVecWidth, tmp);
  return load(tmp);
}

// Stores the first n <= kVecWidth lanes of v.
inline void store_partial(float* dst, Vec v, int64_t n) {
  // (A plain store where it can: a load cannot take its data from a masked store still in flight.)
  if (n == kVecWidth) return store(dst, v);
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n) - 1), reinterpret_cast<__m512>(v));
#else
  std::memcpy(dst, &v, static_cast<size_t>(n) * sizeof(float));
#endif
}

// Transposes the kVecWidth x kVecWidth block whose rows are r[0..kVecWidth): afterwards r[j][i]
// holds what r[i][j] held.
inline void transpose_block(Vec* r) {
#if defined(__AVX512F__)
  // Three rounds of shuffles, each pairing vectors: floats within 128-bit lanes, then pairs of
  // floats, then whole lanes. (Zero-masked forms with a full mask, as in exp2.)
  constexpr __mmask16 kAll = 0xffff;
  constexpr __mmask8 kAll8 = 0xff;
  __m512 a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    const __m512 x = reinterpret_cast<__m512>(r[i]), y = reinterpret_cast<__m512>(r[i + 1]);
    a[i] = _mm512_maskz_unpacklo_ps(kAll, x, y);
    a[i + 1] = _mm512_maskz_unpackhi_ps(kAll, x, y);
  }
  // b[4g + j], lane L: column 4L + j of rows 4g .. 4g + 3.
  for (int g = 0; g < 16; g += 4) {
    for (int j = 0; j < 2; ++j) {
      const __m512d x = _mm512_castps_pd(a[g + j]), y = _mm512_castps_pd(a[g + j + 2]);
      b[g + 2 * j] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(kAll8, x, y));
      b[g + 2 * j + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(kAll8, x, y));
    }
  }
  const auto lanes = [](__m512 x, __m512 y, auto imm) {
    return _mm512_maskz_shuffle_f32x4(kAll, x, y, decltype(imm)::value);
  };
  using Low = std::integral_constant<int, 0x44>;   // lanes 0, 1 of x, then of y
  using High = std::integral_constant<int, 0xee>;  // lanes 2, 3 of x, then of y
  using Even = std::integral_constant<int, 0x88>;  // lanes 0, 2 of x, then of y
  using Odd = std::integral_constant<int, 0xdd>;   // lanes 1, 3 of x, then of y
  for (int j = 0; j < 4; ++j) {
    const __m512 lo01 = lanes(b[j], b[4 + j], Low{}), hi01 = lanes(b[j], b[4 + j], High{});
    const __m512 lo23 = lanes(b[8 + j], b[12 + j], Low{}), hi23 = lanes(b[8 + j], b[12 + j], High{});
    r[j] = reinterpret_cast<Vec>(lanes(lo01, lo23, Even{}));
    r[j + 4] = reinterpret_cast<Vec>(lanes(lo01, lo23, Odd{}));
    r[j + 8] = reinterpret_cast<Vec>(lanes(hi01, hi23, Even{}));
    r[j + 12] = reinterpret_cast<Vec>(lanes(hi01, hi23, Odd{}));
  }
#else
  for (int i = 0; i < kVecWidth; ++i)
    for (int j = i + 1; j < kVecWidth; ++j) {
      const float x = r[i][j];
      r[i][j] = r[j][i];
      r[j][i] = x;
    }
#endif
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
