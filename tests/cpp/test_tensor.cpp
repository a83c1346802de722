// TensorView: shapes, strides, contiguity, printing, and the errors its constructors raise.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "expect_error.h"
#include "ringflash/tensor.h"

namespace ringflash::test {
namespace {

TEST(TensorView, DefaultStridesAreRowMajor) {
  std::vector<float> data(2 * 3 * 4);
  const TensorView t(data.data(), DType::kFloat32, Device{}, {2, 3, 4});
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(1), 4);
  EXPECT_EQ(t.stride(2), 1);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(-2), 4);
  EXPECT_EQ(t.data_as<float>(), data.data());
  EXPECT_EQ(t.device(), Device{});
  EXPECT_TRUE(t.is_contiguous());
}

TEST(TensorView, Contiguity) {
  std::vector<float> data(64);
  // A transposed view.
  EXPECT_FALSE(TensorView(data.data(), DType::kFloat32, Device{}, {4, 3}, {1, 4}).is_contiguous());
  // A slice of the heads of a qkv-packed (S, 3, H, D) buffer: D contiguous, the rest not.
  const TensorView q(data.data(), DType::kFloat32, Device{}, {2, 2, 4}, {24, 4, 1});
  EXPECT_FALSE(q.is_contiguous());
  EXPECT_EQ(q.stride(-1), 1);
  // Dimensions of size 1 may have any stride.
  EXPECT_TRUE(TensorView(data.data(), DType::kFloat32, Device{}, {1, 3, 1, 2}, {99, 2, 7, 1}).is_contiguous());
  // Explicit strides equal to the row-major ones.
  EXPECT_TRUE(TensorView(data.data(), DType::kFloat32, Device{}, {4, 3}, {3, 1}).is_contiguous());
  // A gap between rows.
  EXPECT_FALSE(TensorView(data.data(), DType::kFloat32, Device{}, {4, 3}, {5, 1}).is_contiguous());
}

TEST(TensorView, ShapeString) {
  float x = 0;
  EXPECT_EQ(TensorView(&x, DType::kFloat32, Device{}, {2, 4096, 32}).shape_string(), "(2, 4096, 32)");
  EXPECT_EQ(TensorView(&x, DType::kFloat32, Device{}, {5}).shape_string(), "(5,)");
  EXPECT_EQ(TensorView(&x, DType::kFloat32, Device{}, {0, 3}).shape_string(), "(0, 3)");
  EXPECT_EQ(TensorView(&x, DType::kFloat32, Device{}, 0, nullptr).shape_string(), "()");
  EXPECT_EQ(TensorView().shape_string(), "()");
}

TEST(TensorView, EmptyAndScalar) {
  float x = 0;
  EXPECT_EQ(TensorView(&x, DType::kFloat32, Device{}, {3, 0, 2}).numel(), 0);
  EXPECT_EQ(TensorView(&x, DType::kFloat32, Device{}, 0, nullptr).numel(), 1);
}

TEST(TensorView, NegativeSizesThrow) {
  float x = 0;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, TensorView(&x, DType::kFloat32, Device{}, {2, -3}), "[TensorView]",
                         "sizes must be >= 0", "-3", "dimension 1");
  const int64_t shape[] = {-1};
  EXPECT_RINGFLASH_ERROR(InvalidArgument, TensorView(&x, DType::kFloat32, Device{}, 1, shape), "-1",
                         "dimension 0");
}

TEST(TensorView, StridesMustMatchShape) {
  float x = 0;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, TensorView(&x, DType::kFloat32, Device{}, {2, 3}, {1}), "[TensorView]",
                         "strides", "1 for 2 dimensions");
}

TEST(TensorView, TooManyDimensionsThrow) {
  float x = 0;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, TensorView(&x, DType::kFloat32, Device{}, {1, 1, 1, 1, 1, 1, 1}),
                         "[TensorView]", "ndim", "got 7");
  const int64_t shape[1] = {1};
  EXPECT_RINGFLASH_ERROR(InvalidArgument, TensorView(&x, DType::kFloat32, Device{}, -1, shape), "ndim", "got -1");
  EXPECT_NO_THROW(TensorView(&x, DType::kFloat32, Device{}, {1, 1, 1, 1, 1, 1}));
}

TEST(TensorView, DTypes) {
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kInt32), 4u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(dtype_size(DType::kFloat64), 8u);
  EXPECT_STREQ(dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(dtype_name(DType::kFloat16), "float16");
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kInt32), "int32");
  EXPECT_STREQ(dtype_name(DType::kInt64), "int64");
  EXPECT_STREQ(dtype_name(DType::kFloat64), "float64");
}

TEST(TensorView, Devices) {
  EXPECT_EQ(device_name(Device{}), "cpu");
  EXPECT_EQ(device_name(Device{DeviceType::kCUDA, 3}), "cuda:3");
  EXPECT_NE((Device{DeviceType::kCUDA, 0}), (Device{DeviceType::kCUDA, 1}));
  EXPECT_NE((Device{DeviceType::kCUDA, 0}), Device{});
  float x = 0;
  const TensorView t(&x, DType::kFloat16, Device{DeviceType::kCUDA, 1}, {1});
  EXPECT_EQ(t.device(), (Device{DeviceType::kCUDA, 1}));
  EXPECT_EQ(t.dtype(), DType::kFloat16);
}

}  // namespace
}  // namespace ringflash::test
