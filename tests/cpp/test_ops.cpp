// kernels/ops.h on the CPU: fill, copy and add (two and three views) on strided views (every corner of dimension folding
// against an index-by-index reference), float conversions rounding to nearest even, upload, the
// workspace, and the errors bad arguments get.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "expect_error.h"
#include "half.h"
#include "kernels/ops.h"
#include "ringflash/tensor.h"

namespace ringflash::test {
namespace {

constexpr Device kCpu{};
constexpr float kSentinel = -7.0f;  // in dst elements that no view covers

// ---- strided views against a reference -------------------------------------------------------

// A view pair: one shape, src and dst strides, and where each view starts in its buffer.
struct Geometry {
  const char* name;
  std::vector<int64_t> shape, src_strides, dst_strides;
  int64_t src_offset = 0, dst_offset = 0;
};

std::vector<Geometry> geometries() {
  return {
      {"contiguous", {2, 3, 4}, {12, 4, 1}, {12, 4, 1}},
      {"one dimension with a step", {5}, {3}, {2}, 1, 2},
      {"size-1 dimensions with odd strides", {1, 3, 1, 4}, {999, 4, 77, 1}, {5, 4, 13, 1}},
      {"size-1 dimension between mergeable ones", {2, 1, 3}, {3, 100, 1}, {3, 1, 1}},
      {"transposed src", {3, 4}, {1, 3}, {4, 1}},
      {"transposed dst", {3, 4}, {4, 1}, {1, 3}},
      {"broadcast src row", {3, 4}, {0, 1}, {4, 1}},
      {"broadcast src inner dimension", {3, 4}, {1, 0}, {4, 1}},
      {"broadcast scalar src", {2, 3}, {0, 0}, {3, 1}},
      {"gaps between rows", {2, 3, 4}, {24, 8, 1}, {12, 4, 1}, 3, 0},
      {"contiguous in dst only", {4, 2, 3}, {3, 12, 1}, {6, 3, 1}},
      {"heads of a (S, H, D) slice", {3, 2, 4}, {16, 4, 1}, {8, 4, 1}, 8, 0},
      {"six dimensions", {2, 1, 2, 3, 1, 2}, {24, 24, 12, 4, 2, 1}, {12, 12, 6, 2, 2, 1}},
      {"no elements", {3, 0, 4}, {0, 4, 1}, {0, 4, 1}},
  };
}

// Elements a view needs in its buffer: its largest offset + 1 (0 when it has none).
int64_t extent(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t offset) {
  int64_t last = offset;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return 0;
    last += (shape[d] - 1) * strides[d];
  }
  return last + 1;
}

// Calls fn(src element, dst element) for every index of the shape, in row-major order.
template <typename Fn>
void for_each_index(const Geometry& g, Fn&& fn) {
  int64_t total = 1;
  for (int64_t size : g.shape) total *= size;
  std::vector<int64_t> index(g.shape.size(), 0);
  for (int64_t n = 0; n < total; ++n) {
    int64_t src = g.src_offset, dst = g.dst_offset;
    for (size_t d = 0; d < index.size(); ++d) {
      src += index[d] * g.src_strides[d];
      dst += index[d] * g.dst_strides[d];
    }
    fn(src, dst);
    for (int d = static_cast<int>(index.size()) - 1; d >= 0 && ++index[d] == g.shape[d]; --d) index[d] = 0;
  }
}

// A buffer of `n` elements of `dtype`, each element i holding value(i) rounded to the dtype.
template <typename Value>
std::vector<unsigned char> buffer(DType dtype, int64_t n, Value&& value) {
  std::vector<unsigned char> b(static_cast<size_t>(n) * dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) store_element(b.data(), dtype, i, value(i));
  return b;
}

TensorView view(std::vector<unsigned char>& b, DType dtype, const std::vector<int64_t>& shape,
                const std::vector<int64_t>& strides, int64_t offset) {
  void* data = b.empty() ? nullptr : b.data() + offset * static_cast<int64_t>(dtype_size(dtype));
  return TensorView(data, dtype, kCpu, static_cast<int>(shape.size()), shape.data(), strides.data());
}

// Runs op(src view, dst view) on `g` and checks every dst element against `expected`(src value,
// old dst value); elements outside the dst view must keep the sentinel.
template <typename Op, typename Expected>
void check_geometry(const Geometry& g, DType src_dtype, DType dst_dtype, Op&& op, Expected&& expected) {
  SCOPED_TRACE(std::string(g.name) + ", " + dtype_name(src_dtype) + " -> " + dtype_name(dst_dtype));
  const int64_t src_n = extent(g.shape, g.src_strides, g.src_offset);
  const int64_t dst_n = extent(g.shape, g.dst_strides, g.dst_offset);
  auto src = buffer(src_dtype, src_n, [](int64_t i) { return 1.0 + 0.37 * static_cast<double>(i); });
  auto dst = buffer(dst_dtype, dst_n, [](int64_t) { return kSentinel; });
  std::vector<double> want(static_cast<size_t>(dst_n), kSentinel);
  for_each_index(g, [&](int64_t s, int64_t d) {
    want[d] = round_to(dst_dtype, expected(load_element(src.data(), src_dtype, s), want[d]));
  });
  op(view(src, src_dtype, g.shape, g.src_strides, g.src_offset),
     view(dst, dst_dtype, g.shape, g.dst_strides, g.dst_offset));
  for (int64_t i = 0; i < dst_n; ++i) EXPECT_EQ(load_element(dst.data(), dst_dtype, i), want[i]) << "element " << i;
}

TEST(OpsCopy, StridedViewsMatchTheReference) {
  const std::pair<DType, DType> dtypes[] = {
      {DType::kFloat32, DType::kFloat32},   {DType::kBFloat16, DType::kBFloat16}, {DType::kFloat32, DType::kFloat16},
      {DType::kFloat32, DType::kBFloat16},  {DType::kFloat16, DType::kFloat32},   {DType::kBFloat16, DType::kFloat16},
      {DType::kFloat16, DType::kBFloat16},
  };
  for (const Geometry& g : geometries())
    for (auto [from, to] : dtypes)
      check_geometry(
          g, from, to, [](const TensorView& s, const TensorView& d) { kernels::copy(s, d, nullptr); },
          [](double x, double) { return x; });
}

TEST(OpsCopy, SameDtypeIsABitCopyOfAnyDtype) {
  const Geometry g{"transposed", {3, 4}, {1, 3}, {4, 1}};
  std::vector<int32_t> src(12), dst(12, -1);
  for (int i = 0; i < 12; ++i) src[i] = 100000007 + i;  // more digits than a float keeps
  kernels::copy(TensorView(src.data(), DType::kInt32, kCpu, {3, 4}, {1, 3}),
                TensorView(dst.data(), DType::kInt32, kCpu, {3, 4}), nullptr);
  for_each_index(g, [&](int64_t s, int64_t d) { EXPECT_EQ(dst[d], src[s]); });

  // A NaN's payload survives a same-dtype copy.
  const uint32_t payload = 0x7fa00001u;
  float in = bits_float(payload), out = 0.0f;
  kernels::copy(TensorView(&in, DType::kFloat32, kCpu, {1}), TensorView(&out, DType::kFloat32, kCpu, {1}), nullptr);
  EXPECT_EQ(float_bits(out), payload);
}

TEST(OpsAdd, StridedViewsMatchTheReference) {
  for (const Geometry& g : geometries())
    check_geometry(
        g, DType::kFloat32, DType::kFloat32,
        [](const TensorView& s, const TensorView& d) { kernels::add(s, d, nullptr); },
        [](double x, double old) { return static_cast<double>(static_cast<float>(old) + static_cast<float>(x)); });
}

// dst = a + b: a in g's src geometry, b and dst in its dst geometry (separate buffers), the fp32
// sum rounded once to dst's dtype.
TEST(OpsAdd, ThreeViewsMatchTheReference) {
  for (const Geometry& g : geometries())
    for (DType to : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      SCOPED_TRACE(std::string(g.name) + ", float32 + float32 -> " + dtype_name(to));
      const int64_t a_n = extent(g.shape, g.src_strides, g.src_offset);
      const int64_t n = extent(g.shape, g.dst_strides, g.dst_offset);
      auto a = buffer(DType::kFloat32, a_n, [](int64_t i) { return 1.0 + 0.37 * static_cast<double>(i); });
      auto b = buffer(DType::kFloat32, n, [](int64_t i) { return 1e-3 * static_cast<double>(i) - 0.7; });
      auto dst = buffer(to, n, [](int64_t) { return kSentinel; });
      std::vector<double> want(static_cast<size_t>(n), kSentinel);
      for_each_index(g, [&](int64_t s, int64_t d) {
        const float sum = static_cast<float>(load_element(a.data(), DType::kFloat32, s)) +
                          static_cast<float>(load_element(b.data(), DType::kFloat32, d));
        want[d] = round_to(to, sum);
      });
      kernels::add(view(a, DType::kFloat32, g.shape, g.src_strides, g.src_offset),
                   view(b, DType::kFloat32, g.shape, g.dst_strides, g.dst_offset),
                   view(dst, to, g.shape, g.dst_strides, g.dst_offset), nullptr);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(load_element(dst.data(), to, i), want[i]) << "element " << i;
    }
}

TEST(OpsAdd, DstMayBeB) {
  float a[6], b[6], c[6];
  for (int i = 0; i < 6; ++i) a[i] = 0.1f * static_cast<float>(i), b[i] = c[i] = 3.0f - static_cast<float>(i);
  const TensorView va(a, DType::kFloat32, kCpu, {2, 3}), vb(b, DType::kFloat32, kCpu, {2, 3});
  kernels::add(va, vb, vb, nullptr);
  kernels::add(va, TensorView(c, DType::kFloat32, kCpu, {2, 3}), nullptr);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b[i], c[i]) << "element " << i;
}

TEST(OpsFill, StridedViewsMatchTheReference) {
  for (const Geometry& g : geometries())
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
      check_geometry(
          g, dtype, dtype, [](const TensorView&, const TensorView& d) { kernels::fill(d, 0.1f, nullptr); },
          [](double, double) { return 0.1f; });
}

TEST(OpsFill, NoElementsWithNullData) {
  kernels::fill(TensorView(nullptr, DType::kFloat16, kCpu, {0, 3}), 1.0f, nullptr);
  kernels::copy(TensorView(nullptr, DType::kFloat32, kCpu, {2, 0}), TensorView(nullptr, DType::kBFloat16, kCpu, {2, 0}),
                nullptr);
  kernels::add(TensorView(nullptr, DType::kFloat32, kCpu, {0}), TensorView(nullptr, DType::kFloat32, kCpu, {0}),
               nullptr);
}

// ---- conversions -----------------------------------------------------------------------------

// `x` (given as bits of `from`) converted to `to`, as bits.
uint32_t convert(DType from, DType to, uint32_t x) {
  uint32_t in = x, out = 0;
  kernels::copy(TensorView(&in, from, kCpu, {1}), TensorView(&out, to, kCpu, {1}), nullptr);
  return to == DType::kFloat32 ? out : out & 0xffffu;
}

uint32_t f32(float x) { return float_bits(x); }

TEST(OpsConvert, Float32ToFloat16RoundsToNearestEven) {
  const auto half = [](float x) { return convert(DType::kFloat32, DType::kFloat16, f32(x)); };
  EXPECT_EQ(half(1.0f), 0x3c00u);
  EXPECT_EQ(half(1.0f + 0x1p-11f), 0x3c00u);         // halfway, down to the even 1.0
  EXPECT_EQ(half(1.0f + 3 * 0x1p-11f), 0x3c02u);     // halfway, up to the even 1 + 2^-9
  EXPECT_EQ(half(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01u);  // just above halfway
  EXPECT_EQ(half(65504.0f), 0x7bffu);                // the largest half
  EXPECT_EQ(half(65519.0f), 0x7bffu);
  EXPECT_EQ(half(65520.0f), 0x7c00u);                // halfway to 2^16: rounds to infinity
  EXPECT_EQ(half(-0.0f), 0x8000u);
  EXPECT_EQ(half(0x1p-25f), 0x0000u);                // halfway between 0 and the smallest subnormal
  EXPECT_EQ(half(3 * 0x1p-25f), 0x0002u);            // halfway, up to the even subnormal
  EXPECT_EQ(half(std::numeric_limits<float>::infinity()), 0x7c00u);
  const uint32_t nan = half(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00u, 0x7c00u);
  EXPECT_NE(nan & 0x03ffu, 0u);
}

TEST(OpsConvert, Float32ToBFloat16RoundsToNearestEven) {
  const auto bf16 = [](float x) { return convert(DType::kFloat32, DType::kBFloat16, f32(x)); };
  EXPECT_EQ(bf16(1.0f), 0x3f80u);
  EXPECT_EQ(bf16(1.0f + 0x1p-8f), 0x3f80u);      // halfway, down to the even 1.0
  EXPECT_EQ(bf16(1.0f + 3 * 0x1p-8f), 0x3f82u);  // halfway, up to the even 1 + 2^-6
  EXPECT_EQ(bf16(-1.0f - 0x1p-8f - 0x1p-20f), 0xbf81u);
  EXPECT_EQ(bf16(std::numeric_limits<float>::max()), 0x7f80u);  // rounds up to infinity
  EXPECT_EQ(bf16(-std::numeric_limits<float>::infinity()), 0xff80u);
  const uint32_t nan = bf16(bits_float(0x7f800001u));  // a NaN whose payload is all in the dropped bits
  EXPECT_EQ(nan & 0x7f80u, 0x7f80u);
  EXPECT_NE(nan & 0x007fu, 0u);
}

TEST(OpsConvert, BetweenHalfTypesRoundsToNearestEven) {
  EXPECT_EQ(convert(DType::kFloat16, DType::kBFloat16, 0x3c04u), 0x3f80u);  // 1 + 2^-8: halfway, down
  EXPECT_EQ(convert(DType::kFloat16, DType::kBFloat16, 0x3c0cu), 0x3f82u);  // 1 + 3 * 2^-8: halfway, up
  EXPECT_EQ(convert(DType::kFloat16, DType::kBFloat16, 0x0001u), 0x3380u);  // 2^-24 exactly
  EXPECT_EQ(convert(DType::kBFloat16, DType::kFloat16, 0x3f81u), 0x3c08u);  // 1 + 2^-7 exactly
  EXPECT_EQ(convert(DType::kBFloat16, DType::kFloat16, 0x4780u), 0x7c00u);  // 2^16: beyond half's range
  EXPECT_EQ(convert(DType::kBFloat16, DType::kFloat16, 0x3080u), 0x0000u);  // 2^-30: below half's range
}

TEST(OpsConvert, WideningIsExact) {
  EXPECT_EQ(convert(DType::kFloat16, DType::kFloat32, 0x3c01u), f32(1.0f + 0x1p-10f));
  EXPECT_EQ(convert(DType::kFloat16, DType::kFloat32, 0x8001u), f32(-0x1p-24f));
  EXPECT_EQ(convert(DType::kBFloat16, DType::kFloat32, 0x3f81u), f32(1.0f + 0x1p-7f));
  EXPECT_EQ(convert(DType::kBFloat16, DType::kFloat32, 0xff80u), f32(-std::numeric_limits<float>::infinity()));
}

// Every fp32 -> half conversion agrees with the tests' own bit-exact reference (half.h).
TEST(OpsConvert, RandomFloatsMatchTheReference) {
  constexpr int kCount = 1 << 16;
  std::mt19937 rng(7);
  std::vector<float> src;
  while (src.size() < kCount) {
    const float x = bits_float(rng());
    if (!std::isnan(x)) src.push_back(x);
  }
  std::vector<uint16_t> half(kCount), bf16(kCount);
  const TensorView from(src.data(), DType::kFloat32, kCpu, {kCount});
  kernels::copy(from, TensorView(half.data(), DType::kFloat16, kCpu, {kCount}), nullptr);
  kernels::copy(from, TensorView(bf16.data(), DType::kBFloat16, kCpu, {kCount}), nullptr);
  int wrong = 0;
  for (int i = 0; i < kCount; ++i) wrong += half[i] != float_to_half(src[i]) || bf16[i] != float_to_bf16(src[i]);
  EXPECT_EQ(wrong, 0);
}

// ---- bad arguments ---------------------------------------------------------------------------

TEST(OpsErrors, DtypeMismatch) {
  float f[4] = {};
  int32_t n[4] = {};
  const TensorView floats(f, DType::kFloat32, kCpu, {4}), ints(n, DType::kInt32, kCpu, {4});
  const TensorView halves(f, DType::kFloat16, kCpu, {4});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::copy(ints, floats, nullptr), "[copy]", "int32", "float32");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(halves, floats, nullptr), "[add]", "float32", "float16");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(floats, halves, nullptr), "[add]", "float16");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::fill(ints, 0.0f, nullptr), "[fill]", "int32");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(floats, floats, ints, nullptr), "[add]", "float dtype",
                         "int32");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(floats, halves, floats, nullptr), "[add]", "a and b",
                         "float16");
}

TEST(OpsErrors, ShapeMismatch) {
  float a[6] = {}, b[6] = {};
  const TensorView rows(a, DType::kFloat32, kCpu, {2, 3}), cols(b, DType::kFloat32, kCpu, {3, 2});
  const TensorView flat(b, DType::kFloat32, kCpu, {6});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::copy(rows, cols, nullptr), "[copy]", "(3, 2)", "(2, 3)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(rows, flat, nullptr), "[add]", "(6,)", "(2, 3)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(rows, cols, rows, nullptr), "[add]", "b must have",
                         "(2, 3)", "(3, 2)");
}

TEST(OpsErrors, DeviceMismatch) {
  float a[2] = {}, b[2] = {};
  const TensorView gpu(a, DType::kFloat32, Device{DeviceType::kCUDA, 0}, {2}), cpu(b, DType::kFloat32, kCpu, {2});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::copy(gpu, cpu, nullptr), "[copy]", "cpu", "cuda:0");
}

TEST(OpsErrors, NullPointers) {
  float a[3] = {};
  const TensorView some(a, DType::kFloat32, kCpu, {3}), none(nullptr, DType::kFloat32, kCpu, {3});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::fill(none, 0.0f, nullptr), "[fill]", "dst", "null");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::copy(none, some, nullptr), "[copy]", "src", "null");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::copy(some, none, nullptr), "[copy]", "dst", "null");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(none, some, nullptr), "[add]", "src", "null");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::add(some, none, some, nullptr), "[add]", "b must not be null");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::upload(nullptr, 4, a, kCpu, nullptr), "[upload]", "null");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, kernels::upload(a, 4, nullptr, kCpu, nullptr), "[upload]", "null");
}

// ---- upload and the workspace ----------------------------------------------------------------

TEST(OpsUpload, CopiesTheBytesAtOnce) {
  std::vector<int32_t> host{3, 1, 4, 1, 5}, device(5, 0);
  kernels::upload(host.data(), host.size() * sizeof(int32_t), device.data(), kCpu, nullptr);
  host.assign(5, 0);
  EXPECT_EQ(device, (std::vector<int32_t>{3, 1, 4, 1, 5}));
  kernels::upload(nullptr, 0, nullptr, kCpu, nullptr);  // nothing to move
  EXPECT_FALSE(kernels::capturing(kCpu, nullptr));
}

TEST(OpsWorkspace, LayoutAlignsEveryPiece) {
  constexpr size_t kAlign = kernels::WorkspaceLayout::kAlignment;
  kernels::WorkspaceLayout layout;
  EXPECT_EQ(layout.add(1), 0u);
  EXPECT_EQ(layout.add(0), kAlign);  // an empty piece takes no room
  EXPECT_EQ(layout.add(kAlign), kAlign);
  EXPECT_EQ(layout.add(kAlign + 1), 2 * kAlign);
  EXPECT_EQ(layout.total(), 4 * kAlign);
}

TEST(OpsWorkspace, OneAlignedAllocationThatMoves) {
  kernels::Workspace empty(kCpu, 0, nullptr);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.size(), 0u);

  kernels::Workspace w(kCpu, 1000, nullptr);
  ASSERT_NE(w.data(), nullptr);
  EXPECT_EQ(w.size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.data()) % kernels::WorkspaceLayout::kAlignment, 0u);
  kernels::fill(TensorView(w.data(), DType::kFloat32, kCpu, {250}), 2.0f, nullptr);  // all of it is usable

  unsigned char* data = w.data();
  kernels::Workspace moved(std::move(w));
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(w.data(), nullptr);  // the moved-from workspace owns nothing
  empty = std::move(moved);
  EXPECT_EQ(empty.data(), data);
  EXPECT_EQ(empty.size(), 1000u);
}

}  // namespace
}  // namespace ringflash::test
