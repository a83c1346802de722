"""Bad input: each case raises a ringflash error whose message names the argument and what came,
and nothing crashes."""

import re

import numpy as np
import pytest
import torch

import ringflash
from ringflash import _C

Invalid = ringflash.InvalidArgument
Unsupported = ringflash.NotSupported


def qkv(b=2, sq=8, sk=8, hq=4, hkv=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, hq, d, generator=g).to(dtype), torch.randn(b, sk, hkv, d, generator=g).to(dtype),
            torch.randn(b, sk, hkv, d, generator=g).to(dtype))


def packed(lengths=(3, 5), hq=4, hkv=2, d=16):
    t = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d), cu


def flash(*args, **kwargs):
    return lambda: ringflash.flash_attn_func(*args, **kwargs)


def varlen(q, k, v, cu_q, cu_k, **kwargs):
    return lambda: ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, **kwargs)


def _cases():
    q, k, v = qkv()
    pq, pk, pv, cu = packed()
    yield ("q rank", flash(q[0], k, v), Invalid,
           r"q must have shape \(B, S, H, D\), got \(8, 4, 16\)")
    yield ("k rank", flash(q, k[0], v), Invalid,
           r"k must have shape \(B, S, H, D\)")
    yield ("packed q rank", varlen(q, pk, pv, cu, cu), Invalid,
           r"q must have shape \(T, H, D\)")
    yield ("v shape", flash(q, k, v[:, :5]), Invalid,
           r"v must have k's shape \(2, 8, 2, 16\), got \(2, 5, 2, 16\)")
    yield ("k batch", flash(q, k[:1], v[:1]), Invalid,
           r"k must have q's batch size 2")
    yield ("k head_dim", flash(q, k[..., :8], v[..., :8]), Invalid,
           r"k must have q's head_dim 16")
    yield ("heads", flash(q, k[:, :, :1].expand(2, 8, 3, 16), v[:, :, :1].expand(2, 8, 3, 16)), Invalid,
           r"multiple of the number of k/v heads, got 4 q heads and 3 k/v heads")
    yield ("dtype int", flash(q.to(torch.int32), k, v), Invalid,
           r"q must have dtype float32, float16 or bfloat16, got int32")
    yield ("dtype float64", flash(q.double(), k.double(), v.double()), Invalid,
           r"q must have dtype float32, float16 or bfloat16, got float64")
    yield ("dtype mismatch", flash(q, k.half(), v), Invalid,
           r"k must have q's dtype float32, got float16")
    yield ("dtype unsupported", flash(q, k, v.to(torch.int8)), Invalid,
           r"v must have dtype .* got int8")
    yield ("device k", flash(q, k.to("meta"), v), Invalid,
           r"k must be on cpu like q, got meta")
    yield ("device q", flash(q.to("meta"), k, v), Invalid,
           r"k must be on meta like q, got cpu")
    yield ("strided D", flash(q, k, torch.cat([v, v], -1)[..., ::2]), Invalid,
           r"v must be contiguous in its last dimension \(head_dim\), got stride 2")
    yield ("window < -1", flash(q, k, v, window_size=(-2, 0)), Invalid,
           r"window_left must be >= 0, or -1 for unbounded, got -2")
    yield ("window right < -1", flash(q, k, v, window_size=(3, -5)), Invalid,
           r"window_right must be >= 0, or -1 for unbounded, got -5")
    yield ("window not a pair", flash(q, k, v, window_size=(3,)), Invalid,
           r"window_size must be a pair of ints \(left, right\), got \(3,\)")
    yield ("window float", flash(q, k, v, window_size=(3.5, 0)), Invalid,
           r"window_size must be a pair of ints")
    yield ("scale nan", flash(q, k, v, softmax_scale=float("nan")), Invalid,
           r"softmax_scale must be finite, got nan")
    yield ("scale inf", flash(q, k, v, softmax_scale=float("inf")), Invalid,
           r"softmax_scale must be finite, got inf")
    yield ("softcap", flash(q, k, v, softcap=-1.0), Invalid,
           r"softcap must be finite and >= 0 .*got -1")
    yield ("dropout", flash(q, k, v, dropout_p=0.1), Unsupported,
           r"dropout_p > 0 is not supported yet, got 0.1")
    yield ("dropout range", flash(q, k, v, dropout_p=1.5), Invalid,
           r"dropout_p must be in \[0, 1\), got 1.5")
    yield ("alibi shape", flash(q, k, v, alibi_slopes=torch.ones(3)), Invalid,
           r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(3,\)")
    yield ("alibi dtype", flash(q, k, v, alibi_slopes=torch.ones(4).half()), Invalid,
           r"alibi_slopes must have dtype float32, got float16")
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    yield ("cu_seqlens decreasing", varlen(pq, pk, pv, bad, cu), Invalid,
           r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 5 > cu_seqlens_q\[2\] = 3")
    yield ("cu_seqlens length", varlen(pq, pk, pv, cu, cu[:2]), Invalid,
           r"cu_seqlens_k must have shape \(3,\), got \(2,\)")
    yield ("cu_seqlens too short", varlen(pq, pk, pv, cu[:1], cu[:1]), Invalid,
           r"cu_seqlens_q must have shape \(B \+ 1,\) with B >= 1, got \(1,\)")
    yield ("cu_seqlens past the end", varlen(pq, pk, pv, cu, cu + 1), Invalid,
           r"cu_seqlens_k ends at 9, past the end of the packed tensor of 8 tokens")
    yield ("cu_seqlens negative", varlen(pq, pk, pv, cu - 1, cu), Invalid,
           r"cu_seqlens_q\[0\] must be >= 0, got -1")
    yield ("cu_seqlens dtype", varlen(pq, pk, pv, cu.long(), cu), Invalid,
           r"cu_seqlens_q must have dtype int32, got int64")
    yield ("cu_seqlens 2-D", varlen(pq, pk, pv, cu[None], cu), Invalid,
           r"cu_seqlens_q must have shape \(B \+ 1,\)")
    yield ("block_table", varlen(pq, pk, pv, cu, cu, block_table=torch.zeros(2, 1, dtype=torch.int32)), Unsupported,
           r"block_table \(paged KV cache\) is not supported")
    yield ("max_seqlen", lambda: ringflash.flash_attn_varlen_func(pq, pk, pv, cu, cu, None, 8), Invalid,
           r"max_seqlen_q must be an int, got None")
    yield ("qkvpacked", lambda: ringflash.flash_attn_qkvpacked_func(torch.randn(2, 8, 2, 4, 16)), Invalid,
           r"qkv must have size 3 in dimension 2, got shape \(2, 8, 2, 4, 16\)")


CASES = list(_cases())


@pytest.mark.parametrize("call,error,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        call()
    assert isinstance(info.value, ringflash.Error)
    assert re.match(r"\[\w+\] ", str(info.value)), f"message does not name the op: {info.value}"


def test_error_hierarchy():
    assert issubclass(ringflash.InvalidArgument, ValueError)
    assert issubclass(ringflash.NotSupported, NotImplementedError)
    assert issubclass(ringflash.DeviceError, RuntimeError)
    assert issubclass(ringflash.CommError, RuntimeError)
    for error in (ringflash.InvalidArgument, ringflash.NotSupported, ringflash.DeviceError, ringflash.CommError):
        assert issubclass(error, ringflash.Error)
    assert ringflash.Error is _C.Error


def test_backward_errors_surface():
    """An error in the backward kernel call reaches the caller of backward() with its type."""
    q, k, v = (t.requires_grad_() for t in qkv())
    out = ringflash.flash_attn_func(q, k, v)
    with pytest.raises(ringflash.InvalidArgument, match=r"\[attention_backward\] dout must have dtype float32"):
        torch.ops.ringflash.attention_backward(out.detach().half(), q.detach(), k.detach(), v.detach(), out.detach(),
                                               torch.zeros(2, 4, 8), None, None, None, None, False, -1, -1, 0.0, 0.0,
                                               False)


# The raw bindings: outputs, aliasing, and DLPack conversion.
def forward_raw(q, k, v, out, lse, **kwargs):
    return lambda: _C.attention_forward(q, k, v, out, lse, **kwargs)


def _raw_cases():
    q, k, v = qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 4, 8)
    yield ("out shape", forward_raw(q, k, v, out[:, :4], lse), Invalid,
           r"\[attention_forward\] out must have shape \(2, 8, 4, 16\), got \(2, 4, 4, 16\)")
    yield ("out dtype", forward_raw(q, k, v, out.half(), lse), Invalid,
           r"out must have dtype float32, got float16")
    yield ("out accumulate dtype", forward_raw(q.half(), k.half(), v.half(), out.half(), lse, accumulate=True), Invalid,
           r"out must have dtype float32 \(accumulate mode\), got float16")
    yield ("overwrite_out without accumulate", forward_raw(q, k, v, out, lse, overwrite_out=True), Invalid,
           r"\[attention_forward\] overwrite_out needs accumulate mode .* got accumulate=false")
    yield ("out aliases q", forward_raw(q, k, v, q, lse), Invalid,
           r"out must not alias q, k or v")
    yield ("lse shape", forward_raw(q, k, v, out, lse[:, :, :4]), Invalid,
           r"lse must have shape \(2, 4, 8\), got \(2, 4, 4\)")
    yield ("lse dtype", forward_raw(q, k, v, out, lse.half()), Invalid,
           r"lse must have dtype float32, got float16")
    yield ("numpy int8", forward_raw(np.zeros((2, 8, 4, 16), np.int8), k, v, out, lse), Invalid,
           r"\[attention_forward\] q must have dtype float32, float16, bfloat16, int32, int64 or float64, got int8")
    yield ("numpy bool", forward_raw(q, k, v, out, lse, alibi_slopes=np.zeros(4, bool)), Invalid,
           r"alibi_slopes must have dtype .* got bool")
    yield ("complex", forward_raw(q, k, torch.zeros(2, 8, 2, 16, dtype=torch.complex64), out, lse), Invalid,
           r"v must have dtype .* got complex64")
    yield ("rank 7", forward_raw(torch.zeros(1, 1, 1, 1, 1, 1, 1), k, v, out, lse), Invalid,
           r"q must have at most 6 dimensions, got 7")
    yield ("num_threads", forward_raw(q, k, v, out, lse, num_threads=-1), Invalid,
           r"num_threads must be >= 0")
    yield ("q_seq_offsets", forward_raw(q, k, v, out, lse, q_seq_offsets=torch.zeros(3, dtype=torch.int32)), Invalid,
           r"q_seq_offsets must have shape \(2,\), got \(3,\)")
    cu = torch.tensor([0, 8], dtype=torch.int32)
    yield ("cu_seqlens alone", forward_raw(q[0], k[0], v[0], out[0], lse[0], cu_seqlens_q=cu), Invalid,
           r"cu_seqlens_q and cu_seqlens_k must be given together, got only cu_seqlens_q")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    yield ("dk shape", lambda: _C.attention_backward(q, k, v, out, out, lse, dq, dq, dv), Invalid,
           r"\[attention_backward\] dk must have shape \(2, 8, 2, 16\), got \(2, 8, 4, 16\)")
    yield ("dv dtype", lambda: _C.attention_backward(q, k, v, out, out, lse, dq, dk, dv.half()), Invalid,
           r"dv must have dtype float32, got float16")


RAW_CASES = list(_raw_cases())


@pytest.mark.parametrize("call,error,pattern", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_bad_input_raw(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_non_tensor_arguments():
    """Objects that are not arrays, or options of the wrong type, are TypeErrors from the binding."""
    q, k, v = qkv()
    with pytest.raises(TypeError):
        _C.attention_forward([1.0], k, v, torch.empty_like(q), torch.empty(2, 4, 8))
    with pytest.raises(TypeError):
        _C.attention_forward(q, k, v, torch.empty_like(q), torch.empty(2, 4, 8), causal="yes")
    with pytest.raises(TypeError):  # options are keyword-only
        _C.attention_forward(q, k, v, torch.empty_like(q), torch.empty(2, 4, 8), None, True)


def test_read_only_output():
    q, k, v = (t.numpy() for t in qkv())
    out = np.empty_like(q)
    out.flags.writeable = False
    with pytest.raises(TypeError):
        _C.attention_forward(q, k, v, out, np.empty((2, 4, 8), np.float32))


def test_support_reports_the_reason():
    q, k, v = qkv()
    assert ringflash.attention_support(q, k, v, causal=True) == (True, "cpu", "", "cpu")
    supported, backend, reason, kernels = ringflash.attention_support(q, k, v.half())
    assert not supported and backend == "cpu" and "v must have q's dtype float32, got float16" in reason
    assert kernels == ""
    support = ringflash.attention_support(q, k, v, dropout_p=0.5)
    assert not support.supported and "dropout_p > 0 is not supported" in support.reason
