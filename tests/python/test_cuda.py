"""CUDA tensors through the bindings: device mapping, the stream argument, and the kernels against
the float64 reference (computed on the CPU). Skipped without a CUDA device and a CUDA build.

Until the CUDA kernels exist, the kernel tests here fail with NotSupported("... not implemented
yet"), on purpose: they are what the CUDA kernels must pass.
"""

import pytest
import torch

import ringflash
from ringflash import _C
from reference import AWKWARD_SHAPES, VARLEN_LENGTHS, attention, attention_varlen, compare_with_reference, \
    cu_seqlens, make_qkv, rounded_randn

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ringflash.has_cuda()),
                                reason="needs a CUDA device and ringflash built with CUDA")

DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def test_devices():
    q, k, v = (t.cuda() for t in make_qkv(AWKWARD_SHAPES[2], torch.bfloat16))
    with pytest.raises(ringflash.InvalidArgument, match=r"k must be on cuda:0 like q, got cpu"):
        ringflash.flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ringflash.InvalidArgument, match=r"alibi_slopes must be on cuda:0 like q, got cpu"):
        ringflash.flash_attn_func(q, k, v, alibi_slopes=torch.ones(q.shape[2]))
    with pytest.raises(ringflash.NotSupported, match=r"float32 is supported on CPU only"):
        ringflash.flash_attn_func(q.float(), k.float(), v.float())
    assert ringflash.attention_support(q, k, v, causal=True) == (True, "cuda", "")


def on_cuda(fn):
    """Runs fn on copies of its inputs on the GPU; results come back to the CPU, gradients too."""
    def run(*inputs):
        return tuple(t.cpu() for t in fn(*(t.cuda() for t in inputs)))
    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_shapes(shape, causal, dtype):
    q, k, v = make_qkv(shape, dtype)
    compare_with_reference(
        on_cuda(lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)),
        lambda q, k, v, dtype: attention(q, k, v, dtype=dtype, causal=causal), [q, k, v], dtype)


@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=lambda lens: f"q{lens[0]}-k{lens[1]}")
def test_varlen(lengths):
    lengths_q, lengths_k = lengths
    g = torch.Generator().manual_seed(1)
    q = rounded_randn((sum(lengths_q), 4, 64), torch.bfloat16, g)
    k = rounded_randn((sum(lengths_k), 2, 64), torch.bfloat16, g)
    v = rounded_randn((sum(lengths_k), 2, 64), torch.bfloat16, g)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    run = on_cuda(lambda q, k, v: ringflash.flash_attn_varlen_func(
        q, k, v, cu_q.cuda(), cu_k.cuda(), max(lengths_q), max(lengths_k), causal=True, return_softmax_lse=True))
    compare_with_reference(run, lambda q, k, v, dtype: attention_varlen(q, k, v, cu_q, cu_k, dtype=dtype, causal=True),
                           [q, k, v], torch.bfloat16)


def test_side_stream():
    """A call on a side stream runs on torch's current stream there, and the result is ready after it."""
    q, k, v = (t.cuda() for t in make_qkv(AWKWARD_SHAPES[3], torch.bfloat16))
    expected = ringflash.flash_attn_func(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = torch.empty_like(q)
        _C.attention_forward(q, k, v, out, torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda"),
                             causal=True, stream=stream.cuda_stream)
    stream.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
