"""Where the time of a sequence-parallel call goes on P GPUs, beside the same call on one GPU.

    torchrun --nproc_per_node=P bench/cp_profile.py [--strategy zigzag] [--seqlen 32768]
        [--heads-kv 32] [--passes fwd,fwd_bwd] [-w 3] [-n 10] [--trace-rank 1] [--trace-all]
        [--profile-calls 1] [--no-keep-kv] [--out DIR]

The setting is cp_bench.py's (causal, batch 1, 32 query heads, hdim 128, bf16). For ringflash on
one GPU (t1: flash_attn_func on the whole sequence) and on P (tP: parallel_attention on this
rank's shard), per pass:

  b2b   cp_bench's and the peer's timing: the calls back to back, without a barrier, each between
        CUDA events and a synchronize; skew: the median over those calls of the spread of the
        ranks' host clocks at the call's start (one host, so the clocks are the same);
  sync  the same with a barrier of all ranks before each call;
  busy  the same, with the GPU held by a sleep kernel while the host enqueues the call, so that
        only the GPU's own time counts (sync - busy: the host's exposed share);
  host  median ms of the host's own time to enqueue the call (measured while the GPU is held);
  J     the GPU's energy per b2b call (NVML's counter across the b2b calls, host gaps included;
        "-" where NVML is not there), and W its mean power over them. Under the power cap the
        clock follows the energy a call needs: P J(P) / J(1) above 1 is work that P GPUs add.
        The counter needs about half a second of calls: raise -n for short ones.
Each is the largest over the ranks; every rank's is printed below the table and kept in the JSON.

Then one call of each (--profile-calls N: N back to back) under torch.profiler on --trace-rank
(--trace-all: every rank writes a trace, whose clocks are the host's), its GPU work summed by
kind: attention kernels, NCCL kernels, copies (copy engines), memsets, other kernels (fills, adds,
dsum, dQ conversion), with the span from the first start to the last end and the time inside the
span when nothing ran. That idle time is split by what the GPU waited for (host_waits): the host,
where the activity that ended a gap was launched after the gap began, and otherwise another
stream or rank (an event, NCCL); "start" is the time from the call's start on the host to the
first GPU activity. Rank 0 prints the tables and writes DIR/cp_profile.json.
"""

import argparse
import ctypes
import json
from math import nan
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import ringflash
from ringflash.parallel import parallel_attention, shard_positions
from bench_util import int_list
from cp_bench import PASSES, Ranks, back_to_back, make_inputs, name_list, pass_fn, shard

SLEEP_CYCLES = 200_000_000  # about 0.1 s at Hopper's clocks: longer than any enqueue measured here
KINDS = ("attention", "nccl", "copy", "memset", "other")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CALL_MARKER = "cp_profile_call"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="zigzag")
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int_list, default=[32])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--passes", type=name_list, default=list(PASSES))
    p.add_argument("-w", "--warmup", type=int, default=3)
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("--trace-rank", type=int, default=1, help="the rank whose GPU work is profiled")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--profile-calls", type=int, default=1,
                   help="calls profiled back to back (the summary covers all of them)")
    p.add_argument("--trace-all", action="store_true",
                   help="every rank writes a trace of the profiled calls (the summary stays --trace-rank's)")
    p.add_argument("--no-keep-kv", action="store_true",
                   help="parallel_attention(keep_kv=False): a ring of two steps receives its K/V again")
    p.add_argument("--timeline", action="store_true",
                   help="also print every GPU activity of the profiled P-GPU calls, in order of start")
    args = p.parse_args(argv)
    for name in args.passes:
        if name not in PASSES:
            p.error(f"--passes: each must be one of {', '.join(PASSES)}, got {name!r}")
    return args


class EnergyCounter:
    """NVML's energy counter of one GPU (mJ since the driver loaded), or None where NVML or the
    counter is not there."""

    def __init__(self, device):
        self.lib, self.handle = None, ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            props = torch.cuda.get_device_properties(device)
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(self.handle)) == 0:
                self.lib = lib
        except (OSError, AttributeError, RuntimeError, AssertionError):  # no NVML, no CUDA device
            pass
        if self.read() is None:
            self.lib = None

    def read(self):
        if self.lib is None:
            return None
        mj = ctypes.c_ulonglong()
        return mj.value if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) == 0 else None


def timings(fn, inputs, ranks, warmup, iters, energy):
    """Median (b2b ms, skew ms, sync ms, busy ms, host ms) of fn over the input sets, every rank at
    the same time; J per b2b call and mean W over them (None without a counter); and the host's
    clock (s since the epoch) where the b2b calls began, where they ended and where the sync and
    busy calls ended."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    sync, busy, host = [], [], []
    ranks.barrier()
    phases = [time.time()]
    mj0 = energy.read()
    b2b, starts = back_to_back(fn, inputs, iters)
    mj1 = energy.read()
    phases.append(time.time())
    joules = watts = None
    if mj0 is not None and mj1 is not None:
        joules = (mj1 - mj0) / 1e3 / iters
        watts = (mj1 - mj0) / 1e3 / (phases[1] - phases[0])
    spread = [max(t) - min(t) for t in zip(*(ranks.gather_list(starts)))]
    for i in range(iters):
        args = inputs[i % len(inputs)]
        ranks.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        sync.append(start.elapsed_time(end))
        ranks.barrier()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        t = time.perf_counter()
        fn(*args)
        host.append((time.perf_counter() - t) * 1e3)
        end.record()
        torch.cuda.synchronize()
        busy.append(start.elapsed_time(end))
    phases.append(time.time())
    return (*(statistics.median(x) for x in (b2b, spread, sync, busy, host)), joules, watts, phases)


def kind_of(name):
    if name.startswith("Memcpy"):
        return "copy"
    if name.startswith("Memset"):
        return "memset"
    if "nccl" in name.lower():
        return "nccl"
    if "forward_kernel" in name or "backward_kernel" in name or "dq_kernel" in name:
        return "attention"
    return "other"


def short_name(name):
    """A kernel's name without its template arguments and namespaces."""
    name = name.split("<")[0].split("(")[0]
    return name.replace("void ", "").split("::")[-1].strip()[:40]


def summarize(events):
    """ms of GPU work by kind among a chrome trace's events (kernels, copies and memsets on every
    stream), the span from the first start to the last end, the time inside it when nothing ran,
    and the activities themselves (start and duration in ms from the first start, stream, kind,
    name), in order of start."""
    intervals, sums, activities = [], dict.fromkeys(KINDS, 0.0), []
    for e in events:
        if e.get("cat") not in GPU_CATS or not e.get("dur"):
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        intervals.append((start, end))
        kind = kind_of(e.get("name", ""))
        sums[kind] += (end - start) / 1e3
        activities.append((start, end - start, e.get("tid"), kind, short_name(e.get("name", ""))))
    if not intervals:
        return dict(sums, span=0.0, idle=0.0, activities=[])
    intervals.sort()
    first = intervals[0][0]
    activities = [(round((a[0] - first) / 1e3, 3), round(a[1] / 1e3, 3), *a[2:]) for a in sorted(activities)]
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in intervals) - first
    return dict(sums, span=span / 1e3, idle=(span - busy) / 1e3, activities=activities)


GAP_US = 2.0  # idle time shorter than this between two activities is the GPU's own


def host_waits(events, marker=CALL_MARKER):
    """Where the GPU waited inside the span of a chrome trace's GPU activities: ms from the start of
    the `marker` annotation (the call on the host) to the first activity ("start"), ms of gaps that
    ended with an activity whose launch returned on the host after the gap began ("host"), ms of
    the other gaps ("other": an event of another stream, another rank), and each gap (start ms from
    the first activity, ms, "host" or "other", the name of the activity that ended it)."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
                 if e.get("cat") in GPU_CATS and e.get("dur"))
    calls = [float(e["ts"]) for e in events if e.get("name") == marker]
    result = dict(start=0.0, host=0.0, other=0.0, gaps=[])
    if not gpu:
        return result
    first = gpu[0][0]
    if calls:
        result["start"] = (first - calls[0]) / 1e3
    busy_end = gpu[0][1]
    for start, end, e in gpu[1:]:
        if start > busy_end + GAP_US:
            launch = launches.get(e.get("args", {}).get("correlation"))
            kind = "host" if launch and float(launch["ts"]) + float(launch.get("dur", 0)) > busy_end else "other"
            gap = (start - busy_end) / 1e3
            result[kind] += gap
            result["gaps"].append((round((busy_end - first) / 1e3, 3), round(gap, 3), kind,
                                   short_name(e.get("name", ""))))
        busy_end = max(busy_end, end)
    return result


def gpu_profile(fn, inputs, trace_path, calls=1):
    """summarize() and host_waits() of `calls` calls of fn under torch.profiler, back to back with a
    synchronize after each, as cp_bench times them (its trace written to trace_path)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(CALL_MARKER):
                fn(*inputs[i % len(inputs)])
            torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return dict(summarize(events), waits=host_waits(events))


def fixed(value, width, digits):
    """value right-aligned in width with `digits` decimals, or "-" for None."""
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def main(argv=None):
    args = parse_args(argv)
    ranks = Ranks()
    device = ranks.device
    energy = EnergyCounter(device)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for heads_kv in args.heads_kv:
        sets = [make_inputs(args.seqlen, args.heads, heads_kv, args.hdim, 7 + i, device) for i in range(2)]
        positions = shard_positions(args.seqlen, args.strategy, device=device).to(device)
        shard_sets = [shard(s, positions) for s in sets]

        def single(q, k, v):
            return ringflash.flash_attn_func(q, k, v, causal=True)

        def parallel(q, k, v):
            return parallel_attention(q, k, v, args.strategy, causal=True, keep_kv=not args.no_keep_kv)

        for pass_name in args.passes:
            for world, attend, inputs in ((1, single, sets), (ranks.world, parallel, shard_sets)):
                fn = pass_fn(attend, pass_name)
                b2b, skew, sync, busy, host, joules, watts, phases = timings(
                    fn, inputs, ranks, args.warmup, args.iters, energy)
                row = dict(heads_kv=heads_kv, pass_name=pass_name, world=world, skew_ms=skew, phases=phases)
                for name, value in (("b2b", b2b), ("sync", sync), ("busy", busy), ("host", host)):
                    row[f"{name}_ranks"] = ranks.gather(value)
                    row[f"{name}_ms"] = max(row[f"{name}_ranks"])
                # NaN on the way from a rank without a counter; None in the JSON.
                both = ranks.gather_list([nan if joules is None else joules, nan if watts is None else watts])
                for i, name in enumerate(("joules", "watts")):
                    row[f"{name}_ranks"] = [x[i] if x[i] == x[i] else None for x in both]
                    known = [x for x in row[f"{name}_ranks"] if x is not None]
                    row[name] = max(known) if known else None
                ranks.barrier()
                if args.trace_all or ranks.rank == args.trace_rank:
                    trace = os.path.join(args.out, f"trace_hkv{heads_kv}_{pass_name}_p{world}_rank{ranks.rank}.json")
                    profiled = gpu_profile(fn, inputs, trace, args.profile_calls)
                    if ranks.rank == args.trace_rank:
                        row["profile"] = profiled
                else:  # the other ranks take part in the same calls
                    for i in range(args.profile_calls):
                        fn(*inputs[i % len(inputs)])
                        torch.cuda.synchronize()
                ranks.barrier()
                rows.append(row)
        del sets, shard_sets
        torch.cuda.empty_cache()

    # The trace rank's profiles reach rank 0 through a file in --out when they are different ranks.
    if ranks.rank == args.trace_rank:
        with open(os.path.join(args.out, f"cp_profile_rank{ranks.rank}.json"), "w") as f:
            json.dump([r.get("profile") for r in rows], f)
    ranks.barrier()
    if ranks.rank == 0:
        with open(os.path.join(args.out, f"cp_profile_rank{args.trace_rank}.json")) as f:
            for row, prof in zip(rows, json.load(f)):
                row["profile"] = prof
        with open(os.path.join(args.out, "cp_profile.json"), "w") as f:
            json.dump(dict(strategy=args.strategy, seqlen=args.seqlen, world=ranks.world, rows=rows), f, indent=1)
        print(f"\n### cp_profile: {args.strategy}, S {args.seqlen}, {ranks.world} x "
              f"{torch.cuda.get_device_name(device)}; ms; the profile is rank {args.trace_rank}'s")
        print(f"{'hkv':>4} {'pass':>7} {'P':>2} | {'b2b':>7} {'skew':>5} {'sync':>7} {'busy':>7} {'host':>6} "
              f"{'J':>6} {'W':>5} | "
              + " ".join(f"{k:>9}" for k in KINDS) + f" | {'span':>7} {'idle':>6} | {'start':>6} {'w.host':>6} "
              f"{'w.other':>7}")
        for r in rows:
            p, w = r["profile"], r["profile"]["waits"]
            print(f"{r['heads_kv']:>4} {r['pass_name']:>7} {r['world']:>2} | {r['b2b_ms']:7.2f} {r['skew_ms']:5.2f} "
                  f"{r['sync_ms']:7.2f} {r['busy_ms']:7.2f} {r['host_ms']:6.2f} {fixed(r['joules'], 6, 3)} "
                  f"{fixed(r['watts'], 5, 0)} | "
                  + " ".join(f"{p[k]:9.2f}" for k in KINDS)
                  + f" | {p['span']:7.2f} {p['idle']:6.2f} | {w['start']:6.2f} {w['host']:6.2f} {w['other']:7.2f}",
                  flush=True)
        print("\nper rank (ms; joules J per call): " + "; ".join(
            f"hkv {r['heads_kv']} {r['pass_name']} P {r['world']}: "
            + ", ".join(f"{n} " + "/".join(fixed(x, 0, 2) for x in r[f"{n}_ranks"]) for n in ("b2b", "sync", "busy", "joules"))
            for r in rows if r["world"] > 1))
        for r in rows if args.timeline else []:
            if r["world"] == 1:
                continue
            print(f"\n### timeline: hkv {r['heads_kv']}, {r['pass_name']}, P {r['world']} (rank {args.trace_rank}): "
                  "start ms, ms, stream, kind, name")
            for start, ms, stream, kind, name in r["profile"]["activities"]:
                print(f"{start:8.3f} {ms:7.3f} {str(stream):>6} {kind:>9} {name}")
            print("gaps: start ms, ms, waited for, the activity that ended it")
            for start, ms, kind, name in r["profile"]["waits"]["gaps"]:
                print(f"{start:8.3f} {ms:7.3f} {kind:>6} {name}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
