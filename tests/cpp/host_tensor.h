// HostTensor: an owning, strided host tensor for the tests, and the TensorView over it.
//
// Several HostTensors may share one Storage (q, k and v as slices of a qkv-packed buffer). The
// storage can be snapshotted to prove a call wrote nothing outside its views.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "half.h"
#include "ringflash/tensor.h"

namespace ringflash::test {

struct Storage {
  DType dtype = DType::kFloat32;
  int64_t elements = 0;
  std::vector<unsigned char> bytes;

  Storage(DType dtype_, int64_t elements_)
      : dtype(dtype_), elements(elements_), bytes(static_cast<size_t>(std::max<int64_t>(elements_, 1)) * dtype_size(dtype_)) {}
  void* data() { return bytes.data(); }
  // Every element set to `x` (NaN marks "never written").
  void fill(double x) {
    for (int64_t e = 0; e < elements; ++e) store_element(bytes.data(), dtype, e, x);
  }
};

class HostTensor {
 public:
  HostTensor() = default;
  // A view of `storage` at element `offset`; contiguous (row-major) when `strides` is empty.
  HostTensor(std::shared_ptr<Storage> storage, std::vector<int64_t> shape, std::vector<int64_t> strides = {},
             int64_t offset = 0)
      : storage_(std::move(storage)), shape_(std::move(shape)), strides_(std::move(strides)), offset_(offset) {
    if (strides_.empty()) strides_ = contiguous_strides(shape_);
    if (strides_.size() != shape_.size()) throw std::invalid_argument("HostTensor: strides do not match shape");
    if (numel() > 0 && offset_ + max_offset() >= storage_->elements)
      throw std::invalid_argument("HostTensor: view runs past its storage");
  }

  // A fresh contiguous tensor, every element `fill`.
  static HostTensor empty(DType dtype, std::vector<int64_t> shape, double fill = 0.0) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    auto storage = std::make_shared<Storage>(dtype, n);
    storage->fill(fill);
    return HostTensor(storage, std::move(shape));
  }

  // A fresh tensor with the given strides (gaps between elements allowed), every element `fill`.
  static HostTensor strided(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides, double fill) {
    int64_t last = 0;
    bool any = true;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 0) any = false;
      last += (shape[d] - 1) * strides[d];
    }
    auto storage = std::make_shared<Storage>(dtype, any ? last + 1 : 0);
    storage->fill(fill);
    return HostTensor(storage, std::move(shape), std::move(strides));
  }

  static std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
    std::vector<int64_t> strides(shape.size());
    int64_t running = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      strides[d] = running;
      running *= shape[d];
    }
    return strides;
  }

  DType dtype() const { return storage_->dtype; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t offset() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }

  void* data() const {
    return static_cast<unsigned char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype()));
  }
  TensorView view(Device device = Device{}) const {
    return TensorView(data(), dtype(), device, ndim(), shape_.data(), strides_.data());
  }

  // Element offset (in the storage) of a multi-index.
  int64_t element(std::initializer_list<int64_t> index) const {
    int64_t e = offset_;
    size_t d = 0;
    for (int64_t i : index) e += i * strides_[d++];
    return e;
  }
  double at(std::initializer_list<int64_t> index) const {
    return load_element(storage_->data(), dtype(), element(index));
  }
  void set(std::initializer_list<int64_t> index, double x) const {
    store_element(storage_->data(), dtype(), element(index), x);
  }
  double at_element(int64_t e) const { return load_element(storage_->data(), dtype(), e); }
  void set_element(int64_t e, double x) const { store_element(storage_->data(), dtype(), e, x); }

  // `length` entries of dimension `dim` from `start`, sharing the storage.
  HostTensor slice(int dim, int64_t start, int64_t length) const {
    std::vector<int64_t> shape = shape_;
    shape[dim] = length;
    return HostTensor(storage_, shape, strides_, offset_ + start * strides_[dim]);
  }

  // Calls fn(element offset) for every element of the view.
  template <typename Fn>
  void for_each_element(Fn&& fn) const {
    if (numel() == 0) return;
    std::vector<int64_t> index(shape_.size(), 0);
    for (;;) {
      int64_t e = offset_;
      for (size_t d = 0; d < shape_.size(); ++d) e += index[d] * strides_[d];
      fn(e);
      int d = ndim() - 1;
      for (; d >= 0; --d) {
        if (++index[d] < shape_[d]) break;
        index[d] = 0;
      }
      if (d < 0) return;
    }
  }

 private:
  int64_t max_offset() const {
    int64_t m = 0;
    for (size_t d = 0; d < shape_.size(); ++d) m += (shape_[d] - 1) * strides_[d];
    return m;
  }

  std::shared_ptr<Storage> storage_;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;
};

// Remembers the bytes of a storage outside a set of views, to prove a call did not write there.
class OutsideGuard {
 public:
  OutsideGuard() = default;
  explicit OutsideGuard(const std::vector<const HostTensor*>& views) {
    if (views.empty()) return;
    storage_ = views.front()->storage();
    inside_.assign(static_cast<size_t>(storage_->elements), false);
    for (const HostTensor* t : views) t->for_each_element([&](int64_t e) { inside_[static_cast<size_t>(e)] = true; });
    before_ = storage_->bytes;
  }

  // The first element outside the views whose bytes changed, or -1.
  int64_t first_changed() const {
    if (!storage_) return -1;
    const size_t size = dtype_size(storage_->dtype);
    for (size_t e = 0; e < inside_.size(); ++e)
      if (!inside_[e] && std::memcmp(&before_[e * size], &storage_->bytes[e * size], size) != 0)
        return static_cast<int64_t>(e);
    return -1;
  }

 private:
  std::shared_ptr<Storage> storage_;
  std::vector<bool> inside_;
  std::vector<unsigned char> before_;
};

}  // namespace ringflash::test
