"""ringflash against torch SDPA on the CPU, side by side in one run.

    python bench/cpu_bench.py [--dtypes fp32,bf16] [--seqlens 1024,4096] [--hdims 64,128]
                              [--causal 0,1] [--iters 10] [--warmup 2] [--json PATH]

ringflash takes (B, S, H, D) tensors; torch.nn.functional.scaled_dot_product_attention takes
(B, H, S, D). Each side gets its inputs contiguous in its own layout, made before timing, so
neither is charged a copy; only the call is timed (forward, or forward then backward through
autograd with a random dout). Every case is warmed up, then timed over several iterations that
rotate through preallocated input sets, and the table shows medians. Large cases get fewer
iterations: after `--warmup`, a measurement stops at `--iters` iterations or at `--budget`
seconds, whichever comes first, but never below `--min-iters`.

FLOPs as FlashAttention counts them: forward 4*B*S^2*H*D, halved when causal; backward 2.5 x
forward, so forward+backward is 3.5 x forward. Ratios are torch time / ringflash time: above 1
means ringflash is faster.
"""

import argparse
import json
import os
import statistics
import sys
import time

# torch's OpenMP threads spin for milliseconds after each parallel region by default. Two
# libraries sharing two cores then fight: a ringflash call made right after a torch op finds one
# core taken by a spinning torch thread (measured here: half speed with OMP_WAIT_POLICY=ACTIVE).
# PASSIVE makes torch's threads sleep instead; torch's own SDPA times are the same either way
# (within noise of its default). It must be set before torch loads its OpenMP runtime. Set
# OMP_WAIT_POLICY yourself to measure another policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FWD_BWD_FLOPS_FACTOR = 3.5  # forward + backward (2.5 x forward)
# Largest |ringflash - torch| on the forward output that still counts as agreeing. Both sides
# round differently, so this only catches a broken result, not a last-bit difference.
AGREEMENT_ATOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def bool_list(text):
    values = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True}
    try:
        return [values[x.lower()] for x in text.split(",") if x]
    except KeyError as e:
        raise argparse.ArgumentTypeError(f"--causal takes 0,1 (or true,false), got {text}") from e


def dtype_list(text):
    names = [x for x in text.split(",") if x]
    for name in names:
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(f"unknown dtype {name}; choose from {', '.join(DTYPES)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", type=dtype_list, default=["fp32", "bf16"])
    p.add_argument("--seqlens", type=int_list, default=[1024, 4096])
    p.add_argument("--hdims", type=int_list, default=[64, 128])
    p.add_argument("--causal", type=bool_list, default=[False, True])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--iters", type=int, default=10, help="most timed iterations per measurement")
    p.add_argument("--min-iters", type=int, default=3, help="fewest timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=2, help="most warm-up iterations per measurement")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds per measurement after which no more iterations start (0: no limit)")
    p.add_argument("--sets", type=int, default=3, help="preallocated input sets to rotate through")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    if args.iters < 1 or args.min_iters < 1 or args.warmup < 0 or args.sets < 1:
        p.error("need --iters >= 1, --min-iters >= 1, --warmup >= 0, --sets >= 1")
    args.min_iters = min(args.min_iters, args.iters)
    return args


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure(call, args):
    """Median seconds of call(i) over the timed iterations; i counts every call, warm-up too."""
    start = time.perf_counter()
    for i in range(args.warmup):
        call(i)
        if args.budget and time.perf_counter() - start > args.budget:
            break
    i = args.warmup
    times = []
    start = time.perf_counter()
    while len(times) < args.iters:
        if len(times) >= args.min_iters and args.budget and time.perf_counter() - start > args.budget:
            break
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(times), len(times)


class Inputs:
    """`sets` independent input sets, in ringflash's layout and, as separate tensors, in torch's."""

    def __init__(self, sets, b, s, h, d, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.rf, self.sdpa = [], []
        for _ in range(sets):
            q, k, v, dout = (torch.randn(b, s, h, d, generator=gen).to(dtype) for _ in range(4))  # (B, S, H, D)
            self.rf.append(tuple(x.requires_grad_(x is not dout) for x in (q, k, v, dout)))
            # (B, S, H, D) -> (B, H, S, D), copied once here so that SDPA gets contiguous inputs.
            sdpa = [x.detach().transpose(1, 2).contiguous() for x in (q, k, v, dout)]
            self.sdpa.append(tuple(x.requires_grad_(j < 3) for j, x in enumerate(sdpa)))

    def __len__(self):
        return len(self.rf)


def time_case(ringflash, args, dtype_name, d, s, causal):
    dtype = DTYPES[dtype_name]
    b, h = args.batch, args.heads
    inputs = Inputs(args.sets, b, s, h, d, dtype, seed=s * 1000 + d)
    n = len(inputs)

    def rf_fwd(i):
        q, k, v, _ = inputs.rf[i % n]
        with torch.no_grad():
            ringflash.flash_attn_func(q, k, v, causal=causal)

    def sdpa_fwd(i):
        q, k, v, _ = inputs.sdpa[i % n]
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd(tensors, fn):
        def call(i):
            q, k, v, dout = tensors[i % n]
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(dout)
        return call

    rf_fwd_bwd = fwd_bwd(inputs.rf, lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=causal))
    sdpa_fwd_bwd = fwd_bwd(inputs.sdpa, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

    flops = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
    row = dict(dtype=dtype_name, hdim=d, seqlen=s, causal=causal, batch=b, heads=h, fwd_flops=flops,
               fwd_bwd_flops=FWD_BWD_FLOPS_FACTOR * flops)
    row["torch_fwd_s"], row["torch_fwd_iters"] = measure(sdpa_fwd, args)
    row["torch_fwd_bwd_s"], row["torch_fwd_bwd_iters"] = measure(sdpa_fwd_bwd, args)
    try:
        with torch.no_grad():
            q, k, v, _ = inputs.rf[0]
            qt, kt, vt, _ = inputs.sdpa[0]
            ours = ringflash.flash_attn_func(q, k, v, causal=causal)
            theirs = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
            row["max_abs_diff"] = (ours.float() - theirs.float()).abs().max().item()
        row["agrees"] = row["max_abs_diff"] <= AGREEMENT_ATOL[dtype]
        row["ringflash_fwd_s"], row["ringflash_fwd_iters"] = measure(rf_fwd, args)
        row["ringflash_fwd_bwd_s"], row["ringflash_fwd_bwd_iters"] = measure(rf_fwd_bwd, args)
        row["fwd_ratio"] = row["torch_fwd_s"] / row["ringflash_fwd_s"]
        row["fwd_bwd_ratio"] = row["torch_fwd_bwd_s"] / row["ringflash_fwd_bwd_s"]
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"
    return row


COLUMNS = [
    # header, width, format of one row
    ("dtype", 5, lambda r: r["dtype"]),
    ("D", 4, lambda r: str(r["hdim"])),
    ("S", 6, lambda r: str(r["seqlen"])),
    ("causal", 6, lambda r: "yes" if r["causal"] else "no"),
    ("rf fwd ms", 10, lambda r: f'{r["ringflash_fwd_s"] * 1e3:.2f}'),
    ("torch fwd ms", 12, lambda r: f'{r["torch_fwd_s"] * 1e3:.2f}'),
    ("fwd ratio", 9, lambda r: f'{r["fwd_ratio"]:.2f}'),
    ("rf f+b ms", 10, lambda r: f'{r["ringflash_fwd_bwd_s"] * 1e3:.2f}'),
    ("torch f+b ms", 12, lambda r: f'{r["torch_fwd_bwd_s"] * 1e3:.2f}'),
    ("f+b ratio", 9, lambda r: f'{r["fwd_bwd_ratio"]:.2f}'),
    ("rf fwd GF/s", 11, lambda r: f'{r["fwd_flops"] / r["ringflash_fwd_s"] / 1e9:.1f}'),
    ("torch fwd GF/s", 14, lambda r: f'{r["fwd_flops"] / r["torch_fwd_s"] / 1e9:.1f}'),
    ("rf f+b GF/s", 11, lambda r: f'{r["fwd_bwd_flops"] / r["ringflash_fwd_bwd_s"] / 1e9:.1f}'),
    ("torch f+b GF/s", 14, lambda r: f'{r["fwd_bwd_flops"] / r["torch_fwd_bwd_s"] / 1e9:.1f}'),
    ("max|diff|", 9, lambda r: f'{r["max_abs_diff"]:.1e}' + ("" if r["agrees"] else " DISAGREES")),
]


def format_row(row):
    cells = []
    for header, width, fmt in COLUMNS:
        try:
            cells.append(fmt(row).rjust(width))
        except KeyError:  # ringflash failed on this case
            cells.append("-".rjust(width))
    line = "  ".join(cells)
    return line + (f"  {row['error']}" if "error" in row else "")


def main(argv=None):
    args = parse_args(argv)
    threads = args.threads or cores()
    torch.set_num_threads(threads)
    import ringflash

    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"ringflash {getattr(ringflash, '__version__', '?')}, {threads} torch threads, ringflash threads: default "
          f"(every core), batch {args.batch}, heads {args.heads}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"medians over up to {args.iters} iterations (at least {args.min_iters}, {args.budget:g} s budget), "
          f"{args.warmup} warm-up, {args.sets} input sets; ratio = torch time / ringflash time\n")
    print("  ".join(header.rjust(width) for header, width, _ in COLUMNS), flush=True)
    rows = []
    for dtype_name in args.dtypes:
        for d in args.hdims:
            for s in args.seqlens:
                for causal in args.causal:
                    row = time_case(ringflash, args, dtype_name, d, s, causal)
                    row.update(torch_version=torch.__version__, threads=threads)
                    rows.append(row)
                    print(format_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nwrote {len(rows)} rows to {args.json}")
    failed = [r for r in rows if "error" in r or not r.get("agrees", False)]
    if failed:
        print(f"\n{len(failed)} of {len(rows)} cases failed or disagree with torch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
