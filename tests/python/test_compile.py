"""torch.compile(fullgraph=True) traces the custom ops, forward and backward, and the fake
implementations give the real shapes, dtypes and strides."""

import pytest
import torch
from torch.library import opcheck

import ringflash
from reference import Shape, cu_seqlens, make_qkv


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def eager_and_compiled(fn, inputs, backend):
    """(out, grads) of fn eagerly and compiled with fullgraph=True, for the loss sum(out * w)."""
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    results = []
    for f in (fn, compiled):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = f(*xs)
        out = out[0] if isinstance(out, tuple) else out
        weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
        (out * weight).sum().backward()
        results.append((out.detach(), [x.grad for x in xs if x.requires_grad]))
    return results


def assert_same(eager, compiled):
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for a, b in zip(eager[1], compiled[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flash_attn_func(backend):
    q, k, v = make_qkv(Shape(2, 31, 47, 4, 2, 32), torch.bfloat16, seed=1)
    slopes = torch.rand(4)

    def fn(q, k, v):
        out, lse = ringflash.flash_attn_func(q * 1.5, k, v, causal=True, window_size=(9, 0), softcap=4.0,
                                             alibi_slopes=slopes, return_softmax_lse=True)
        return out.float() + lse.transpose(1, 2)[..., None]

    assert_same(*eager_and_compiled(fn, [q, k, v], backend))


def test_eager_calls_skip_the_dispatch():
    """Eager calls run the op's implementation under an autograd.Function of their own; the result
    and gradients are the op's, bit for bit."""
    q, k, v = make_qkv(Shape(2, 33, 20, 4, 2, 16), torch.float32, seed=3)
    options = (None, None, None, None, True, -1, -1, 0.0, 0.0, False)
    grad_fns, results = [], []
    for f in (ringflash.ops.attention, torch.ops.ringflash.attention_forward):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = f(*xs, *options)
        grad_fns.append(type(out.grad_fn).__name__)
        weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        (out * weight).sum().backward()
        results.append((out.detach(), [x.grad for x in xs]))
    eager, op = results
    assert grad_fns[0] == "AttentionBackward" and grad_fns[1] != grad_fns[0]
    assert_same(eager, op)
    with torch.no_grad():
        out, _ = ringflash.ops.attention(q, k, v, *options)
    assert out.grad_fn is None
    torch.testing.assert_close(out, eager[0], rtol=0, atol=0)


def test_flash_attn_varlen_func():
    lengths_q, lengths_k = [7, 0, 12], [9, 3, 12]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lengths_q), 4, 16, generator=g)
    k = torch.randn(sum(lengths_k), 1, 16, generator=g)
    v = torch.randn(sum(lengths_k), 1, 16, generator=g)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)

    def fn(q, k, v):
        return ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True)

    assert_same(*eager_and_compiled(fn, [q, k, v], "aot_eager"))


def test_inductor():
    """The default backend, around the ops: a projection before, a reduction after."""
    q, k, v = make_qkv(Shape(1, 16, 16, 2, 2, 16), torch.float32, seed=3)

    def fn(q, k, v):
        return torch.relu(ringflash.flash_attn_func(torch.tanh(q), k, v, causal=True)).sum(dim=-1)

    eager, compiled = eager_and_compiled(fn, [q, k, v], "inductor")
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(eager[1], compiled[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_dynamic_shapes():
    """One compiled graph serves several sequence lengths."""
    compiled = torch.compile(lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=True), backend="aot_eager",
                             fullgraph=True, dynamic=True)
    for i, seqlen in enumerate((5, 9, 23)):
        q, k, v = make_qkv(Shape(1, seqlen, seqlen, 2, 1, 8), torch.float32, seed=seqlen)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(q, k, v)
        torch.testing.assert_close(out, ringflash.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


def _forward_args(q, k, v, cu_q=None, cu_k=None, slopes=None, causal=True):
    return (q, k, v, cu_q, cu_k, slopes, None, causal, -1, -1, 0.0, 0.0, False)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_opcheck(packed):
    """torch.library.opcheck: schema, fake implementation, autograd registration, AOT dispatch."""
    g = torch.Generator().manual_seed(4)
    if packed:
        q, k, v = (torch.randn(20, 4, 8, generator=g) for _ in range(3))
        cu = cu_seqlens([12, 0, 8])
        args = _forward_args(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu)
    else:
        q, k, v = (torch.randn(2, 10, 4, 8, generator=g, requires_grad=True) for _ in range(3))
        args = _forward_args(q, k, v, slopes=torch.rand(4))
    opcheck(torch.ops.ringflash.attention_forward.default, args)
    out, lse = torch.ops.ringflash.attention_forward(*args)
    dout = torch.randn(out.shape, generator=g)
    opcheck(torch.ops.ringflash.attention_backward.default,
            (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse) + args[3:])


def test_meta_tensors():
    """On the meta device the ops run their fake implementations: shapes and dtypes, no kernel."""
    q = torch.empty(2, 5, 4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 7, 2, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = ringflash.flash_attn_func(q, k, k, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and k.grad.dtype == torch.bfloat16

    qp = torch.empty(12, 4, 8, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = ringflash.flash_attn_varlen_func(qp, qp[:, :1], qp[:, :1], cu, cu, 6, 6, return_softmax_lse=True)
    assert out.shape == (12, 4, 8) and lse.shape == (4, 12)
