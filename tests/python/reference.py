"""Shared by the Python tests: the reference attention, the tolerance table, the awkward shapes and
the comparison that applies the pass rule.

Reference: naive attention with explicit index masks, computed in float64 on inputs that are already
rounded to the test dtype. Pass rule (DESIGN.md): for each of out, lse, dq, dk, dv,

    max |ringflash - reference| <= 2 * max |naive - reference| + ATOL[dtype],

where "naive" is the same naive attention computed in the test dtype (GRAD_ATOL[dtype] for dq, dk
and dv). The lse is float32 whatever the input dtype, so it is held to the float32 rule: naive
attention computed in float32 and ATOL[float32].
"""

import dataclasses
import math
import os
import re
from typing import Callable, List, Optional, Sequence, Tuple

import torch

F64 = torch.float64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tolerance_table():
    """The one tolerance table, tests/cpp/tolerance.h: the absolute terms of the pass rule per test
    dtype, as {dtype: (out, lse, grad)}."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpp", "tolerance.h")
    with open(path) as f:
        text = f.read()
    number = r"([0-9.eE+-]+)"
    row = r"return \{" + r",\s*".join([number] * 3) + r"\};"
    table = {}
    for name, dtype in (("case DType::kFloat16:", torch.float16), ("case DType::kBFloat16:", torch.bfloat16),
                        ("default:", torch.float32)):
        m = re.search(re.escape(name) + r"\s*" + row, text)
        if m is None:
            raise RuntimeError(f"{path}: no line '{name} return {{out, lse, grad}};' to read the tolerances from")
        table[dtype] = tuple(float(x) for x in m.groups())
    return table


TOLERANCE = _tolerance_table()
# The absolute term of out (and, at float32, of the lse), and that of dq, dk and dv. A float32
# gradient sums a term per row, so its rounding grows with the rows: ulysses at P=4 over 1013
# rows (dv, values up to about 5) lands near 1.9e-5 on some CPUs.
ATOL = {dtype: t[0] for dtype, t in TOLERANCE.items()}
GRAD_ATOL = {dtype: t[2] for dtype, t in TOLERANCE.items()}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int

    def __str__(self):
        return (f"B{self.batch}-Sq{self.seqlen_q}-Sk{self.seqlen_k}-H{self.heads_q}/{self.heads_kv}"
                f"-D{self.head_dim}")


# Shapes that break kernels: lengths 1, 17 and 1013, Sq != Sk both ways, GQA ratios 1, 4 and H (MQA),
# head dims 64, 128 and odd ones. 4097 runs in one case of its own (test_attention.py), to keep the
# suite fast on two cores.
AWKWARD_SHAPES = [
    Shape(1, 1, 1, 4, 4, 64),
    Shape(2, 1, 17, 4, 1, 128),
    Shape(2, 17, 17, 4, 1, 64),
    Shape(1, 17, 1013, 8, 2, 128),
    Shape(1, 1013, 17, 4, 4, 40),
    Shape(1, 1013, 1013, 4, 1, 72),
]

# Packed batches: (lengths of the q sequences, lengths of the k sequences). Empty documents in q,
# in k, and in both.
VARLEN_LENGTHS = [
    ([17, 0, 1, 33], [17, 0, 1, 33]),
    ([5, 13, 0, 40], [9, 13, 7, 0]),
    ([1, 64, 3], [100, 64, 1]),
]


def rounded_randn(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator,
                  scale: float = 1.0) -> torch.Tensor:
    """Normal samples, rounded to `dtype`."""
    return (torch.randn(*shape, generator=generator, dtype=torch.float32) * scale).to(dtype)


def make_qkv(shape: Shape, dtype: torch.dtype, seed: int = 0) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = rounded_randn((shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim), dtype, g)
    k = rounded_randn((shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim), dtype, g)
    v = rounded_randn((shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim), dtype, g)
    return q, k, v


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """int32 (B + 1,): where each of the packed sequences starts, and the total."""
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)


def alibi_slopes(heads: int, batch: Optional[int] = None) -> torch.Tensor:
    """The geometric ALiBi slopes of the paper, float32 (H,), or (B, H) varied per batch."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)
    if batch is None:
        return slopes
    return torch.stack([slopes * (1.0 + 0.5 * b) for b in range(batch)])


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window: Tuple[int, int],
                 q_pos: Optional[int] = None, k_pos: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(visible, distance), both (Sq, Sk): whether query i sees key j, and pq - pk.

    Positions: pq = q_pos + i and pk = k_pos + j, with q_pos = Sk - Sq by default (bottom-right).
    Visible: pk <= pq if causal; pq - left <= pk <= pq + right for a window (-1: unbounded).
    """
    if q_pos is None:
        q_pos = seqlen_k - seqlen_q
    pq = torch.arange(seqlen_q, dtype=torch.int64) + q_pos
    pk = torch.arange(seqlen_k, dtype=torch.int64) + k_pos
    distance = pq[:, None] - pk[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    left, right = window
    if causal:
        visible &= distance >= 0
    if left >= 0:
        visible &= distance <= left
    if right >= 0:
        visible &= -distance <= right
    return visible, distance


def attention(q, k, v, *, dtype: torch.dtype, softmax_scale: Optional[float] = None, causal: bool = False,
              window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi: Optional[torch.Tensor] = None,
              q_pos: Optional[int] = None, k_pos: int = 0):
    """Naive attention computed in `dtype` over a padded batch: (out (B, Sq, Hq, D), lse (B, Hq, Sq)).

    Differentiable in q, k and v. K and V heads are repeated for GQA, which the library must not do.
    A row that sees no key gets out = 0 and lse = -inf.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k = k.repeat_interleave(group, dim=2)  # (B, Sk, Hkv, D) -> (B, Sk, Hq, D)
    v = v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (B, Hq, Sq, Sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    visible, distance = visible_mask(seqlen_q, seqlen_k, causal, window, q_pos, k_pos)
    if alibi is not None:
        slopes = alibi.to(dtype).reshape(-1, heads_q)  # (1 or B, Hq)
        s = s - slopes[:, :, None, None] * distance.abs().to(dtype)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Sq); -inf where a row sees no key
    lse_finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_finite[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, dtype: torch.dtype, alibi=None, **options):
    """Naive attention over a packed batch: (out (Tq, Hq, D), lse (Hq, Tq)). Rows outside
    [cu_seqlens_q[0], cu_seqlens_q[-1]) belong to no sequence: out = 0 and lse = -inf."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    heads = q.shape[1]

    def empty_rows(n):
        return torch.zeros(n, *q.shape[1:], dtype=dtype), torch.full((heads, n), float("-inf"), dtype=dtype)

    head_out, head_lse = empty_rows(cu_q[0])
    outs, lses = [head_out], [head_lse]
    for b in range(len(cu_q) - 1):
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        out, lse = attention(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                             v[None, cu_k[b]:cu_k[b + 1]], dtype=dtype, alibi=slopes, **options)
        outs.append(out[0])
        lses.append(lse[0])
    tail_out, tail_lse = empty_rows(q.shape[0] - cu_q[-1])
    outs.append(tail_out)
    lses.append(tail_lse)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over the entries where ref is finite (0.0 when there are none)."""
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return (got.detach().to(F64) - ref.detach().to(F64))[finite].abs().max().item()


def assert_pass_rule(name: str, got: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, dtype: torch.dtype,
                     grad: bool = False):
    """Applies the pass rule to one result (a gradient with `grad`); infinities (rows that see no
    key) must match exactly."""
    got, ref, naive = got.detach(), ref.detach(), naive.detach()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: {int(torch.isnan(got).sum())} NaN entries"
    inf_got, inf_ref = torch.isinf(got), torch.isinf(ref)
    assert torch.equal(inf_got, inf_ref) and torch.equal(got[inf_got], ref[inf_ref].to(got.dtype)), (
        f"{name}: infinities differ: {int(inf_got.sum())} in ringflash, {int(inf_ref.sum())} in the reference")
    err = max_error(got, ref)
    err_naive = max_error(torch.nan_to_num(naive.to(F64)), ref)
    atol = (GRAD_ATOL if grad else ATOL)[dtype]
    bound = 2 * err_naive + atol
    assert err <= bound, (f"{name} ({dtype}): max |ringflash - reference| = {err:.3g} > {bound:.3g} "
                          f"= 2 * {err_naive:.3g} (naive in {dtype}) + {atol:g}")


def compare_with_reference(run: Callable, reference: Callable, inputs: List[torch.Tensor], dtype: torch.dtype,
                           grad_names: Sequence[str] = ("dq", "dk", "dv"), seed: int = 1,
                           backward: bool = True):
    """Checks out, lse and the gradients of the first len(grad_names) inputs.

    run(*inputs) -> (out, lse) on ringflash; reference(*inputs, dtype=...) -> (out, lse), naive.
    The gradients are those of sum(out * dout) for a random dout rounded to `dtype`.
    """
    n_grad = len(grad_names) if backward else 0

    def leaves(cast):
        return [cast(t.detach()).requires_grad_(i < n_grad) for i, t in enumerate(inputs)]

    results = {}
    dout = None
    for key, fn, cast, compute in (("ringflash", run, lambda t: t.clone(), None),
                                   ("reference", reference, lambda t: t.to(F64) if t.is_floating_point() else t, F64),
                                   ("naive", reference, lambda t: t.clone(), dtype)):
        xs = leaves(cast)
        out, lse = fn(*xs) if compute is None else fn(*xs, dtype=compute)
        grads = []
        if n_grad:
            if dout is None:
                g = torch.Generator().manual_seed(seed)
                dout = rounded_randn(out.shape, dtype, g)
            out.backward(dout.to(out.dtype))
            grads = [x.grad for x in xs[:n_grad]]
        results[key] = [out, lse, grads]

    if dtype != torch.float32:
        with torch.no_grad():
            results["naive"][1] = reference(*leaves(lambda t: t.clone()), dtype=torch.float32)[1]

    out, lse, grads = results["ringflash"]
    assert out.dtype == dtype, f"out has dtype {out.dtype}, expected {dtype}"
    assert lse.dtype == torch.float32, f"lse has dtype {lse.dtype}, expected float32"
    names = ["out", "lse"] + list(grad_names[:n_grad])
    for i, name in enumerate(names):
        pick = (lambda r: r[i]) if i < 2 else (lambda r: r[2][i - 2])
        got, ref, naive = pick(results["ringflash"]), pick(results["reference"]), pick(results["naive"])
        if i >= 2:
            assert got is not None, f"{name}: no gradient reached the input"
            assert got.dtype == dtype, f"{name} has dtype {got.dtype}, expected {dtype}"
        assert_pass_rule(name, got, ref, naive, torch.float32 if name == "lse" else dtype, grad=i >= 2)
    return results
