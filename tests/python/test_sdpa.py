"""Cross-checks against torch.nn.functional.scaled_dot_product_attention where it has the option.

SDPA in float64 first checks the reference itself (out and gradients), then serves as a second
reference for ringflash under the same pass rule. SDPA's is_causal is top-left aligned, so causal
cases have Sq == Sk; GQA uses enable_gqa.
"""

import pytest
import torch
import torch.nn.functional as F

import ringflash
from reference import (ATOL, F64, Shape, assert_pass_rule, attention, make_qkv, max_error, rounded_randn)

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

CASES = [
    (Shape(2, 17, 17, 4, 4, 64), False),
    (Shape(2, 17, 17, 4, 4, 64), True),
    (Shape(1, 33, 129, 8, 2, 128), False),
    (Shape(1, 257, 257, 4, 1, 40), True),
    (Shape(2, 1, 1, 4, 1, 64), True),
]


def sdpa(q, k, v, causal, scale=None):
    """(B, S, H, D) in, (B, S, H, D) out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def outputs_and_grads(fn, inputs, dout):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out.backward(dout.to(out.dtype))
    return [out] + [x.grad for x in xs]


NAMES = ["out", "dq", "dk", "dv"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}")
def test_reference_matches_sdpa(case):
    shape, causal = case
    q, k, v = (t.to(F64) for t in make_qkv(shape, torch.float32, seed=11))
    dout = torch.randn(q.shape, dtype=F64, generator=torch.Generator().manual_seed(12))
    ours = outputs_and_grads(lambda q, k, v: attention(q, k, v, dtype=F64, causal=causal)[0], [q, k, v], dout)
    theirs = outputs_and_grads(lambda q, k, v: sdpa(q, k, v, causal), [q, k, v], dout)
    for name, a, b in zip(NAMES, ours, theirs):
        assert max_error(a, b) < 1e-12, f"{name}: reference and SDPA differ by {max_error(a, b)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}")
def test_ringflash_matches_sdpa(case, dtype):
    """SDPA in float64 as the reference, SDPA in the test dtype as the naive attention."""
    shape, causal = case
    q, k, v = make_qkv(shape, dtype, seed=13)
    dout = rounded_randn(q.shape, dtype, torch.Generator().manual_seed(14))
    got = outputs_and_grads(lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=causal), [q, k, v], dout)
    ref = outputs_and_grads(lambda q, k, v: sdpa(q, k, v, causal), [t.to(F64) for t in (q, k, v)], dout)
    naive = outputs_and_grads(lambda q, k, v: sdpa(q, k, v, causal), [q, k, v], dout)
    for name, a, b, c in zip(NAMES, got, ref, naive):
        assert_pass_rule(name, a, b, c, dtype)


def test_scale_matches_sdpa():
    q, k, v = make_qkv(Shape(1, 20, 20, 2, 2, 48), torch.float32, seed=15)
    out = ringflash.flash_attn_func(q, k, v, softmax_scale=0.05)
    ref = sdpa(q.to(F64), k.to(F64), v.to(F64), False, scale=0.05)
    assert max_error(out, ref) <= ATOL[torch.float32]
