"""The distributed form of the pass rule: every rank checks its shard against the global reference.

    ref = GlobalReference(q, k, v, dtype, causal=True)        # full inputs, the same on every rank
    ref.check(run, positions)                                 # run(q_l, k_l, v_l) -> (out_l, lse_l)

``positions`` are the global rows (sequence positions of a padded batch, or token rows of a packed
one) that this rank holds, in local order. ``run`` gets the shards of q, k and v (leaves that require
grad), and the check backpropagates the shard of one global ``dout`` and applies the pass rule of
``reference.py`` to out, lse, dq, dk and dv on the shard's rows. The reference (float64, and naive
in the test dtype) is computed once and serves any number of strategies.
"""

from typing import Callable, Optional

import torch

from reference import F64, assert_pass_rule, attention, attention_varlen, rounded_randn

__all__ = ["GlobalReference"]


class GlobalReference:
    def __init__(self, q, k, v, dtype, cu_seqlens=None, seed=1, **options):
        """q, k, v: the full inputs in `dtype`, (B, S, H, D), or packed (T, H, D) with `cu_seqlens`.
        options: those of reference.attention (causal, window, softcap, alibi, softmax_scale)."""
        self.inputs = (q, k, v)
        self.dtype = dtype
        self.packed = cu_seqlens is not None

        def reference(q, k, v, dtype):
            if self.packed:
                return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, dtype=dtype, **options)
            return attention(q, k, v, dtype=dtype, **options)

        g = torch.Generator().manual_seed(seed)
        self.dout = rounded_randn(q.shape, dtype, g)
        self.results = {}
        for name, cast, compute in (("reference", lambda t: t.to(F64), F64), ("naive", lambda t: t.clone(), dtype)):
            xs = [cast(t).requires_grad_() for t in self.inputs]
            out, lse = reference(*xs, dtype=compute)
            out.backward(self.dout.to(out.dtype))
            self.results[name] = [out.detach(), lse.detach()] + [x.grad for x in xs]
        if dtype != torch.float32:
            with torch.no_grad():
                self.results["naive"][1] = reference(*[t.clone() for t in self.inputs], dtype=torch.float32)[1]

    def rows(self, t: torch.Tensor, positions: torch.Tensor, lse: bool = False) -> torch.Tensor:
        """The rows of `positions` of a global tensor: dim 1 of (B, S, ...) or dim 0 of packed
        (T, ...); for an lse, the last dim."""
        if lse:
            return t[..., positions]
        return t[positions] if self.packed else t[:, positions]

    def check(self, run: Callable, positions: torch.Tensor, backward: bool = True,
              kv_positions: Optional[torch.Tensor] = None, what: str = ""):
        """Runs `run` on this rank's shards and checks its results on the shard's rows."""
        kv_positions = positions if kv_positions is None else kv_positions
        q, k, v = self.inputs
        xs = [self.rows(t, p).clone().requires_grad_(backward)
              for t, p in ((q, positions), (k, kv_positions), (v, kv_positions))]
        out, lse = run(*xs)
        grads = []
        if backward:
            out.backward(self.rows(self.dout, positions).to(out.dtype))
            grads = [x.grad for x in xs]
        assert out.dtype == self.dtype, f"{what}: out has dtype {out.dtype}, expected {self.dtype}"
        got = [out, lse] + grads
        names = ["out", "lse", "dq", "dk", "dv"][:len(got)]
        row_sets = [positions, positions, positions, kv_positions, kv_positions]
        for i, name in enumerate(names):
            pick = [self.rows(self.results[key][i], row_sets[i], lse=(name == "lse")) for key in ("reference", "naive")]
            assert got[i] is not None, f"{what}: {name}: no gradient reached the input"
            assert_pass_rule(f"{what} {name}", got[i], pick[0], pick[1],
                             torch.float32 if name == "lse" else self.dtype, grad=i >= 2)
