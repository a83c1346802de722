// TensorView: a non-owning view of a strided tensor in host or device memory.
//
// It is how tensors cross every boundary of the library (DLPack from Python, raw pointers from
// C++). It never allocates or frees. Strides are in elements, not bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ringflash {

enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kInt32, kInt64, kFloat64 };

// Bytes of one element of `dtype`.
size_t dtype_size(DType dtype);
// "float32", "float16", "bfloat16", "int32", "int64", "float64".
const char* dtype_name(DType dtype);
// Whether `dtype` is one that attention computes in: float32, float16 or bfloat16.
bool is_float(DType dtype);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  bool operator==(const Device& other) const { return type == other.type && index == other.index; }
  bool operator!=(const Device& other) const { return !(*this == other); }
};

// "cpu" or "cuda:N".
std::string device_name(Device device);

class TensorView {
 public:
  static constexpr int kMaxDims = 6;

  TensorView() = default;
  // A view of `data` with the given shape. Without `strides`, the view is contiguous (row-major).
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
             std::initializer_list<int64_t> strides = {});
  TensorView(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
             const int64_t* strides = nullptr);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  // Size and stride of dimension `dim`; negative `dim` counts from the end.
  int64_t size(int dim) const { return shape_[wrap(dim)]; }
  int64_t stride(int dim) const { return strides_[wrap(dim)]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // "(2, 4096, 32)"
  std::string shape_string() const;

 private:
  int wrap(int dim) const { return dim < 0 ? dim + ndim_ : dim; }

  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Device device_{};
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

}  // namespace ringflash
