// Bad input: every wrong shape, dtype, device, stride, rank, seqlen and option gets a ringflash
// error of the right type whose message names the op and the argument. None reaches a kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "expect_error.h"
#include "host_tensor.h"
#include "ringflash/ringflash.h"

namespace ringflash::test {
namespace {

constexpr int64_t kB = 2, kS = 8, kHq = 4, kHkv = 2, kD = 16;
constexpr int64_t kT = 16;  // packed tokens
const Device kCuda{DeviceType::kCUDA, 0};

// A valid padded problem (fp32, GQA 2) that each test breaks in one place.
class Validation : public ::testing::Test {
 protected:
  HostTensor q = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, kD});
  HostTensor k = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, kD});
  HostTensor v = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, kD});
  HostTensor out = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, kD});
  HostTensor dout = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, kD});
  HostTensor lse = HostTensor::empty(DType::kFloat32, {kB, kHq, kS});
  HostTensor dq = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, kD});
  HostTensor dk = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, kD});
  HostTensor dv = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, kD});
  AttentionParams p;

  TensorView qv() const { return q.view(); }
  TensorView kv() const { return k.view(); }
  TensorView vv() const { return v.view(); }

  void forward(const TensorView& q_, const TensorView& k_, const TensorView& v_) const {
    attention_forward(q_, k_, v_, out.view(), lse.view(), p);
  }
  void forward() const { forward(qv(), kv(), vv()); }
  void forward_out(const TensorView& out_, const TensorView& lse_) const {
    attention_forward(qv(), kv(), vv(), out_, lse_, p);
  }
  void backward() const {
    attention_backward(qv(), kv(), vv(), out.view(), dout.view(), lse.view(), dq.view(), dk.view(), dv.view(), p);
  }
  void backward_with(const TensorView& out_, const TensorView& dout_, const TensorView& lse_, const TensorView& dq_,
                     const TensorView& dk_, const TensorView& dv_) const {
    attention_backward(qv(), kv(), vv(), out_, dout_, lse_, dq_, dk_, dv_, p);
  }
  // Validation alone, without a kernel.
  bool valid() const { return attention_support(qv(), kv(), vv(), p).supported; }
};

TEST_F(Validation, BaselineIsValid) {
  const Support s = attention_support(qv(), kv(), vv(), p);
  EXPECT_TRUE(s.supported) << s.reason;
  EXPECT_EQ(s.backend, "cpu");
  EXPECT_EQ(s.reason, "");
}

// ---- ranks and shapes

TEST_F(Validation, WrongRank) {
  const TensorView q3(q.data(), DType::kFloat32, Device{}, {kB * kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(q3, kv(), vv()), "[attention_forward]",
                         "q must have shape (B, S, H, D)", "got (16, 4, 16)");
  const TensorView k5(k.data(), DType::kFloat32, Device{}, {kB, kS, kHkv, kD, 1});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), k5, vv()), "k must have shape (B, S, H, D)",
                         "got (2, 8, 2, 16, 1)");
  const TensorView v2(v.data(), DType::kFloat32, Device{}, {kB * kS * kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), kv(), v2), "v must have shape");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(q3, kv(), vv(), out.view(), dout.view(), lse.view(), dq.view(),
                                            dk.view(), dv.view(), p),
                         "[attention_backward]", "q must have shape (B, S, H, D)");
}

TEST_F(Validation, PackedNeedsRank3) {
  std::vector<int32_t> cu = {0, 8, 16};
  p.cu_seqlens_q = p.cu_seqlens_k = TensorView(cu.data(), DType::kInt32, Device{}, {3});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "q must have shape (T, H, D)", "cu_seqlens given");
}

TEST_F(Validation, MismatchedShapes) {
  const HostTensor v_short = HostTensor::empty(DType::kFloat32, {kB, kS - 1, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), kv(), v_short.view()), "v must have k's shape (2, 8, 2, 16)",
                         "got (2, 7, 2, 16)");
  const HostTensor k1 = HostTensor::empty(DType::kFloat32, {1, kS, kHkv, kD});
  const HostTensor v1 = HostTensor::empty(DType::kFloat32, {1, kS, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), k1.view(), v1.view()), "k must have q's batch size 2");
  const HostTensor k8 = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, 8});
  const HostTensor v8 = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, 8});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), k8.view(), v8.view()), "k must have q's head_dim 16");
}

TEST_F(Validation, ZeroHeadDim) {
  const HostTensor q0 = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, 0});
  const HostTensor k0 = HostTensor::empty(DType::kFloat32, {kB, kS, kHkv, 0});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(q0.view(), k0.view(), k0.view()), "head_dim must be > 0");
}

TEST_F(Validation, HeadsNotAMultiple) {
  const HostTensor k3 = HostTensor::empty(DType::kFloat32, {kB, kS, 3, kD});
  const HostTensor v3 = HostTensor::empty(DType::kFloat32, {kB, kS, 3, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), k3.view(), v3.view()), "multiple", "4 q heads",
                         "3 k/v heads");
  const HostTensor k0 = HostTensor::empty(DType::kFloat32, {kB, kS, 0, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), k0.view(), k0.view()), "0 k/v heads");
  EXPECT_FALSE(attention_support(qv(), k3.view(), v3.view(), p).supported);
}

TEST_F(Validation, OutputShapes) {
  const HostTensor bad = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, kD + 1});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(bad.view(), lse.view()), "[attention_forward]",
                         "out must have shape (2, 8, 4, 16)", "got (2, 8, 4, 17)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), bad.view(), lse.view(), dq.view(), dk.view(), dv.view()),
                         "[attention_backward]", "dout must have shape (2, 8, 4, 16)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), bad.view(), dk.view(), dv.view()),
                         "dq must have shape (2, 8, 4, 16)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), dq.view(), dq.view(), dv.view()),
                         "dk must have shape (2, 8, 2, 16)", "got (2, 8, 4, 16)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), dq.view(), dk.view(), dq.view()),
                         "dv must have shape (2, 8, 2, 16)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(bad.view(), dout.view(), lse.view(), dq.view(), dk.view(), dv.view()),
                         "out must have shape");
}

TEST_F(Validation, LseShape) {
  const HostTensor bsh = HostTensor::empty(DType::kFloat32, {kB, kS, kHq});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(out.view(), bsh.view()), "lse must have shape (2, 4, 8)",
                         "got (2, 8, 4)");
  const HostTensor two = HostTensor::empty(DType::kFloat32, {kHq, kB * kS});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(out.view(), two.view()), "lse must have shape (2, 4, 8)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), bsh.view(), dq.view(), dk.view(), dv.view()),
                         "[attention_backward]", "lse must have shape (2, 4, 8)");
}

TEST_F(Validation, PackedLseShape) {
  const HostTensor qp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  const HostTensor kp = HostTensor::empty(DType::kFloat32, {kT, kHkv, kD});
  std::vector<int32_t> cu = {0, 5, 16};
  p.cu_seqlens_q = p.cu_seqlens_k = TensorView(cu.data(), DType::kInt32, Device{}, {3});
  EXPECT_TRUE(attention_support(qp.view(), kp.view(), kp.view(), p).supported);
  const HostTensor wrong = HostTensor::empty(DType::kFloat32, {kT, kHq});
  const HostTensor outp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_forward(qp.view(), kp.view(), kp.view(), outp.view(), wrong.view(), p),
                         "lse must have shape (4, 16)", "got (16, 4)");
  const HostTensor padded_lse = HostTensor::empty(DType::kFloat32, {2, kHq, 8});
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_forward(qp.view(), kp.view(), kp.view(), outp.view(), padded_lse.view(), p),
                         "lse must have shape (4, 16)");
}

// ---- dtypes

TEST_F(Validation, InputDtypes) {
  const HostTensor qi = HostTensor::empty(DType::kInt32, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qi.view(), kv(), vv()),
                         "q must have dtype float32, float16 or bfloat16, got int32");
  const HostTensor qd = HostTensor::empty(DType::kFloat64, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qd.view(), kv(), vv()), "q must have dtype", "got float64");
  const HostTensor kh = HostTensor::empty(DType::kFloat16, {kB, kS, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), kh.view(), vv()), "k must have q's dtype float32",
                         "got float16");
  const HostTensor vb = HostTensor::empty(DType::kBFloat16, {kB, kS, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), kv(), vb.view()), "v must have q's dtype float32",
                         "got bfloat16");
}

TEST_F(Validation, OutputDtypes) {
  const HostTensor h = HostTensor::empty(DType::kFloat16, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(h.view(), lse.view()), "out must have dtype float32",
                         "got float16");
  const HostTensor lse_h = HostTensor::empty(DType::kFloat16, {kB, kHq, kS});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(out.view(), lse_h.view()), "lse must have dtype float32",
                         "got float16");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), h.view(), lse.view(), dq.view(), dk.view(), dv.view()),
                         "dout must have dtype float32");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), h.view(), dk.view(), dv.view()),
                         "dq must have dtype float32");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse_h.view(), dq.view(), dk.view(), dv.view()),
                         "lse must have dtype float32");
}

TEST_F(Validation, AccumulateNeedsFp32Outputs) {
  p.accumulate = true;
  const HostTensor qh = HostTensor::empty(DType::kFloat16, {kB, kS, kHq, kD});
  const HostTensor kh = HostTensor::empty(DType::kFloat16, {kB, kS, kHkv, kD});
  const HostTensor outh = HostTensor::empty(DType::kFloat16, {kB, kS, kHq, kD});
  const HostTensor dkh = HostTensor::empty(DType::kFloat16, {kB, kS, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, attention_forward(qh.view(), kh.view(), kh.view(), outh.view(), lse.view(), p),
                         "out must have dtype float32 (accumulate mode)", "got float16");
  // Backward: out may be fp32 (merged) or q's dtype; dq, dk, dv must be fp32.
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(qh.view(), kh.view(), kh.view(), out.view(), outh.view(), lse.view(),
                                            dq.view(), dkh.view(), dv.view(), p),
                         "dk must have dtype float32 (accumulate mode)");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(qh.view(), kh.view(), kh.view(), out.view(), out.view(), lse.view(),
                                            dq.view(), dk.view(), dv.view(), p),
                         "dout must have dtype float16", "got float32");
}

TEST_F(Validation, OverwriteDkdvNeedsAccumulate) {
  p.overwrite_dkdv = true;
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(q.view(), k.view(), v.view(), out.view(), out.view(), lse.view(),
                                            dq.view(), dk.view(), dv.view(), p),
                         "[attention_backward] overwrite_dkdv needs accumulate mode", "got accumulate=false");
}

TEST_F(Validation, OverwriteOutNeedsAccumulateAndIsTheForwards) {
  p.overwrite_out = true;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, attention_forward(q.view(), k.view(), v.view(), out.view(), lse.view(), p),
                         "[attention_forward] overwrite_out needs accumulate mode", "got accumulate=false");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(q.view(), k.view(), v.view(), out.view(), out.view(), lse.view(),
                                            dq.view(), dk.view(), dv.view(), p),
                         "[attention_backward] overwrite_out and final_out are options of the forward",
                         "got overwrite_out=true");
}

TEST_F(Validation, FinalOut) {
  const HostTensor qh = HostTensor::empty(DType::kFloat16, {kB, kS, kHq, kD});
  const HostTensor kh = HostTensor::empty(DType::kFloat16, {kB, kS, kHkv, kD});
  const HostTensor final = HostTensor::empty(DType::kFloat16, {kB, kS, kHq, kD});
  p.final_out = final.view();
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_forward(qh.view(), kh.view(), kh.view(), out.view(), lse.view(), p),
                         "[attention_forward] final_out needs accumulate mode", "got accumulate=false");
  p.accumulate = true;
  p.final_out = out.view();
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_forward(qh.view(), kh.view(), kh.view(), out.view(), lse.view(), p),
                         "final_out must have dtype float16", "got float32");
  const HostTensor short_final = HostTensor::empty(DType::kFloat16, {kB, kS - 1, kHq, kD});
  p.final_out = short_final.view();
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_forward(qh.view(), kh.view(), kh.view(), out.view(), lse.view(), p),
                         "final_out must have shape (2, 8, 4, 16)", "got (2, 7, 4, 16)");
  p.final_out = final.view();
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(qh.view(), kh.view(), kh.view(), out.view(), qh.view(), lse.view(),
                                            dq.view(), dk.view(), dv.view(), p),
                         "[attention_backward] overwrite_out and final_out are options of the forward",
                         "got a final_out");
}

TEST_F(Validation, BackwardOutMayBeFp32OrInputDtype) {
  const HostTensor qh = HostTensor::empty(DType::kFloat16, {kB, kS, kHq, kD});
  const HostTensor kh = HostTensor::empty(DType::kFloat16, {kB, kS, kHkv, kD});
  const HostTensor bf = HostTensor::empty(DType::kBFloat16, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         attention_backward(qh.view(), kh.view(), kh.view(), bf.view(), qh.view(), lse.view(),
                                            qh.view(), kh.view(), kh.view(), p),
                         "out must have dtype float16 or float32", "got bfloat16");
}

// ---- devices

TEST_F(Validation, MixedDevices) {
  const TensorView k_gpu(k.data(), DType::kFloat32, kCuda, {kB, kS, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), k_gpu, vv()), "k must be on cpu like q, got cuda:0");
  const TensorView v_gpu(v.data(), DType::kFloat32, Device{DeviceType::kCUDA, 1}, {kB, kS, kHkv, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(qv(), kv(), v_gpu), "v must be on cpu like q, got cuda:1");
  const TensorView out_gpu(out.data(), DType::kFloat32, kCuda, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(out_gpu, lse.view()), "out must be on cpu");
  const TensorView lse_gpu(lse.data(), DType::kFloat32, kCuda, {kB, kHq, kS});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(out.view(), lse_gpu), "lse must be on cpu");
  const TensorView dq_gpu(dq.data(), DType::kFloat32, kCuda, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), dq_gpu, dk.view(), dv.view()),
                         "dq must be on cpu");
  const TensorView dout_gpu(dout.data(), DType::kFloat32, kCuda, {kB, kS, kHq, kD});
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout_gpu, lse.view(), dq.view(), dk.view(), dv.view()),
                         "dout must be on cpu");
}

TEST_F(Validation, HostArraysOnTheWrongDevice) {
  std::vector<float> slopes(kHq, 0.5f);
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, kCuda, {kHq});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "alibi_slopes must be on cpu");
  p.alibi_slopes.reset();
  std::vector<int32_t> offsets = {0, 0};
  p.q_seq_offsets = TensorView(offsets.data(), DType::kInt32, kCuda, {kB});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "q_seq_offsets must be on cpu");
  p.q_seq_offsets.reset();
  const HostTensor qp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  const HostTensor kp = HostTensor::empty(DType::kFloat32, {kT, kHkv, kD});
  std::vector<int32_t> cu = {0, 5, 16};
  p.cu_seqlens_q = TensorView(cu.data(), DType::kInt32, kCuda, {3});
  p.cu_seqlens_k = TensorView(cu.data(), DType::kInt32, Device{}, {3});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, attention_forward(qp.view(), kp.view(), kp.view(), qp.view(), lse.view(), p),
                         "cu_seqlens_q must be on cpu", "got cuda:0");
}

// Tensors that claim to be on a GPU. Without CUDA in the build (or without a device) this is an
// error, never a crash. With a GPU present these host pointers would reach a kernel: skipped.
TEST_F(Validation, CudaTensorsWithoutCuda) {
  if (has_cuda()) GTEST_SKIP() << "a CUDA device is present; host pointers must not reach it";
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(dtype));
    // Separate host buffers, so that no argument aliases another.
    std::vector<HostTensor> q_like, k_like;
    for (int i = 0; i < 4; ++i) q_like.push_back(HostTensor::empty(dtype, {kB, kS, kHq, kD}));
    for (int i = 0; i < 4; ++i) k_like.push_back(HostTensor::empty(dtype, {kB, kS, kHkv, kD}));
    auto on_gpu = [&](const HostTensor& t) { return TensorView(t.data(), dtype, kCuda, t.ndim(), t.shape().data()); };
    const TensorView qg = on_gpu(q_like[0]), outg = on_gpu(q_like[1]), doutg = on_gpu(q_like[2]),
                     dqg = on_gpu(q_like[3]);
    const TensorView kg = on_gpu(k_like[0]), vg = on_gpu(k_like[1]), dkg = on_gpu(k_like[2]), dvg = on_gpu(k_like[3]);
    const TensorView lg(lse.data(), DType::kFloat32, kCuda, {kB, kHq, kS});
    EXPECT_RINGFLASH_ERROR(NotSupported, attention_forward(qg, kg, vg, outg, lg, p), "attention_forward");
    EXPECT_RINGFLASH_ERROR(NotSupported, attention_backward(qg, kg, vg, outg, doutg, lg, dqg, dkg, dvg, p),
                           "attention_backward");
    const Support s = attention_support(qg, kg, vg, p);
    EXPECT_FALSE(s.supported);
    EXPECT_EQ(s.backend, "cuda");
    EXPECT_NE(s.reason.find("CUDA"), std::string::npos) << s.reason;
  }
}

// ---- strides

TEST_F(Validation, HeadDimMustBeContiguous) {
  const HostTensor wide = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, 2 * kD});
  const TensorView q_strided(wide.data(), DType::kFloat32, Device{}, {kB, kS, kHq, kD},
                             {kS * kHq * 2 * kD, kHq * 2 * kD, 2 * kD, 2});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(q_strided, kv(), vv()),
                         "q must be contiguous in its last dimension (head_dim), got stride 2");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(q_strided, lse.view()),
                         "out must be contiguous in its last dimension", "got stride 2");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), q_strided, dk.view(), dv.view()),
                         "dq must be contiguous in its last dimension");
  const HostTensor lse_wide = HostTensor::empty(DType::kFloat32, {kB, kHq, 2 * kS});
  const TensorView lse_strided(lse_wide.data(), DType::kFloat32, Device{}, {kB, kHq, kS}, {kHq * 2 * kS, 2 * kS, 2});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(out.view(), lse_strided),
                         "lse must be contiguous in its last dimension", "got stride 2");
}

TEST_F(Validation, OtherStridesAreFree) {
  // q, k, v as slices of one qkv-packed (B, S, Hq + 2 Hkv, D) buffer.
  const HostTensor qkv = HostTensor::empty(DType::kFloat32, {kB, kS, kHq + 2 * kHkv, kD});
  const int64_t row = (kHq + 2 * kHkv) * kD;
  const TensorView qs(qkv.data(), DType::kFloat32, Device{}, {kB, kS, kHq, kD}, {kS * row, row, kD, 1});
  const TensorView ks(static_cast<float*>(qkv.data()) + kHq * kD, DType::kFloat32, Device{}, {kB, kS, kHkv, kD},
                      {kS * row, row, kD, 1});
  const TensorView vs(static_cast<float*>(qkv.data()) + (kHq + kHkv) * kD, DType::kFloat32, Device{}, {kB, kS, kHkv, kD},
                      {kS * row, row, kD, 1});
  const Support s = attention_support(qs, ks, vs, p);
  EXPECT_TRUE(s.supported) << s.reason;
}

// ---- cu_seqlens

class PackedValidation : public Validation {
 protected:
  HostTensor qp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  HostTensor kp = HostTensor::empty(DType::kFloat32, {kT, kHkv, kD});
  HostTensor outp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  HostTensor doutp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  HostTensor dqp = HostTensor::empty(DType::kFloat32, {kT, kHq, kD});
  HostTensor dkp = HostTensor::empty(DType::kFloat32, {kT, kHkv, kD});
  HostTensor dvp = HostTensor::empty(DType::kFloat32, {kT, kHkv, kD});
  HostTensor lsep = HostTensor::empty(DType::kFloat32, {kHq, kT});
  std::vector<int32_t> cu_q = {0, 5, 16}, cu_k = {0, 7, 16};

  void set(const std::vector<int32_t>& q_, const std::vector<int32_t>& k_) {
    cu_q = q_;
    cu_k = k_;
    p.cu_seqlens_q = TensorView(cu_q.data(), DType::kInt32, Device{}, {static_cast<int64_t>(cu_q.size())});
    p.cu_seqlens_k = TensorView(cu_k.data(), DType::kInt32, Device{}, {static_cast<int64_t>(cu_k.size())});
  }
  void forward_packed() const { attention_forward(qp.view(), kp.view(), kp.view(), outp.view(), lsep.view(), p); }
  void backward_packed() const {
    attention_backward(qp.view(), kp.view(), kp.view(), outp.view(), doutp.view(), lsep.view(), dqp.view(),
                       dkp.view(), dvp.view(), p);
  }
};

TEST_F(PackedValidation, BaselineIsValid) {
  set({0, 5, 16}, {0, 7, 16});
  EXPECT_TRUE(attention_support(qp.view(), kp.view(), kp.view(), p).supported);
  set({0, 0, 16}, {0, 16, 16});  // empty documents are fine
  EXPECT_TRUE(attention_support(qp.view(), kp.view(), kp.view(), p).supported);
  set({0, 3, 10}, {0, 7, 12});  // ending before T is fine
  EXPECT_TRUE(attention_support(qp.view(), kp.view(), kp.view(), p).supported);
}

TEST_F(PackedValidation, Decreasing) {
  set({0, 9, 4}, {0, 7, 16});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q must be non-decreasing",
                         "cu_seqlens_q[1] = 9 > cu_seqlens_q[2] = 4");
  set({0, 5, 16}, {0, 7, 6});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward_packed(), "[attention_backward]",
                         "cu_seqlens_k must be non-decreasing");
}

TEST_F(PackedValidation, NegativeStart) {
  set({-1, 5, 16}, {0, 7, 16});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q[0] must be >= 0", "got -1");
}

TEST_F(PackedValidation, WrongLength) {
  set({0, 5, 16}, {0, 16});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_k must have shape (3,)", "got (2,)");
  set({0}, {0});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q must have shape (B + 1,) with B >= 1",
                         "got (1,)");
  set({0, 5, 16}, {0, 7, 16});
  p.cu_seqlens_q = TensorView(cu_q.data(), DType::kInt32, Device{}, {1, 3});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q must have shape (B + 1,)", "got (1, 3)");
}

TEST_F(PackedValidation, PastTheEnd) {
  set({0, 5, 16}, {0, 7, 20});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_k ends at 20",
                         "past the end of the packed tensor of 16 tokens");
  set({0, 5, 17}, {0, 7, 16});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward_packed(), "cu_seqlens_q ends at 17");
}

TEST_F(PackedValidation, OnlyOneGiven) {
  set({0, 5, 16}, {0, 7, 16});
  p.cu_seqlens_k.reset();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q and cu_seqlens_k must be given together",
                         "got only cu_seqlens_q");
  set({0, 5, 16}, {0, 7, 16});
  p.cu_seqlens_q.reset();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "got only cu_seqlens_k");
}

TEST_F(PackedValidation, WrongDtype) {
  set({0, 5, 16}, {0, 7, 16});
  std::vector<int64_t> cu64 = {0, 5, 16};
  p.cu_seqlens_q = TensorView(cu64.data(), DType::kInt64, Device{}, {3});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q must have dtype int32", "got int64");
}

TEST_F(PackedValidation, NotContiguous) {
  std::vector<int32_t> spread = {0, -1, 5, -1, 16};
  set({0, 5, 16}, {0, 7, 16});
  p.cu_seqlens_q = TensorView(spread.data(), DType::kInt32, Device{}, {3}, {2});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_packed(), "cu_seqlens_q must be contiguous", "got stride 2");
}

// ---- options

TEST_F(Validation, Windows) {
  p.window_left = -2;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "window_left must be >= 0, or -1 for unbounded", "got -2");
  p.window_left = -1;
  p.window_right = -5;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward(), "[attention_backward]", "window_right must be >= 0",
                         "got -5");
  p.window_right = 0;
  EXPECT_TRUE(valid());
}

TEST_F(Validation, SoftmaxScale) {
  p.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "softmax_scale must be finite", "nan");
  p.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward(), "softmax_scale must be finite", "inf");
  p.softmax_scale = 0.0f;
  EXPECT_TRUE(valid());
}

TEST_F(Validation, Softcap) {
  p.softcap = -1.0f;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "softcap must be finite and >= 0", "got -1");
  p.softcap = std::numeric_limits<float>::quiet_NaN();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "softcap must be finite");
  p.softcap = std::numeric_limits<float>::infinity();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward(), "softcap must be finite");
}

TEST_F(Validation, Dropout) {
  p.dropout_p = 0.1f;
  EXPECT_RINGFLASH_ERROR(NotSupported, forward(), "[attention_forward]", "dropout_p", "0.1");
  EXPECT_RINGFLASH_ERROR(NotSupported, backward(), "[attention_backward]", "dropout_p");
  const Support s = attention_support(qv(), kv(), vv(), p);
  EXPECT_FALSE(s.supported);
  EXPECT_NE(s.reason.find("dropout_p"), std::string::npos) << s.reason;
  p.dropout_p = 1.0f;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "dropout_p must be in [0, 1)", "got 1");
  p.dropout_p = -0.5f;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "dropout_p must be in [0, 1)");
  p.dropout_p = std::numeric_limits<float>::quiet_NaN();
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "dropout_p");
}

TEST_F(Validation, NumThreads) {
  p.num_threads = -1;
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "num_threads must be >= 0", "got -1");
}

TEST_F(Validation, AlibiSlopes) {
  std::vector<float> slopes(3 * (kHq + 1), 0.5f);
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, Device{}, {kHq + 1});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "alibi_slopes must have shape (4,) or (2, 4)", "got (5,)");
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, Device{}, {kB + 1, kHq});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward(), "alibi_slopes must have shape (4,) or (2, 4)", "got (3, 4)");
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, Device{}, {1, kB, kHq});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "alibi_slopes must have shape", "got (1, 2, 4)");
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat16, Device{}, {kHq});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "alibi_slopes must have dtype float32", "got float16");
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, Device{}, {kHq}, {2});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "alibi_slopes must be contiguous");
  p.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, Device{}, {kB, kHq});
  EXPECT_TRUE(valid());
}

TEST_F(Validation, SequenceOffsets) {
  std::vector<int32_t> offsets = {0, 0, 0};
  p.q_seq_offsets = TensorView(offsets.data(), DType::kInt32, Device{}, {kB + 1});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward(), "q_seq_offsets must have shape (2,)", "got (3,)");
  p.q_seq_offsets.reset();
  std::vector<int64_t> offsets64 = {0, 0};
  p.k_seq_offsets = TensorView(offsets64.data(), DType::kInt64, Device{}, {kB});
  EXPECT_RINGFLASH_ERROR(InvalidArgument, backward(), "k_seq_offsets must have dtype int32", "got int64");
  p.k_seq_offsets = TensorView(offsets.data(), DType::kInt32, Device{}, {kB});
  EXPECT_TRUE(valid());
}

// ---- aliasing

TEST_F(Validation, OutputsMustNotAliasInputs) {
  EXPECT_RINGFLASH_ERROR(InvalidArgument, forward_out(qv(), lse.view()), "out must not alias q, k or v");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), qv(), dk.view(), dv.view()),
                         "dq must not alias q, k or v");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), dq.view(), kv(), dv.view()),
                         "dk must not alias q, k or v");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), dq.view(), dk.view(), vv()),
                         "dv must not alias q, k or v");
}

// attention.h: dq, dk and dv "may not alias any input", and out, dout and lse are inputs of the
// backward as much as q, k and v are.
TEST_F(Validation, GradientsMustNotAliasAnyInput) {
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), dout.view(), dk.view(), dv.view()),
                         "[attention_backward]", "dq must not alias");
  EXPECT_RINGFLASH_ERROR(InvalidArgument,
                         backward_with(out.view(), dout.view(), lse.view(), out.view(), dk.view(), dv.view()),
                         "[attention_backward]", "dq must not alias");
}

// An empty tensor holds no memory, so one that shares its address with another aliases nothing
// (the strategies carve 0-byte pieces of a workspace at the offset of the next piece).
TEST_F(Validation, EmptyTensorsAliasNothing) {
  const TensorView q0(q.view().data(), DType::kFloat32, Device{}, {kB, 0, kHq, kD});
  const TensorView out0(out.view().data(), DType::kFloat32, Device{}, {kB, 0, kHq, kD});
  const TensorView dout0(dout.view().data(), DType::kFloat32, Device{}, {kB, 0, kHq, kD});
  const TensorView lse0(lse.view().data(), DType::kFloat32, Device{}, {kB, kHq, 0});
  const TensorView dq0(dk.view().data(), DType::kFloat32, Device{}, {kB, 0, kHq, kD});  // at dk's address
  dk.for_each_element([&](int64_t e) { dk.set_element(e, 1.0); });
  attention_backward(q0, kv(), vv(), out0, dout0, lse0, dq0, dk.view(), dv.view(), p);
  bool zero = true;
  dk.for_each_element([&](int64_t e) { zero = zero && dk.at_element(e) == 0.0; });
  EXPECT_TRUE(zero) << "no query sees a key: dk must be written as zeros";
}

// Windows and offsets at the ends of int64 are either refused with an error that names them, or
// give the result they mean; never signed overflow (undefined behaviour: UBSan aborts on it).
TEST_F(Validation, ExtremeWindowsAndOffsets) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const HostTensor* t : {&q, &k, &v}) t->for_each_element([&](int64_t e) { t->set_element(e, normal(rng)); });
  // Each extreme case, and the same mask in small numbers.
  struct Extreme {
    const char* argument;
    void (*set)(AttentionParams&);
    void (*same)(AttentionParams&);
  };
  const Extreme extremes[] = {
      {"window_left", [](AttentionParams& a) { a.window_left = kMax; a.q_offset = -10; },
       [](AttentionParams& a) { a.q_offset = -10; }},
      {"window_right", [](AttentionParams& a) { a.window_right = kMax; a.q_offset = 10; },
       [](AttentionParams& a) { a.q_offset = 10; }},
      {"q_offset", [](AttentionParams& a) { a.q_offset = a.k_offset = kMax - 3; a.causal = true; },
       [](AttentionParams& a) { a.q_offset = a.k_offset = 0; a.causal = true; }},
      {"q_offset", [](AttentionParams& a) { a.q_offset = a.k_offset = kMin + 1; a.window_left = 2; },
       [](AttentionParams& a) { a.q_offset = a.k_offset = 0; a.window_left = 2; }},
      {"k_offset", [](AttentionParams& a) { a.q_offset = 0; a.k_offset = kMax - 100; a.window_left = 5; },
       [](AttentionParams& a) { a.q_offset = 0; a.k_offset = 3 * kS; a.window_left = 5; }},  // keys far right
  };
  for (const Extreme& x : extremes) {
    SCOPED_TRACE(x.argument);
    AttentionParams extreme, plain;
    x.set(extreme);
    x.same(plain);
    const HostTensor want = HostTensor::empty(DType::kFloat32, {kB, kS, kHq, kD});
    const HostTensor want_lse = HostTensor::empty(DType::kFloat32, {kB, kHq, kS});
    attention_forward(qv(), kv(), vv(), want.view(), want_lse.view(), plain);
    try {
      attention_forward(qv(), kv(), vv(), out.view(), lse.view(), extreme);
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(x.argument), std::string::npos) << e.what();
      continue;
    }
    double out_error = 0, lse_error = 0;
    want.for_each_element([&](int64_t e) {
      out_error = std::max(out_error, std::fabs(out.at_element(e) - want.at_element(e)));
    });
    want_lse.for_each_element([&](int64_t e) {
      const double a = lse.at_element(e), b = want_lse.at_element(e);
      lse_error = std::max(lse_error, a == b ? 0.0 : std::fabs(a - b));
    });
    EXPECT_LE(out_error, 1e-6) << "out differs from the same mask in small numbers";
    EXPECT_LE(lse_error, 1e-6) << "lse differs from the same mask in small numbers";
  }
}

// A call that fails validation writes nothing.
TEST_F(Validation, FailedCallsWriteNothing) {
  out.storage()->fill(7.0);
  lse.storage()->fill(7.0);
  const std::vector<unsigned char> out_before = out.storage()->bytes, lse_before = lse.storage()->bytes;
  p.window_left = -3;
  EXPECT_THROW(forward(), InvalidArgument);
  EXPECT_EQ(out.storage()->bytes, out_before);
  EXPECT_EQ(lse.storage()->bytes, lse_before);
  p.window_left = -1;
  const HostTensor bad_lse = HostTensor::empty(DType::kFloat32, {kB, kHq, kS + 1});
  EXPECT_THROW(forward_out(out.view(), bad_lse.view()), InvalidArgument);
  EXPECT_EQ(out.storage()->bytes, out_before);
}

TEST(Support, ReportsTheReason) {
  const HostTensor q = HostTensor::empty(DType::kFloat16, {1, 4, 6, 8});
  const HostTensor k = HostTensor::empty(DType::kFloat16, {1, 4, 4, 8});
  const Support s = attention_support(q.view(), k.view(), k.view(), AttentionParams{});
  EXPECT_FALSE(s.supported);
  EXPECT_EQ(s.backend, "cpu");
  EXPECT_NE(s.reason.find("[attention_support]"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("6 q heads and 4 k/v heads"), std::string::npos) << s.reason;
}

}  // namespace
}  // namespace ringflash::test
