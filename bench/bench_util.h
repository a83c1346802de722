// Pieces the C++ benchmarks share: main's error handling, flag reading, dtypes, random inputs and
// median timing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringflash/ringflash.h"

namespace bench {

using ringflash::DType;
using ringflash::TensorView;

// A benchmark's main: options = parse(argc, argv), then run(options). A bad flag prints
// "<program>: <why> (--help for usage)" and an exception out of run "<program>: <why>", both on
// stderr with exit status 2; otherwise the exit status is run's.
template <typename Parse, typename Run>
int run_main(const char* program, int argc, char** argv, Parse&& parse, Run&& run) {
  decltype(parse(argc, argv)) options;
  try {
    options = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s (--help for usage)\n", program, e.what());
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 2;
  }
}

// Calls on_flag(flag, value) for every flag of argv in order: "--flag value", or "--flag" with value
// "" for the flags in `switches`. Prints `usage` and exits on -h or --help; throws
// std::invalid_argument for a flag without its value.
inline void read_flags(int argc, char** argv, const char* usage, const std::vector<std::string>& switches,
                       const std::function<void(const std::string& flag, const std::string& value)>& on_flag) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::printf("%s", usage);
      std::exit(0);
    }
    if (std::find(switches.begin(), switches.end(), flag) != switches.end()) {
      on_flag(flag, "");
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    on_flag(flag, argv[++i]);
  }
}

inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');)
    if (!part.empty()) parts.push_back(part);
  return parts;
}

inline std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> values;
  for (const std::string& part : split(s)) values.push_back(std::stoll(part));
  return values;
}

inline DType parse_dtype(const std::string& name) {
  if (name == "fp32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp16") return DType::kFloat16;
  throw std::invalid_argument("unknown dtype " + name + " (fp32, bf16, fp16)");
}

inline uint16_t to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);  // round to nearest even
}

// Benchmark data only: values of a standard normal, so no subnormals worth keeping.
inline uint16_t to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((x >> 23) & 0xffu) - 127 + 15;
  const uint32_t mantissa = x & 0x7fffffu;
  if (exponent <= 0) return static_cast<uint16_t>(sign);
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  uint32_t h = sign | (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
}

// An owning buffer of `shape`, filled with normal random values.
struct Buffer {
  std::vector<unsigned char> bytes;
  TensorView view;

  Buffer(DType dtype, std::initializer_list<int64_t> shape, std::mt19937& rng, bool fill)
      : Buffer(dtype, std::vector<int64_t>(shape), rng, fill) {}
  Buffer(DType dtype, const std::vector<int64_t>& shape, std::mt19937& rng, bool fill) {
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    bytes.resize(static_cast<size_t>(numel) * ringflash::dtype_size(dtype));
    view = TensorView(bytes.data(), dtype, ringflash::Device{}, static_cast<int>(shape.size()), shape.data());
    if (!fill) return;
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < numel; ++i) {
      const float value = normal(rng);
      if (dtype == DType::kFloat32) reinterpret_cast<float*>(bytes.data())[i] = value;
      else if (dtype == DType::kBFloat16) reinterpret_cast<uint16_t*>(bytes.data())[i] = to_bf16(value);
      else reinterpret_cast<uint16_t*>(bytes.data())[i] = to_fp16(value);
    }
  }
};

inline double median_ms(int warmup, int iters, const std::function<void(int)>& call) {
  for (int i = 0; i < warmup; ++i) call(i);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    call(warmup + i);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

}  // namespace bench
