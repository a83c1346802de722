"""ringflash's sequence-parallel strategies on P GPUs against ringflash on one GPU: per-GPU TFLOP/s
and scaling efficiency.

    torchrun --nproc_per_node=P bench/cp_bench.py --out DIR [--strategies zigzag,ring,stripe,hybrid:4,...]
        [--seqlens 32768,131072] [--heads-kv 32,8] [--passes fwd,fwd_bwd] [-w 3] [-n 10] [--sets 2]
        [--ulysses-degree U] [--no-check]

The setting is that of torch's context parallelism in the peer baseline
(../shared/peers/torch_cp_bench.py): causal, batch 1, 32 query heads, hdim 128, bf16, total
sequence 32k and 128k, forward and forward+backward; here with 32 K/V heads (MHA, as the peer)
and with 8 (GQA 4:1). Each rank holds its shard in the strategy's layout
(ringflash.shard_positions) and calls ringflash.parallel_attention; t1 is
ringflash.flash_attn_func on the whole sequence on one GPU (every rank runs it on its own GPU at
the same time; rank 0's time is reported, every rank's is in the JSON, and the table's "GPUs %"
is how much slower the slowest GPU ran it than the fastest: tP is the slowest rank's and t1 rank
0's, so where rank 0's GPU is the fastest the efficiency reads up to that spread lower than it
would on equal GPUs).

Timing as the peer's: warm-up calls (-w), then a barrier, then -n calls, each between two CUDA
events followed by a synchronize; the median. Inputs rotate over --sets copies (made before
timing). The forward runs with autograd recording, as in training; forward+backward is the
forward plus torch.autograd.grad of q, k, v. tP is the largest of the ranks' medians (the call is
done when the slowest rank is).

FLOPs as the peer counts them: forward 4 * S^2 * Hq * D * 0.5 (causal), forward+backward 3.5 x
that. Per-GPU TFLOP/s = FLOPs / P / tP; efficiency = t1 / (P * tP), 1.0 being perfect scaling.

Once per (strategy, seqlen, K/V heads), each rank's shard of out, dq, dk, dv is compared with the
same rows of the single-GPU results (max |a - b| / max |b|, the largest over the ranks); above
the limit the row is marked MISMATCH, so a fast but wrong strategy does not pass.

Rank 0 prints one JSON line per row, writes DIR/cp_bench.json (--out, default $OUT or .) and
prints a table last. Exit status 1 if a row failed or mismatched. bench/cp_compare.py sets the
results beside torch's.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ringflash
from ringflash.distributed import communicator, selected
from ringflash.parallel import STRATEGIES, init_process_groups, parallel_attention, shard_positions
from bench_util import int_list

DTYPE = torch.bfloat16
BATCH = 1
FWD_BWD_FLOPS_FACTOR = 3.5  # forward + backward = 3.5 x forward (the peer's count)
PASSES = ("fwd", "fwd_bwd")
# Largest max |ringflash P GPUs - ringflash 1 GPU| / max |ringflash 1 GPU| that still agrees: both
# round to bf16 in different places; this catches a wrong result, not a last-bit difference
# (the limits of bench/gpu_bench.py).
AGREEMENT_RTOL = {"out": 5e-2, "dq": 1e-1, "dk": 1e-1, "dv": 1e-1}
RESULT_NAMES = ("out", "dq", "dk", "dv")


def name_list(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def hybrid_degree(name, default):
    """The ulysses degree of a strategy name: U for "hybrid:U", `default` for "hybrid", None for the
    other strategies; ValueError for a "hybrid:" without a positive integer."""
    if name == "hybrid":
        return default
    if not name.startswith("hybrid:"):
        return None
    degree = int(name.split(":", 1)[1])
    if degree < 1:
        raise ValueError(name)
    return degree


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where cp_bench.json goes (default $OUT or .)")
    p.add_argument("--strategies", type=name_list, default=["zigzag"],
                   help=f"comma-separated, from {', '.join(STRATEGIES)}, and hybrid:U for the hybrid with "
                        "ulysses degree U (one row set each, so hybrid:1,hybrid:2,... covers every "
                        "factorisation; plain hybrid takes --ulysses-degree) (default zigzag)")
    p.add_argument("--seqlens", type=int_list, default=[32768, 131072], help="total sequence lengths")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--heads-kv", type=int_list, default=[32, 8], help="K/V heads, one row set each")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--passes", type=name_list, default=list(PASSES), help="comma-separated, from fwd and fwd_bwd (default both)")
    p.add_argument("-w", "--warmup", type=int, default=3, help="warm-up calls before each timed loop (the peer's 3)")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed calls; the median is reported (the peer's 10)")
    p.add_argument("--sets", type=int, default=2, help="input copies to rotate over (1: no rotation)")
    p.add_argument("--ulysses-degree", type=int, default=None,
                   help="hybrid's ulysses degree (ring degree = P / it); default 2 when P is even, else 1")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the single-GPU results")
    args = p.parse_args(argv)
    for s in args.strategies:
        try:
            known = s in STRATEGIES or hybrid_degree(s, None) is not None
        except ValueError:
            known = False
        if not known:
            p.error(f"--strategies: each must be one of {', '.join(STRATEGIES)} or hybrid:U with an integer U >= 1, "
                    f"got {s!r}")
    for name in args.passes:
        if name not in PASSES:
            p.error(f"--passes: each must be one of {', '.join(PASSES)}, got {name!r}")
    for hkv in args.heads_kv:
        if hkv <= 0 or args.heads % hkv:
            p.error(f"--heads-kv: each must divide --heads {args.heads}, got {hkv}")
    if min(args.seqlens, default=0) <= 0:
        p.error(f"--seqlens must be positive, got {args.seqlens}")
    if args.warmup < 0 or args.iters < 1 or args.sets < 1:
        p.error("need --warmup >= 0, --iters >= 1 and --sets >= 1")
    return args


def fwd_flops(seqlen, heads, hdim):
    """Causal forward FLOPs of batch 1, as the peer counts them."""
    return 4 * BATCH * seqlen * seqlen * heads * hdim * 0.5


def pass_flops(pass_name, seqlen, heads, hdim):
    return fwd_flops(seqlen, heads, hdim) * (FWD_BWD_FLOPS_FACTOR if pass_name == "fwd_bwd" else 1.0)


class Ranks:
    """This process's place in the world and the few collectives the benchmark needs."""

    def __init__(self):
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", self.local_rank)
        torch.cuda.set_device(self.device)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather(self, value: float):
        """value of every rank, in rank order."""
        return [values[0] for values in self.gather_list([value])]

    def gather_list(self, values):
        """The list of floats `values` of every rank (each as long), in rank order."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [x.tolist() for x in out]

    def barrier(self):
        dist.barrier()
        torch.cuda.synchronize()


def back_to_back(fn, inputs, iters):
    """`iters` calls of fn(*inputs[i % len(inputs)]) back to back, as the peer times them: each
    call's ms between CUDA events (a synchronize after it), and the host clock (ms since the epoch)
    at its start."""
    times, starts = [], []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        starts.append(time.time_ns() / 1e6)
        start.record()
        fn(*inputs[i % len(inputs)])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, starts


def time_ms(fn, inputs, warmup, iters, ranks):
    """Median ms of fn(*inputs[i % len(inputs)]) on this rank, as the peer times it."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    ranks.barrier()
    return statistics.median(back_to_back(fn, inputs, iters)[0])


def pass_fn(attend, pass_name):
    """The timed call of one pass: the forward (autograd recording), or forward + gradients."""
    if pass_name == "fwd":
        return lambda q, k, v, dout: attend(q, k, v)

    def fwd_bwd(q, k, v, dout):
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
    return fwd_bwd


def results_of(attend, q, k, v, dout):
    """out, dq, dk, dv of one forward+backward."""
    out = attend(q, k, v)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout))


def make_inputs(seqlen, heads, heads_kv, hdim, seed, device):
    """q, k, v (leaves that require grad) and dout of the whole sequence, (1, S, H, D); rank 0's
    values on every rank (made from the seed, then broadcast)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(BATCH, seqlen, heads, hdim), (BATCH, seqlen, heads_kv, hdim), (BATCH, seqlen, heads_kv, hdim),
              (BATCH, seqlen, heads, hdim)]
    tensors = [torch.randn(s, device=device, dtype=DTYPE, generator=gen) for s in shapes]
    for t in tensors:
        dist.broadcast(t, src=0)
    return [t.requires_grad_(i < 3) for i, t in enumerate(tensors)]


def shard(inputs, positions, device=None):
    """This rank's rows of each input, as new leaves on `device` (default: the input's):
    (1, S, H, D) -> (1, S_local, H, D)."""
    return [t.detach()[:, positions.to(t.device)].to(device or t.device).requires_grad_(i < 3)
            for i, t in enumerate(inputs)]


def guarded(ranks, fn):
    """(fn(), None), or (None, error) when fn raised on this rank or on any other, so that every rank
    goes on to the next row together. This relies on a failed ringflash call failing on every rank
    (a peer's failure reaches the others, at the latest at the deadline, RINGFLASH_COMM_TIMEOUT)."""
    try:
        value, error = fn(), None
    except Exception as e:  # noqa: BLE001 - reported in the row
        value, error = None, f"{type(e).__name__}: {e}"[:400]
    failed = [r for r, f in enumerate(ranks.gather(1.0 if error else 0.0)) if f]
    if failed and error is None:
        error = f"failed on rank(s) {failed}"
    return (None, error) if failed else (value, None)


def max_abs_diff_and_max(a, b, heads_per_chunk=4):
    """(max |a - b|, max |b|) in fp32, a few heads (dim 2) at a time: at 1M tokens an fp32 copy of a
    whole shard is GiBs."""
    diff, scale = 0.0, 0.0
    for h in range(0, b.shape[2], heads_per_chunk):
        a_h, b_h = a[:, :, h:h + heads_per_chunk].float(), b[:, :, h:h + heads_per_chunk].float()
        diff = max(diff, (a_h - b_h).abs().max().item())
        scale = max(scale, b_h.abs().max().item())
    return diff, scale


def rel_diffs(attend, shards, single, positions):
    """max |a - b| / max |b| of this strategy's out, dq, dk, dv against the single-GPU results, on
    this rank's rows."""
    diffs = {}
    for name, a, b in zip(RESULT_NAMES, results_of(attend, *shards), single):
        diff, scale = max_abs_diff_and_max(a, b[:, positions.to(b.device)].to(a.device))
        diff = diff / scale if scale > 0 else diff
        diffs[name] = diff if math.isfinite(diff) else float("inf")
    return diffs


def verdict_of(ranks, diffs):
    """The check of one strategy: the largest relative difference over the ranks, per result."""
    worst = {name: max(ranks.gather(diffs[name])) for name in RESULT_NAMES}
    return dict(agrees=all(worst[name] <= AGREEMENT_RTOL[name] for name in RESULT_NAMES),
                **{f"{name}_rel_diff": worst[name] for name in RESULT_NAMES})


def timed(ranks, fn, inputs, args):
    """(every rank's median ms, None), or (None, error)."""
    ms, error = guarded(ranks, lambda: time_ms(fn, inputs, args.warmup, args.iters, ranks))
    return (None, error) if error else (ranks.gather(ms), None)


def run_shape(args, ranks, groups, seqlen, heads_kv):
    """Every row of one (seqlen, K/V heads): t1 of each pass, then each strategy."""
    heads, hdim, device = args.heads, args.hdim, ranks.device
    sets = [make_inputs(seqlen, heads, heads_kv, hdim, 1000 * seqlen + 10 * heads_kv + i, device)
            for i in range(args.sets)]

    def single(q, k, v):
        return ringflash.flash_attn_func(q, k, v, causal=True)

    t1 = {pass_name: timed(ranks, pass_fn(single, pass_name), sets, args) for pass_name in args.passes}
    single_results, single_error = None, None
    if not args.no_check:
        single_results, single_error = guarded(ranks, lambda: results_of(single, *sets[0]))
    # While the P-GPU calls run, the whole sequence's inputs and one-GPU results wait in host
    # memory, and the one-GPU call's workspace leaves ringflash's pool (torch's cache is not there
    # to take it). At 1M tokens they are 40 GiB and 16 GiB (the fp32 dQ) on every GPU, beside
    # which ulysses' 24 GiB workspace did not fit on an 80 GB H100.
    sets = [[t.detach().cpu() for t in s] for s in sets]
    if single_results is not None:
        single_results = [r.cpu() for r in single_results]
    torch.cuda.empty_cache()
    ringflash.empty_cache()

    rows = []
    for name in args.strategies:
        group = groups.get(name)
        degree = hybrid_degree(name, args.ulysses_degree)
        strategy = "hybrid" if degree is not None else name

        def attend(q, k, v, strategy=strategy, group=group):
            return parallel_attention(q, k, v, strategy, group, causal=True)

        positions = shard_positions(seqlen, strategy, group)
        shard_sets = [shard(s, positions, device) for s in sets]
        base = dict(strategy=name, world=ranks.world, seqlen=seqlen, heads=heads, heads_kv=heads_kv, hdim=hdim,
                    causal=True, dtype="bf16", batch=BATCH)
        if degree is not None:
            base["ulysses_degree"] = degree
        verdict = None
        if not args.no_check:
            if single_results is None:
                verdict = dict(agrees=False, error=f"no single-GPU results: {single_error}")
            else:
                diffs, error = guarded(ranks, lambda: rel_diffs(attend, shard_sets[0], single_results, positions))
                verdict = dict(agrees=False, error=error) if error else verdict_of(ranks, diffs)
        for pass_name in args.passes:
            flops = pass_flops(pass_name, seqlen, heads, hdim)
            row = dict(base, **{"pass": pass_name, "flops": flops})
            t1_ranks, t1_error = t1[pass_name]
            tp_ranks, error = timed(ranks, pass_fn(attend, pass_name), shard_sets, args)
            if error or t1_error:
                row["error"] = error or f"single GPU: {t1_error}"
            else:
                t1_ms, tp_ms = t1_ranks[0], max(tp_ranks)
                row.update(t1_ms=t1_ms, tp_ms=tp_ms, t1_ms_ranks=t1_ranks, tp_ms_ranks=tp_ranks,
                           t1_spread=max(t1_ranks) / min(t1_ranks) - 1,
                           tflops_per_gpu=flops / ranks.world / tp_ms / 1e9, one_gpu_tflops=flops / t1_ms / 1e9,
                           efficiency=t1_ms / (ranks.world * tp_ms))
            if verdict is not None:
                row["check"] = verdict
            rows.append(row)
            if ranks.rank == 0:
                print(json.dumps(row), flush=True)
        del shard_sets
    del sets, single_results
    torch.cuda.empty_cache()
    ringflash.empty_cache()
    return rows


def row_failed(row):
    return "error" in row or not row.get("check", {"agrees": True}).get("agrees", False)


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows):
    lines = [f"{'seqlen':>7} {'hkv':>4} {'pass':>7} {'strategy':>9} | {'t1 ms':>9} {'GPUs %':>6} {'tP ms':>9} | "
             f"{'TFLOP/s/GPU':>11} {'1-GPU TFLOP/s':>13} {'eff':>5} | check"]
    for r in rows:
        if "error" in r:
            verdict = "ERROR: " + r["error"][:100]
        elif "check" not in r:
            verdict = "not checked"
        elif "error" in r["check"]:
            verdict = "check ERROR: " + r["check"]["error"][:100]
        else:
            c = r["check"]
            grads = max(c[f"{g}_rel_diff"] for g in ("dq", "dk", "dv"))
            verdict = (f"{'ok' if c['agrees'] else 'MISMATCH'} (rel diff out {c['out_rel_diff']:.1e}, "
                       f"grads {grads:.1e})")
        spread = None if r.get("t1_spread") is None else 100 * r["t1_spread"]
        lines.append(f"{r['seqlen']:>7} {r['heads_kv']:>4} {r['pass']:>7} {r['strategy']:>9} | "
                     f"{fmt(r.get('t1_ms'), '9.2f')} {fmt(spread, '6.1f')} {fmt(r.get('tp_ms'), '9.2f')} | "
                     f"{fmt(r.get('tflops_per_gpu'), '11.1f')} {fmt(r.get('one_gpu_tflops'), '13.1f')} "
                     f"{fmt(r.get('efficiency'), '5.2f')} | {verdict}")
    return "\n".join(lines)


def nccl_version():
    version = torch.cuda.nccl.version()  # a tuple (major, minor, patch); an int in old torch
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cp_bench: no CUDA device", file=sys.stderr)
        return 2
    ranks = Ranks()
    if args.ulysses_degree is None:
        args.ulysses_degree = 2 if ranks.world % 2 == 0 else 1
    groups = {}  # a group per hybrid name, made in the same order on every rank
    for name in args.strategies:
        degree = hybrid_degree(name, args.ulysses_degree)
        if degree is None:
            continue
        if degree < 1 or ranks.world % degree:
            raise SystemExit(f"cp_bench: the ulysses degree of {name!r} must divide the world size {ranks.world}, "
                             f"got {degree}")
        groups[name] = init_process_groups(degree, ranks.world // degree)
    info = dict(world=ranks.world, torch=torch.__version__, cuda=torch.version.cuda,
                nccl=nccl_version(), device=torch.cuda.get_device_name(ranks.device),
                ringflash=ringflash.__version__, ringflash_build=ringflash.build_info(),
                selected=selected(ranks.device), transport=communicator(None, ranks.device).transport,
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), dtype="bf16", causal=True, batch=BATCH,
                heads=args.heads, hdim=args.hdim, warmup=args.warmup, iters=args.iters, sets=args.sets,
                timing="CUDA events around each call, synchronize after each, median; tP = max over ranks",
                flops="forward 4*S^2*Hq*D*0.5 (causal), forward+backward 3.5x")
    if ranks.rank == 0:
        print(f"cp_bench: {ranks.world} x {info['device']}; torch {info['torch']} (CUDA {info['cuda']}, NCCL "
              f"{info['nccl']}); ringflash {info['ringflash']}, transport {info['transport']}; strategies "
              f"{','.join(args.strategies)}; warm-up {args.warmup}, {args.iters} timed calls, median", flush=True)
        if info["transport"] != "nccl":
            print(f"cp_bench: WARNING: ringflash uses the {info['transport']!r} transport, not its NCCL one",
                  flush=True)

    rows = []
    for seqlen in args.seqlens:
        for heads_kv in args.heads_kv:
            rows += run_shape(args, ranks, groups, seqlen, heads_kv)

    failed = [r for r in rows if row_failed(r)]
    if ranks.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "cp_bench.json")
        with open(path, "w") as f:
            json.dump(dict(info=info, rows=rows, failed=len(failed)), f, indent=1)
        print(f"wrote {path}")
        print(f"\n### cp_bench table: ringflash on {ranks.world} GPUs vs ringflash on one; bf16, causal, "
              f"{args.heads} query heads, hdim {args.hdim}; TFLOP/s per GPU = FLOPs / P / tP; eff = t1 / (P tP)")
        print(table(rows), flush=True)
        if failed:
            print(f"\n{len(failed)} of {len(rows)} rows failed or disagree with the single-GPU results",
                  file=sys.stderr)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
