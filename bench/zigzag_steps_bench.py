"""The kernel calls of every zigzag rank at P ranks, timed one by one on one GPU, against one call over
the whole sequence: what the step kernels alone allow the scaling efficiency to reach.

    python bench/zigzag_steps_bench.py [--world 2] [--seqlen 32768] [--heads 32] [--heads-kv 32]
                                       [--hdim 128] [-w 3] [-n 10] [--json PATH] [--device cuda]

Causal, batch 1, bf16. Rank r holds chunks r and 2P-1-r of 2P (each c = S / 2P rows) and makes the
calls that src/parallel/ring.cpp makes, in accumulate mode into fp32 (`zigzag_calls`):
  forward   its own rows, one causal call over 2c x 2c; then for each source rank s, a rectangle:
            all 2c rows against s's first chunk (s < r), or r's second chunk against all 2c of s's
            rows (s > r);
  backward  its own block in two halves of its K/V heads (each 2c x 2c, causal; of its key rows,
            2c x c then c x c, with one K/V head), the rectangles between them.
The calls take the ring's options: the forward's first call writes the accumulator
(overwrite_out), its last writes the merged rows in bf16 (final_out), and every backward call writes
its fp32 dK/dV (overwrite_dkdv: zigzag's calls into a buffer are disjoint). Each call is also timed
writing bf16 (plain), so the accumulate mode's own cost shows. Every call,
and the one call over the sequence, is timed in turn, one call at a time (medians_ms). Before
timing, each rank's calls run once into fresh accumulators and must give its rows of the one
call's out and dq (cp_bench's limits); exit status 1 if not. Per rank, the sum of its calls'
medians; the slowest rank's sum bounds tP from below, so t1 / (P x that sum) is the efficiency the
kernels allow before any transfer, fill or host time. --device cpu runs the
same on the CPU kernels (small shapes: tests/python/test_bench_scripts.py runs it so).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import List, Tuple

Rows = Tuple[int, int]  # (first local row, count)


@dataclasses.dataclass(frozen=True)
class Call:
    pass_name: str  # "fwd" or "bwd"
    source: int     # the rank whose keys the call reads
    q_rows: Rows    # this rank's local query rows
    k_rows: Rows    # the source's local key rows
    q_offset: int   # the global position the kernel gives the first query row (causal mask)
    k_offset: int   # likewise for the first key row
    heads: int = -1  # -1: every head; 0 or 1: that half of the K/V heads (and their query heads)


def zigzag_positions(world: int, rank: int, seqlen: int) -> List[int]:
    """The global positions of a rank's local rows: chunk r, then chunk 2P - 1 - r."""
    c = seqlen // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))


def zigzag_calls(world: int, rank: int, seqlen: int, heads_kv: int = 2) -> List[Call]:
    """A rank's kernel calls in ring order: the forward's, then the backward's. seqlen must be a
    multiple of 2 * world."""
    if world < 1 or not 0 <= rank < world or seqlen % (2 * world):
        raise ValueError(f"need 0 <= rank < world and seqlen a multiple of 2 * world, got world={world}, "
                         f"rank={rank}, seqlen={seqlen}")
    c = seqlen // (2 * world)
    first, second = rank * c, (2 * world - 1 - rank) * c  # the global starts of this rank's chunks
    steps = []
    for step in range(1, world):
        src = (rank - step) % world
        if src < rank:  # every local query sees the source's first chunk, none its second
            steps.append((src, (0, 2 * c), (0, c), first, src * c))
        else:  # only the second local chunk sees the source, all of it
            steps.append((src, (c, c), (0, 2 * c), second, src * c))
    fwd = [Call("fwd", rank, (0, 2 * c), (0, 2 * c), first, first)]
    fwd += [Call("fwd", *s) for s in steps]
    if world > 1 and heads_kv > 1:  # the own block's two halves: halves of the K/V heads
        own = [Call("bwd", rank, (0, 2 * c), (0, 2 * c), first, first, half) for half in (0, 1)]
    elif world > 1:  # with one K/V head, halves of the key rows
        own = [Call("bwd", rank, (0, 2 * c), (0, c), first, first), Call("bwd", rank, (c, c), (c, c), second, second)]
    else:
        own = [Call("bwd", rank, (0, 2 * c), (0, 2 * c), first, first)]
    return fwd + own[:1] + [Call("bwd", *s) for s in steps] + own[1:]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks P (default 2)")
    p.add_argument("--seqlen", type=int, default=32768, help="total tokens S, a multiple of 2P (default 32768)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=32)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("-w", "--warmup", type=int, default=3)
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("--json", help="where the results go as JSON")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (default), or cpu to try the script on small shapes")
    args = p.parse_args(argv)
    if args.world < 1 or args.seqlen < 2 * args.world or args.seqlen % (2 * args.world):
        p.error(f"--seqlen must be a positive multiple of 2 * --world, got {args.seqlen} and {args.world}")
    if args.heads_kv < 1 or args.heads % args.heads_kv:
        p.error(f"--heads-kv must divide --heads {args.heads}, got {args.heads_kv}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch
    from ringflash import _C

    dev, dt, f32 = args.device, torch.bfloat16, torch.float32
    cuda = dev == "cuda"
    if cuda and not torch.cuda.is_available():
        print("zigzag_steps_bench: no CUDA device", file=sys.stderr)
        return 2
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    S, P, H, HKV, D = args.seqlen, args.world, args.heads, args.heads_kv, args.hdim

    def call_ms(fn):
        """One call between CUDA events (a synchronize after it); on the CPU, the wall clock."""
        if not cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        sync()
        return a.elapsed_time(b)

    def medians_ms(fns):
        """Median ms of each of fns, timed in turn one call at a time over --iters rounds (after
        --warmup calls of each): every function then meets the GPU at the same clocks. Timed one
        function after another, the later ones ran on a GPU nearer its power cap (on an H100, rank
        1's calls read 8-25 % slower than the same calls in a 2-GPU run)."""
        for fn in fns:
            for _ in range(args.warmup):
                fn()
        sync()
        times = [[] for _ in fns]
        for _ in range(args.iters):
            for i, fn in enumerate(fns):
                times[i].append(call_ms(fn))
        return [statistics.median(t) for t in times]

    torch.manual_seed(0)
    q = torch.randn(1, S, H, D, device=dev, dtype=dt)
    k, v = torch.randn(1, S, HKV, D, device=dev, dtype=dt), torch.randn(1, S, HKV, D, device=dev, dtype=dt)
    dout = torch.randn_like(q)
    out, lse = torch.empty_like(q), torch.empty(1, H, S, device=dev, dtype=f32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    one_call = dict(fwd=lambda: _C.attention_forward(q, k, v, out, lse, causal=True, stream=stream),
                    bwd=lambda: _C.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, causal=True,
                                                      stream=stream))
    one_call["fwd"]()  # out and lse, which the backward and the shards read, then dq for the check
    one_call["bwd"]()

    def shard(t, rank, dim=1):
        return t.index_select(dim, torch.tensor(zigzag_positions(P, rank, S), device=dev))

    shards = {r: dict(q=shard(q, r), k=shard(k, r), v=shard(v, r), dout=shard(dout, r), out=shard(out, r),
                      lse=shard(lse, r, 2)) for r in range(P)}
    def accumulators(rank):
        """Fresh fp32 accumulators of a rank's rows, as the ring keeps them."""
        mine = shards[rank]
        zeros = lambda like: torch.zeros(like.shape, device=dev, dtype=f32)  # noqa: E731
        return dict(out=zeros(mine["q"]), lse=torch.full_like(mine["lse"], float("-inf")), dq=zeros(mine["q"]),
                    dk=zeros(mine["k"]), dv=zeros(mine["k"]), final=torch.zeros_like(mine["q"]))

    # Each rank's forward calls: the ring's first step writes the accumulator, its last rounds the
    # merged rows into out.
    fwd_calls = {r: [c for c in zigzag_calls(P, r, S, HKV) if c.pass_name == "fwd"] for r in range(P)}

    def head_slices(call):
        """The query and K/V heads of a call: all, or a half of the K/V heads and their query heads."""
        if call.heads < 0:
            return slice(None), slice(None)
        split, group = HKV // 2, H // HKV
        kv = slice(0, split) if call.heads == 0 else slice(split, HKV)
        return slice(kv.start * group, kv.stop * group), kv

    def kernel_call(call, rank, acc):
        """One call of a rank's plan, into the fp32 accumulators `acc` (accumulate mode), or into bf16
        outputs of its own when acc is None."""
        mine, src = shards[rank], shards[call.source]
        qh, kh = head_slices(call)
        qs, ks = (slice(call.q_rows[0], sum(call.q_rows)), qh), (slice(call.k_rows[0], sum(call.k_rows)), kh)
        rows = lambda t, r: t[(slice(None),) + r]  # noqa: E731  (B, rows, heads, D) by rows and heads
        q_, k_, v_ = rows(mine["q"], qs), rows(src["k"], ks), rows(src["v"], ks)
        lse_ = mine["lse"][:, qh, qs[0]]
        kw = dict(causal=True, q_offset=call.q_offset, k_offset=call.k_offset, accumulate=acc is not None,
                  stream=stream)
        if call.pass_name == "fwd":
            o, l = ((rows(acc["out"], qs), acc["lse"][:, qh, qs[0]]) if acc is not None
                    else (torch.empty_like(q_), torch.empty_like(lse_)))
            if acc is not None:  # the ring's first and last steps (one step: both)
                first, last = fwd_calls[rank][0], fwd_calls[rank][-1]
                kw.update(overwrite_out=call == first, final_out=rows(acc["final"], qs) if call == last else None)
            return lambda: _C.attention_forward(q_, k_, v_, o, l, **kw)
        if acc is not None:
            kw.update(overwrite_dkdv=True)
        grads = ((rows(acc["dq"], qs), rows(acc["dk"], ks), rows(acc["dv"], ks)) if acc is not None
                 else tuple(torch.empty_like(t) for t in (q_, k_, v_)))
        return lambda: _C.attention_backward(q_, k_, v_, rows(mine["out"], qs), rows(mine["dout"], qs), lse_, *grads,
                                             **kw)

    # Once, into fresh accumulators: a rank's forward calls must give its rows of out, its backward
    # calls its rows of dq (its dk and dv also take the other ranks' calls).
    checks = {}
    for rank in range(P):
        acc = accumulators(rank)
        for call in zigzag_calls(P, rank, S, HKV):
            kernel_call(call, rank, acc)()
        rel = lambda got, want: ((got - want.float()).abs().max() / want.float().abs().max()).item()  # noqa: E731
        # The last forward call's rows are in `final` (bf16), the others in the fp32 accumulator.
        last = fwd_calls[rank][-1]
        out_ = acc["out"].clone()
        out_[:, last.q_rows[0]:sum(last.q_rows)] = acc["final"][:, last.q_rows[0]:sum(last.q_rows)].float()
        checks[rank] = dict(out=rel(out_, shards[rank]["out"]), dq=rel(acc["dq"], shard(dq, rank)))
    failed = [r for r, c in checks.items() if not (c["out"] <= 5e-2 and c["dq"] <= 1e-1)]  # cp_bench's limits
    print("check (max |calls - one call| / max |one call|):",
          ", ".join(f"rank {r} out {c['out']:.1e} dq {c['dq']:.1e}" for r, c in checks.items()), flush=True)

    # Every call of every rank, accumulating and plain, and the one call over the sequence, timed in
    # turn.
    plans = [(rank, call) for rank in range(P) for call in zigzag_calls(P, rank, S, HKV)]
    accs = {rank: accumulators(rank) for rank in range(P)}
    fns = [one_call["fwd"], one_call["bwd"]]
    for rank, call in plans:
        fns += [kernel_call(call, rank, accs[rank]), kernel_call(call, rank, None)]
    times = medians_ms(fns)
    t1 = dict(fwd=times[0], bwd=times[1])
    rows = []
    for i, (rank, call) in enumerate(plans):
        row = dict(rank=rank, **dataclasses.asdict(call), acc_ms=times[2 + 2 * i], plain_ms=times[3 + 2 * i])
        rows.append(row)
        print(json.dumps(row), flush=True)

    def per_rank(key):
        """{(rank, pass): the sum of its calls' `key` medians}."""
        return {(r, pn): sum(x[key] for x in rows if x["rank"] == r and x["pass_name"] == pn)
                for r in range(P) for pn in ("fwd", "bwd")}

    sums, plain_sums = per_rank("acc_ms"), per_rank("plain_ms")
    print(f"\n### zigzag steps: {device_name}, S {S}, P {P}, heads {H}/{HKV}, hdim {D}, bf16; ms")
    print(f"one GPU: fwd {t1['fwd']:.2f}, bwd {t1['bwd']:.2f}; / P: fwd {t1['fwd'] / P:.2f}, bwd {t1['bwd'] / P:.2f}")
    print(f"{'rank':>4} | {'fwd acc':>8} {'fwd plain':>9} | {'bwd acc':>8} {'bwd plain':>9}")
    for r in range(P):
        print(f"{r:>4} | {sums[r, 'fwd']:8.2f} {plain_sums[r, 'fwd']:9.2f} | {sums[r, 'bwd']:8.2f} "
              f"{plain_sums[r, 'bwd']:9.2f}")
    summary = {}
    for pn in ("fwd", "bwd"):
        worst = max(sums[r, pn] for r in range(P))
        summary[pn] = dict(t1_ms=t1[pn], slowest_rank_ms=worst, kernel_efficiency=t1[pn] / (P * worst))
    both = max(sums[r, "fwd"] + sums[r, "bwd"] for r in range(P))
    summary["fwd_bwd"] = dict(t1_ms=t1["fwd"] + t1["bwd"], slowest_rank_ms=both,
                              kernel_efficiency=(t1["fwd"] + t1["bwd"]) / (P * both))
    for pn, s in summary.items():
        print(f"{pn}: the kernels allow efficiency {s['kernel_efficiency']:.3f} (slowest rank {s['slowest_rank_ms']:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=device_name, t1=t1, calls=rows, summary=summary,
                           checks=checks), f, indent=1)
    if failed:
        print(f"zigzag_steps_bench: the calls of rank(s) {failed} disagree with the one call", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
