"""flash_attn_varlen_func on packed batches (empty documents included) against the float64
reference, run document by document."""

import pytest
import torch

import ringflash
from reference import (VARLEN_LENGTHS, alibi_slopes, attention_varlen, compare_with_reference, cu_seqlens,
                       rounded_randn)

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, seed=0, tail=0):
    """q (Tq + tail, Hq, D), k and v (Tk, Hkv, D); `tail` rows of q belong to no sequence."""
    g = torch.Generator().manual_seed(seed)
    q = rounded_randn((sum(lengths_q) + tail, heads_q, head_dim), dtype, g)
    k = rounded_randn((sum(lengths_k), heads_kv, head_dim), dtype, g)
    v = rounded_randn((sum(lengths_k), heads_kv, head_dim), dtype, g)
    return q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k)


def run_varlen(cu_q, cu_k, lengths_q, lengths_k, **options):
    def run(q, k, v, *extra):
        if extra:
            options["alibi_slopes"] = extra[0]
        return ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                return_softmax_lse=True, **options)
    return run


def reference_varlen(cu_q, cu_k, causal=False, window_size=(-1, -1), **options):
    def reference(q, k, v, *extra, dtype):
        alibi = extra[0] if extra else None
        return attention_varlen(q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window_size, alibi=alibi,
                                **options)
    return reference


OPTIONS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(6, 2)),
    "causal-softcap": dict(causal=True, softcap=3.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=lambda lens: f"q{lens[0]}-k{lens[1]}")
def test_varlen(lengths, name, dtype):
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, 4, 2, 64, dtype, seed=1)
    options = OPTIONS[name]
    compare_with_reference(run_varlen(cu_q, cu_k, lengths_q, lengths_k, **options),
                           reference_varlen(cu_q, cu_k, **options), [q, k, v], dtype)


@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch"])
def test_varlen_alibi(per_batch):
    lengths_q, lengths_k = VARLEN_LENGTHS[1]
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, 4, 4, 32, torch.float32, seed=2)
    slopes = alibi_slopes(4, len(lengths_q) if per_batch else None)
    compare_with_reference(run_varlen(cu_q, cu_k, lengths_q, lengths_k, causal=True),
                           reference_varlen(cu_q, cu_k, causal=True), [q, k, v, slopes], torch.float32)


def test_varlen_mqa_odd_head_dim():
    lengths_q, lengths_k = VARLEN_LENGTHS[0]
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, 8, 1, 40, torch.bfloat16, seed=3)
    compare_with_reference(run_varlen(cu_q, cu_k, lengths_q, lengths_k, causal=True),
                           reference_varlen(cu_q, cu_k, causal=True), [q, k, v], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_rows_outside_the_sequences(dtype):
    """cu_seqlens need not start at 0 nor end at T: rows of q outside the sequences get out 0 and
    lse -inf, rows of q, k and v outside get gradient 0."""
    g = torch.Generator().manual_seed(4)
    q = rounded_randn((15, 2, 16), dtype, g)
    k = rounded_randn((14, 2, 16), dtype, g)
    v = rounded_randn((14, 2, 16), dtype, g)
    cu_q = torch.tensor([2, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([1, 5, 9], dtype=torch.int32)
    compare_with_reference(run_varlen(cu_q, cu_k, [3, 7], [4, 4], causal=True),
                           reference_varlen(cu_q, cu_k, causal=True), [q, k, v], dtype)


def test_varlen_matches_padded():
    """Equal-length documents packed give what the padded batch gives."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 21, 4, 32, generator=g)
    k = torch.randn(3, 29, 2, 32, generator=g)
    v = torch.randn(3, 29, 2, 32, generator=g)
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    cu_q, cu_k = cu_seqlens([21] * 3), cu_seqlens([29] * 3)
    out_p, lse_p = ringflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                                    21, 29, causal=True, return_softmax_lse=True)
    torch.testing.assert_close(out_p, out.flatten(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_p, lse.permute(1, 0, 2).flatten(1), rtol=1e-6, atol=1e-6)


def test_varlen_packed_variants():
    lengths = [9, 0, 14]
    cu = cu_seqlens(lengths)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(sum(lengths), 3, 4, 16, generator=g, requires_grad=True)
    out = ringflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    out.sum().backward()
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(1))
    ref = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=1), rtol=0, atol=0)
    kv = torch.stack([k.detach(), v.detach()], dim=1)
    out_kv = ringflash.flash_attn_varlen_kvpacked_func(q.detach(), kv, cu, cu, max(lengths), max(lengths),
                                                       causal=True)
    torch.testing.assert_close(out_kv, ref, rtol=0, atol=0)
