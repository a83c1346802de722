"""ringflash's CPU kernels against the float64 reference on a few shapes.

    python bench/reference_check.py

For each case it checks the forward (out, lse) and the backward (dq, dk, dv, through autograd)
with the tests' reference and pass rule (tests/python/reference.py):

    max |ringflash - reference| <= 2 * max |naive - reference| + ATOL[dtype],

where the reference is naive attention in float64 on inputs already rounded to the test dtype, and
"naive" is the same computation in the test dtype. The table shows each error and its bound.
Exits non-zero when a case fails.
"""

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
import ringflash  # noqa: E402
from reference import (ATOL, Shape, attention, attention_varlen, compare_with_reference, make_qkv,  # noqa: E402
                       max_error)

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
RESULTS = ["out", "lse", "dq", "dk", "dv"]


def padded_case(shape, dtype, causal=False, window_size=(-1, -1), softcap=0.0):
    def run(q, k, v):
        return ringflash.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                         return_softmax_lse=True)

    def reference(q, k, v, dtype):
        return attention(q, k, v, dtype=dtype, causal=causal, window=window_size, softcap=softcap)

    return run, reference, list(make_qkv(shape, dtype))


def packed_case(lengths, heads_q, heads_kv, head_dim, dtype, causal=False):
    """One packed batch whose sequences have `lengths` (empty ones included), q and k alike."""
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total, longest = int(cu_seqlens[-1]), max(lengths)
    q, k, v = (x[0] for x in make_qkv(Shape(1, total, total, heads_q, heads_kv, head_dim), dtype))  # (T, H, D)

    def run(q, k, v, cu_q, cu_k):
        return ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, longest, longest, causal=causal,
                                                return_softmax_lse=True)

    def reference(q, k, v, cu_q, cu_k, dtype):
        return attention_varlen(q, k, v, cu_q, cu_k, dtype=dtype, causal=causal)

    return run, reference, [q, k, v, cu_seqlens, cu_seqlens]


CASES = [
    # (description, dtype, case)
    ("B2 S128 H8 D64", torch.float32, lambda dt: padded_case(Shape(2, 128, 128, 8, 8, 64), dt)),
    ("B2 S128 H8 D64 causal", torch.bfloat16, lambda dt: padded_case(Shape(2, 128, 128, 8, 8, 64), dt, causal=True)),
    ("B1 S1013 H8/2 D128 causal (GQA)", torch.bfloat16,
     lambda dt: padded_case(Shape(1, 1013, 1013, 8, 2, 128), dt, causal=True)),
    ("B2 Sq17 Sk300 H4/1 D64 causal (MQA, bottom-right)", torch.float16,
     lambda dt: padded_case(Shape(2, 17, 300, 4, 1, 64), dt, causal=True)),
    ("B1 S256 H4 D96 window (32, 0) softcap 5", torch.float32,
     lambda dt: padded_case(Shape(1, 256, 256, 4, 4, 96), dt, window_size=(32, 0), softcap=5.0)),
    ("packed [100, 0, 37, 1] H4/2 D64 causal", torch.float32,
     lambda dt: packed_case([100, 0, 37, 1], 4, 2, 64, dt, causal=True)),
]


def errors(results, dtype):
    """'error/bound' for each of out, lse, dq, dk, dv."""
    cells = []
    for i, name in enumerate(RESULTS):
        pick = (lambda r: r[i]) if i < 2 else (lambda r: r[2][i - 2])
        ref = pick(results["reference"])
        bound = 2 * max_error(torch.nan_to_num(pick(results["naive"]).to(torch.float64)), ref) + ATOL[dtype]
        cells.append(f"{name} {max_error(pick(results['ringflash']), ref):.1e}/{bound:.1e}")
    return "  ".join(cells)


def main():
    torch.manual_seed(0)
    print(ringflash.build_info())
    print("max |ringflash - float64 reference| / bound, for out, lse and the gradients\n")
    failures = 0
    width = max(len(description) for description, _, _ in CASES)
    for description, dtype, make in CASES:
        run, reference, inputs = make(dtype)
        start = time.perf_counter()
        try:
            results = compare_with_reference(run, reference, inputs, dtype)
            verdict = "ok    " + errors(results, dtype)
        except (AssertionError, ringflash.Error) as e:
            failures += 1
            verdict = f"FAIL  {type(e).__name__}: {e}"
        took = time.perf_counter() - start
        print(f"{description:<{width}}  {DTYPE_NAMES[dtype]}  {took:5.2f}s  {verdict}", flush=True)
    print(f"\n{len(CASES) - failures} of {len(CASES)} cases pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
