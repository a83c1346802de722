"""flash_attn_func against the float64 reference: out, lse and every gradient, over the awkward
shapes, every dtype and every option."""

import pytest
import torch

import ringflash
from reference import (AWKWARD_SHAPES, DTYPES, Shape, alibi_slopes, attention, compare_with_reference,
                       make_qkv)

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def run_flash(**options):
    def run(q, k, v, *extra):
        if extra:
            options["alibi_slopes"] = extra[0]
        return ringflash.flash_attn_func(q, k, v, return_softmax_lse=True, **options)
    return run


def run_reference(causal=False, window_size=(-1, -1), **options):
    def reference(q, k, v, *extra, dtype):
        alibi = extra[0] if extra else None
        return attention(q, k, v, dtype=dtype, causal=causal, window=window_size, alibi=alibi, **options)
    return reference


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_shapes(shape, causal, dtype):
    q, k, v = make_qkv(shape, dtype)
    compare_with_reference(run_flash(causal=causal), run_reference(causal=causal), [q, k, v], dtype)


# Each option on shapes where it matters: Sq < Sk and Sq > Sk (bottom-right alignment), GQA 2.
OPTION_SHAPES = [Shape(2, 37, 91, 4, 2, 64), Shape(1, 91, 37, 4, 2, 32)]
OPTIONS = {
    "scale": dict(softmax_scale=0.3),
    "window-left": dict(window_size=(16, -1)),
    "window-right": dict(window_size=(-1, 5)),
    "window-both": dict(window_size=(7, 3)),
    "window-zero": dict(window_size=(0, 0)),
    "causal-window": dict(causal=True, window_size=(20, 9)),
    "softcap": dict(softcap=2.0, softmax_scale=0.5),
    "causal-softcap": dict(causal=True, softcap=1.5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(name, shape, dtype):
    options = OPTIONS[name]
    q, k, v = make_qkv(shape, dtype, seed=3)
    compare_with_reference(run_flash(**options), run_reference(**options), [q, k, v], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=str)
def test_alibi(shape, causal, per_batch, dtype):
    q, k, v = make_qkv(shape, dtype, seed=4)
    slopes = alibi_slopes(shape.heads_q, shape.batch if per_batch else None)
    compare_with_reference(run_flash(causal=causal), run_reference(causal=causal), [q, k, v, slopes], dtype)
    # ALiBi slopes are constants: no gradient reaches them, even when they ask for one.
    q.requires_grad_(True)
    slopes.requires_grad_(True)
    ringflash.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes).sum().backward()
    assert q.grad is not None and slopes.grad is None


def test_long_causal():
    """The one case at length 4097: causal, bf16, forward and backward."""
    shape = Shape(1, 4097, 4097, 2, 1, 64)
    q, k, v = make_qkv(shape, torch.bfloat16, seed=5)
    compare_with_reference(run_flash(causal=True), run_reference(causal=True), [q, k, v], torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_rows_without_keys(dtype):
    """Causal with Sq > Sk: the first Sq - Sk queries see no key; out = 0, lse = -inf, gradients 0,
    no NaN anywhere."""
    q, k, v = make_qkv(Shape(1, 9, 4, 2, 2, 16), dtype, seed=6)
    q.requires_grad_(True)
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert torch.all(out[:, :5] == 0)
    assert torch.all(lse[:, :, :5] == float("-inf"))
    assert torch.isfinite(lse[:, :, 5:]).all()
    out.sum().backward()
    assert torch.all(q.grad[:, :5] == 0)
    assert torch.isfinite(q.grad).all()


def test_no_keys():
    """Sk = 0: every row sees nothing."""
    q = torch.randn(2, 5, 2, 8)
    k = torch.randn(2, 0, 2, 8)
    out, lse = ringflash.flash_attn_func(q, k, k, return_softmax_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_empty_queries():
    q = torch.randn(2, 0, 2, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    out, lse = ringflash.flash_attn_func(q, k, k, return_softmax_lse=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)
    out.sum().backward()
    assert torch.all(k.grad == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_strided_inputs(dtype):
    """Inputs that are strided everywhere but in D (a (B, H, S, D) tensor transposed, slices of wider
    tensors) give the same results as contiguous copies."""
    shape = Shape(2, 33, 45, 4, 2, 24)
    q, k, v = make_qkv(shape, dtype, seed=7)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) memory
    k_wide = torch.cat([k, torch.zeros_like(k)], dim=2)
    k_strided = k_wide[:, :, : shape.heads_kv]  # head stride and row stride of a wider tensor
    v_strided = torch.cat([v, torch.zeros_like(v)], dim=3)[..., : shape.head_dim]  # row stride 2 D
    assert not any(t.is_contiguous() for t in (q_strided, k_strided, v_strided))
    ref_out, ref_lse = ringflash.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    out, lse = ringflash.flash_attn_func(q_strided, k_strided, v_strided, causal=True, return_softmax_lse=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_deterministic_backward():
    shape = Shape(2, 130, 130, 4, 1, 64)
    q, k, v = make_qkv(shape, torch.bfloat16, seed=8)
    grads = []
    for _ in range(2):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ringflash.flash_attn_func(*xs, causal=True, deterministic=True)
        out.backward(torch.ones_like(out))
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_return_values():
    q, k, v = make_qkv(Shape(2, 7, 9, 4, 2, 16), torch.float32)
    out = ringflash.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse, probs = ringflash.flash_attn_func(q, k, v, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    out3, lse3 = ringflash.flash_attn_func(q, k, v, return_softmax_lse=True)
    assert torch.equal(out, out2) and torch.equal(out, out3) and torch.equal(lse, lse3)
    assert len(ringflash.flash_attn_func(q, k, v, return_attn_probs=True, return_softmax_lse=True)) == 3


def test_lse_has_no_gradient():
    q, k, v = (t.requires_grad_() for t in make_qkv(Shape(1, 4, 4, 2, 2, 8), torch.float32))
    out, lse = ringflash.flash_attn_func(q, k, v, return_softmax_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_packed_variants():
    """The qkv- and kv-packed functions are the unpacked ones on views, gradients included."""
    shape = Shape(2, 19, 19, 4, 4, 32)
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 19, 3, 4, 32, generator=g, requires_grad=True)
    out = ringflash.flash_attn_qkvpacked_func(qkv, causal=True)
    out.sum().backward()
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    ref = ringflash.flash_attn_func(q, k, v, causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2), rtol=0, atol=0)

    kv = torch.stack([k.detach(), v.detach()], dim=2)
    out_kv = ringflash.flash_attn_kvpacked_func(q.detach(), kv, causal=True)
    torch.testing.assert_close(out_kv, ref, rtol=0, atol=0)
    assert shape.seqlen_q == out_kv.shape[1]
