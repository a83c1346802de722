"""The package and the raw bindings: version, capabilities, positions and accumulate mode (what ring
attention builds on), threads."""

import importlib.metadata
import threading

import numpy as np
import pytest
import torch

import ringflash
from ringflash import _C
from reference import ATOL, F64, Shape, attention, make_qkv, max_error


def test_version():
    assert ringflash.__version__ == _C.version() == importlib.metadata.version("ringflash")


def test_build_info():
    info = ringflash.build_info()
    for component in ("version:", "cpu:", "cuda:", "mpi:", "nccl:"):
        assert component in info
    assert isinstance(ringflash.has_cuda(), bool)
    assert isinstance(ringflash.has_mpi(), bool)
    assert isinstance(ringflash.has_nccl(), bool)
    assert ringflash.empty_cache() is None  # without CUDA (or with nothing kept), nothing to give back


def test_exports():
    for name in ringflash.__all__:
        assert hasattr(ringflash, name), name
    assert torch.ops.ringflash.attention_forward.default is not None
    assert torch.ops.ringflash.attention_backward.default is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_overwrite_out_and_final_out(dtype):
    """A ring's first step writing its accumulator (overwrite_out, from NaN) and its last rounding
    the merged rows into a tensor of q's dtype (final_out) give, bit for bit, the merge into an
    empty accumulator rounded afterwards; out is left as the steps before the last left it."""
    shape = Shape(2, 23, 61, 4, 2, 32)
    q, k, v = make_qkv(shape, dtype, seed=23)
    q_pos = shape.seqlen_k - shape.seqlen_q
    blocks = [(20, 45), (0, 20), (45, 61)]

    def run(first_writes, last_rounds):
        out = torch.full(q.shape, float("nan") if first_writes else 0.0)
        lse = torch.full((2, 4, 23), float("nan") if first_writes else float("-inf"))
        final = torch.full(q.shape, float("nan"), dtype=dtype)
        before_last = None
        for i, (start, end) in enumerate(blocks):
            last = i == len(blocks) - 1
            if last:
                before_last = out.clone()
            _C.attention_forward(q, k[:, start:end], v[:, start:end], out, lse, causal=True, q_offset=q_pos,
                                 k_offset=start, accumulate=True, overwrite_out=first_writes and i == 0,
                                 final_out=final if last and last_rounds else None)
        return (final if last_rounds else out.to(dtype)), lse, out, before_last

    merged, merged_lse, _, _ = run(False, False)
    final, lse, out, before_last = run(True, True)
    assert torch.equal(final, merged)
    assert torch.equal(lse, merged_lse)
    assert torch.equal(out, before_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_accumulate_over_key_blocks(causal, dtype):
    """Forward over key blocks merged into an fp32 accumulator, and backward adding into fp32 dq,
    give attention over all keys: the ring step, on one device."""
    shape = Shape(2, 23, 61, 4, 2, 32)
    q, k, v = make_qkv(shape, dtype, seed=21)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(22)).to(dtype)
    q_pos = shape.seqlen_k - shape.seqlen_q  # bottom-right, made explicit
    blocks = [(0, 20), (20, 45), (45, 61)]

    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((2, 4, 23), float("-inf"))
    for start, end in blocks:
        _C.attention_forward(q, k[:, start:end], v[:, start:end], out, lse, causal=causal, q_offset=q_pos,
                             k_offset=start, accumulate=True)
    ref_out, ref_lse = attention(q, k, v, dtype=F64, causal=causal)
    naive_out, _ = attention(q, k, v, dtype=dtype, causal=causal)
    assert max_error(out, ref_out) <= 2 * max_error(naive_out, ref_out) + ATOL[dtype]
    assert max_error(lse, ref_lse) <= ATOL[torch.float32]

    dq = torch.zeros(q.shape, dtype=torch.float32)
    dks, dvs = [], []
    for start, end in blocks:
        dk = torch.zeros(k[:, start:end].shape, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        _C.attention_backward(q, k[:, start:end], v[:, start:end], out, dout, lse, dq, dk, dv, causal=causal,
                              q_offset=q_pos, k_offset=start, accumulate=True)
        dks.append(dk)
        dvs.append(dv)
    xs = [t.to(F64).requires_grad_() for t in (q, k, v)]
    attention(*xs, dtype=F64, causal=causal)[0].backward(dout.to(F64))
    xn = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*xn, dtype=dtype, causal=causal)[0].backward(dout)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), (dq, torch.cat(dks, 1), torch.cat(dvs, 1)),
                                     [x.grad for x in xs], [x.grad for x in xn]):
        err, bound = max_error(got, ref), 2 * max_error(naive, ref) + ATOL[dtype]
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


def test_positions():
    """q_offset / k_offset and the per-sequence q_seq_offsets / k_seq_offsets place the blocks."""
    q, k, v = make_qkv(Shape(2, 9, 13, 2, 2, 16), torch.float32, seed=23)
    offsets = [(30, 25), (2, 0)]  # (q position, k position) of each sequence
    out = torch.empty_like(q)
    lse = torch.empty(2, 2, 9)
    _C.attention_forward(q, k, v, out, lse, causal=True, window_left=6,
                         q_seq_offsets=torch.tensor([o[0] for o in offsets], dtype=torch.int32),
                         k_seq_offsets=torch.tensor([o[1] for o in offsets], dtype=torch.int32))
    for b, (q_pos, k_pos) in enumerate(offsets):
        ref_out, ref_lse = attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], dtype=F64, causal=True, window=(6, -1),
                                     q_pos=q_pos, k_pos=k_pos)
        assert max_error(out[b:b + 1], ref_out) <= ATOL[torch.float32]
        assert max_error(lse[b:b + 1], ref_lse) <= ATOL[torch.float32]
        scalar_out = torch.empty_like(q[b:b + 1])
        _C.attention_forward(q[b:b + 1], k[b:b + 1], v[b:b + 1], scalar_out, torch.empty(1, 2, 9), causal=True,
                             window_left=6, q_offset=q_pos, k_offset=k_pos)
        assert torch.equal(scalar_out, out[b:b + 1])


def test_threads():
    """The GIL is released around compute: calls from several Python threads run and agree."""
    q, k, v = make_qkv(Shape(1, 300, 300, 4, 4, 64), torch.float32, seed=24)
    expected = ringflash.flash_attn_func(q, k, v, causal=True)
    results = [None] * 4

    def work(i):
        out = torch.empty_like(q)
        _C.attention_forward(q, k, v, out, torch.empty(1, 4, 300), causal=True, num_threads=1)
        results[i] = out

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in results:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_numpy_inputs():
    """Any DLPack or buffer-protocol array works, not only torch tensors."""
    q, k, v = (t.numpy() for t in make_qkv(Shape(1, 5, 7, 2, 1, 8), torch.float32, seed=25))
    out = np.empty_like(q)
    lse = np.empty((1, 2, 5), np.float32)
    _C.attention_forward(q, k, v, out, lse, causal=True)
    ref_out, ref_lse = attention(*(torch.from_numpy(t) for t in (q, k, v)), dtype=F64, causal=True)
    assert max_error(torch.from_numpy(out), ref_out) <= ATOL[torch.float32]
    assert max_error(torch.from_numpy(lse), ref_lse) <= ATOL[torch.float32]
