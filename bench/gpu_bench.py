"""ringflash against torch SDPA's flash and cuDNN backends on one GPU, side by side in one run.

    python bench/gpu_bench.py [--hdims 64,128] [--seqlens 1024,4096,16384] [--causal 0,1]
                              [--repeat 1] [--interleave N | --steady S] [--quick] [--warmup 25]
                              [--rep 100] [--json PATH]

Shapes and measurements are those of the peer baseline (/work/shared/peers/sdpa_bench.py): bf16,
16k tokens per batch (batch = 16384 // seqlen), hidden 2048 (heads = 2048 // hdim), causal and
not. Each side gets its natural layout, made before timing: ringflash.flash_attn_func takes
(B, S, H, D), torch.nn.functional.scaled_dot_product_attention (B, H, S, D). Times are medians of
triton.testing.do_bench (warm-up 25 ms, 100 ms of repetitions, L2 flushed between calls); the
forward runs with autograd recording, as in training; backward = (forward+backward) - forward.

FLOPs as the peer counts them: forward 4*B*S^2*H*D, halved when causal; backward 2.5 x forward;
forward+backward 3.5 x forward. Ratios are ringflash TFLOP/s / backend TFLOP/s: above 1 means
ringflash is faster.

For each shape the backends are measured in turn, each forward then forward+backward, rotating
which one goes first over --repeat rounds (the medians over rounds are reported). --interleave N
times them call by call instead: N rounds in which every backend makes one call (L2 flushed
before each, the first backend rotating), medians of N per backend, so that the backends share
the GPU's clocks, which move by several % over the seconds a shape takes; each call then follows
another backend's, whose power draw it meets (bench/NOTES.md, h33, has both ways side by side).
--steady S times each backend's calls back to back for S seconds after 0.5 s of warm-up (L2 flushed
before each call, each call between CUDA events as in do_bench), once the GPU has run 3 s of matrix
products: long enough for the power controller to settle at the GPU's limit, where a 100 ms
stretch is not (bench/NOTES.md h38, h40). It reports the mean time per call and, where NVML can be
loaded, the energy per call, the flushes' share included (in the JSON: fwd_j, fwd_bwd_j, bwd_j).

Once per shape, ringflash's out, dq, dk and dv are compared with the flash backend's on the same
inputs (cuDNN's when flash cannot run); a relative difference (max |a - b| / max |b|) above the
limit marks the shape MISMATCH and the exit status non-zero, so a fast but wrong kernel does not
pass.

--quick runs one shape per head dim: seqlen 4096, causal. JSON goes to --json PATH, or to
$OUT/gpu_bench.json when OUT is set. The table is printed last.
"""

import argparse
import contextlib
import ctypes
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from bench_util import int_list

TOTAL_TOKENS = 16384
HIDDEN = 2048
DTYPE = torch.bfloat16
BWD_FLOPS_FACTOR = 2.5      # backward = 2.5 x forward (FlashAttention's count)
FWD_BWD_FLOPS_FACTOR = 3.5  # forward + backward
QUICK_SEQLEN = 4096
BACKENDS = ["ringflash", "flash", "cudnn"]
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
# Largest relative difference max |ringflash - torch| / max |torch| that still agrees. Both round
# to bf16 in different places; this catches a wrong result, not a last-bit difference.
AGREEMENT_RTOL = {"out": 5e-2, "dq": 1e-1, "dk": 1e-1, "dv": 1e-1}
L2_FLUSH_BYTES = 256 * 1024 * 1024


def bool_list(text):
    values = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True}
    try:
        return [values[x.lower()] for x in text.split(",") if x]
    except KeyError as e:
        raise argparse.ArgumentTypeError(f"--causal takes 0,1 (or true,false), got {text!r}") from e


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hdims", type=int_list, default=[64, 128])
    p.add_argument("--seqlens", type=int_list, default=[1024, 4096, 16384])
    p.add_argument("--causal", type=bool_list, default=[False, True])
    p.add_argument("--repeat", type=int, default=1, help="rounds of measurements per shape (medians reported)")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="time the backends call by call in turn, N calls each (0: do_bench per backend)")
    p.add_argument("--steady", type=float, default=0, metavar="S",
                   help="time each backend's calls back to back for S seconds (0: do_bench per backend)")
    p.add_argument("--quick", action="store_true", help=f"one shape per head dim: seqlen {QUICK_SEQLEN}, causal")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms (the peer's 25)")
    p.add_argument("--rep", type=float, default=100, help="do_bench repetition time, ms (the peer's 100)")
    p.add_argument("--json", metavar="PATH", help="write the results here (default $OUT/gpu_bench.json if OUT is set)")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.causal = [QUICK_SEQLEN], [True]
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.interleave < 0:
        p.error(f"--interleave must be >= 0, got {args.interleave}")
    if args.steady < 0:
        p.error(f"--steady must be >= 0 seconds, got {args.steady:g}")
    if args.steady and args.interleave:
        p.error("--steady and --interleave are two ways of timing: give one")
    for hdim in args.hdims:
        if hdim <= 0 or HIDDEN % hdim:
            p.error(f"--hdims: each head dim must divide the hidden size {HIDDEN}, got {hdim}")
    for seqlen in args.seqlens:
        if seqlen <= 0 or TOTAL_TOKENS % seqlen:
            p.error(f"--seqlens: each seqlen must divide {TOTAL_TOKENS} tokens per batch, got {seqlen}")
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_bench.json")
    return args


def make_timer():
    """(name, bench(fn, warmup_ms, rep_ms, grad_to_none) -> median ms): triton.testing.do_bench, as
    the peer uses, or the same procedure on CUDA events where triton is missing."""
    try:
        import triton.testing
    except ImportError:
        return "cuda-events (triton not importable)", do_bench_events

    def bench(fn, warmup, rep, grad_to_none=None):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    return "triton.testing.do_bench", bench


def flush_buffer():
    """A buffer whose zeroing evicts the L2 cache between timed calls, as do_bench's does."""
    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def timed_call(fn, flush, grad_to_none=None):
    """One call of fn after an L2 flush, between two CUDA events that leave the flush out, with the
    gradients of grad_to_none reset first; returns the (start, end) events."""
    for t in grad_to_none or []:
        t.grad = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.zero_()
    start.record()
    fn()
    end.record()
    return start, end


def do_bench_events(fn, warmup, rep, grad_to_none=None):
    """triton.testing.do_bench's procedure: estimate one call, run `warmup` ms of calls, then time
    `rep` ms of calls one by one between L2 flushes, and return the median in ms."""
    flush = flush_buffer()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup, n_repeat = max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    for _ in range(n_warmup):
        fn()
    spans = [timed_call(fn, flush, grad_to_none) for _ in range(n_repeat)]
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in spans)


class Energy:
    """NVML's energy counter of the current CUDA device in joules, or None where NVML cannot be loaded."""

    def __init__(self):
        self.lib, self.handle = None, ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
        if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(self.handle)) == 0:
            self.lib = lib

    def joules(self):
        if self.lib is None:
            return None
        mj = ctypes.c_ulonglong()
        ok = self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) == 0
        return mj.value / 1e3 if ok else None


def warm_up_gpu(seconds=3.0):
    """Matrix products for `seconds`, so that the first shape does not meet an idle GPU's clocks."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def steady(fn, seconds, energy, grad_to_none=None, warmup=0.5):
    """(ms, joules or None) per call of `fn`, called back to back for `seconds` after `warmup`
    seconds with the L2 flushed before each call, as do_bench does: the time is the mean of the
    calls' own spans (CUDA events around each, the flush outside), the energy NVML's over the whole
    stretch per call (the flushes' included). The host waits for the GPU every 5 calls."""
    flush = flush_buffer()

    def calls(n, spans):
        spans.extend(timed_call(fn, flush, grad_to_none) for _ in range(n))
        torch.cuda.synchronize()

    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        calls(5, [])
    spans = []
    e0, t0 = energy.joules(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        calls(5, spans)
    e1 = energy.joules()
    ms = statistics.fmean(s.elapsed_time(e) for s, e in spans)
    return ms, (e1 - e0) / len(spans) if e0 is not None and e1 is not None else None


class Inputs:
    """q, k, v and dout of one shape, in ringflash's layout (B, S, H, D) and, as separate contiguous
    copies of the same values, in SDPA's (B, H, S, D)."""

    def __init__(self, batch, seqlen, heads, hdim, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        bshd = [torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=DTYPE, generator=gen) for _ in range(4)]
        self.ringflash = [t.requires_grad_(i < 3) for i, t in enumerate(bshd)]
        # (B, S, H, D) -> (B, H, S, D), copied once here so that SDPA gets contiguous inputs.
        bhsd = [t.detach().transpose(1, 2).contiguous() for t in bshd]
        self.sdpa = [t.requires_grad_(i < 3) for i, t in enumerate(bhsd)]


def backend_context(backend):
    """SDPA restricted to one backend, around whole measurements as in the peer; nothing for ringflash."""
    return contextlib.nullcontext() if backend == "ringflash" else sdpa_kernel([SDPA_BACKENDS[backend]])


def tensors_of(backend, inputs):
    return inputs.ringflash if backend == "ringflash" else inputs.sdpa


def forward_fn(backend, inputs, causal):
    """The forward call of `backend` on its own layout, autograd recording."""
    q, k, v, _ = tensors_of(backend, inputs)
    if backend == "ringflash":
        return lambda: ringflash.flash_attn_func(q, k, v, causal=causal)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def passes_of(backend, inputs, causal):
    """The timed calls of `backend`: (forward, forward+backward, the tensors whose gradients the
    second sets)."""
    fwd = forward_fn(backend, inputs, causal)
    tensors = tensors_of(backend, inputs)

    def fwd_bwd():
        fwd().backward(tensors[3])
    return fwd, fwd_bwd, tensors[:3]


def measure(backend, inputs, causal, args, bench, energy):
    """(forward ms, forward+backward ms) of one backend on one shape: do_bench's medians, or with
    --steady the means per call, followed by the joules per call of each (None without NVML)."""
    fwd, fwd_bwd, grads = passes_of(backend, inputs, causal)
    with backend_context(backend):
        if args.steady:
            (t_fwd, j_fwd), (t_fwd_bwd, j_fwd_bwd) = (steady(fwd, args.steady, energy),
                                                      steady(fwd_bwd, args.steady, energy, grad_to_none=grads))
            return t_fwd, t_fwd_bwd, j_fwd, j_fwd_bwd
        t_fwd = bench(fwd, args.warmup, args.rep)
        t_fwd_bwd = bench(fwd_bwd, args.warmup, args.rep, grad_to_none=grads)
    return t_fwd, t_fwd_bwd


def measure_interleaved(backends, inputs, causal, calls):
    """{backend: (forward ms, forward+backward ms)}: medians of `calls` calls each, the backends
    taking turns call by call (L2 flushed before each call, the first backend rotating), so that
    every backend meets the same GPU clocks. A backend that raises is left out; {backend: message}
    of those comes second."""
    flush = flush_buffer()
    passes, errors = {}, {}
    for backend in backends:
        passes[backend] = passes_of(backend, inputs, causal)
        try:
            with backend_context(backend):
                for fn in passes[backend][:2]:
                    for _ in range(3):
                        fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
            errors[backend] = f"{type(e).__name__}: {e}"[:300]
            del passes[backend]
            torch.cuda.synchronize()
    names = list(passes)
    times = {b: [] for b in names}
    for which in range(2):  # forward, then forward+backward
        events = {b: [] for b in names}
        for i in range(calls):
            for backend in names[i % len(names):] + names[:i % len(names)]:
                with backend_context(backend):
                    events[backend].append(timed_call(passes[backend][which], flush, passes[backend][2]))
        torch.cuda.synchronize()
        for backend in names:
            times[backend].append(statistics.median(s.elapsed_time(e) for s, e in events[backend]))
    return {b: tuple(t) for b, t in times.items()}, errors


def results_of(backend, inputs, causal):
    """out, dq, dk, dv of one forward+backward, in (B, S, H, D)."""
    tensors = tensors_of(backend, inputs)
    for t in tensors[:3]:
        t.grad = None
    with backend_context(backend):
        out = forward_fn(backend, inputs, causal)()
        out.backward(tensors[3])
    results = [out.detach()] + [t.grad for t in tensors[:3]]
    for t in tensors[:3]:
        t.grad = None
    if backend != "ringflash":
        results = [r.transpose(1, 2) for r in results]  # (B, H, S, D) -> (B, S, H, D)
    return results


def check_agreement(inputs, causal, usable):
    """ringflash's out and gradients against the flash backend's (cuDNN's if flash failed)."""
    against = next((b for b in ("flash", "cudnn") if b in usable), None)
    if against is None:
        return dict(error="no torch backend ran this shape to compare with")
    check = dict(against=against)
    try:
        ours = results_of("ringflash", inputs, causal)
        theirs = results_of(against, inputs, causal)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return dict(against=against, error=f"{type(e).__name__}: {e}"[:300])
    agrees = True
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        diff = (a.float() - b.float()).abs().max().item()
        scale = b.float().abs().max().item()
        rel = diff / scale if scale > 0 else diff
        finite = math.isfinite(diff) and bool(torch.isfinite(a).all())
        check[f"{name}_max_abs_diff"] = diff
        check[f"{name}_rel_diff"] = rel
        agrees = agrees and finite and rel <= AGREEMENT_RTOL[name]
    check["agrees"] = agrees
    return check


def flops_of(batch, seqlen, heads, hdim, causal):
    """Forward FLOPs as the peer counts them."""
    return 4 * batch * seqlen * seqlen * heads * hdim * (0.5 if causal else 1.0)


def ratio(ours, theirs, key):
    """ours[key] / theirs[key], or None where either is missing (a backward time that came out <= 0)."""
    if ours.get(key) is None or not theirs.get(key):
        return None
    return ours[key] / theirs[key]


def shape_failed(shape):
    """ringflash raised, or its results disagree with torch's (or could not be compared)."""
    ours = next(r for r in shape["rows"] if r["backend"] == "ringflash")
    return "error" in ours or not shape.get("check", {}).get("agrees", False)


def run_shape(hdim, seqlen, causal, args, bench, energy):
    batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // hdim
    flops = flops_of(batch, seqlen, heads, hdim, causal)
    inputs = Inputs(batch, seqlen, heads, hdim, seed=seqlen * 1000 + hdim * 2 + int(causal))
    times = {b: [] for b in BACKENDS}
    errors = {}
    if args.interleave:
        measured, errors = measure_interleaved(BACKENDS, inputs, causal, args.interleave)
        for backend, t in measured.items():
            times[backend].append(t)
    else:
        for round_ in range(args.repeat):
            order = BACKENDS[round_ % len(BACKENDS):] + BACKENDS[:round_ % len(BACKENDS)]
            for backend in order:
                if backend in errors:
                    continue
                try:
                    times[backend].append(measure(backend, inputs, causal, args, bench, energy))
                except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
                    errors[backend] = f"{type(e).__name__}: {e}"[:300]
                    torch.cuda.synchronize()
    rows = []
    for backend in BACKENDS:
        row = dict(backend=backend, hdim=hdim, seqlen=seqlen, batch=batch, heads=heads, causal=causal,
                   fwd_flops=flops)
        if backend in errors:
            row["error"] = errors[backend]
        else:
            t_fwd = statistics.median(t[0] for t in times[backend])
            t_fwd_bwd = statistics.median(t[1] for t in times[backend])
            row.update(fwd_ms=t_fwd, fwd_bwd_ms=t_fwd_bwd, bwd_ms=t_fwd_bwd - t_fwd,
                       fwd_tflops=flops / t_fwd / 1e9,
                       bwd_tflops=BWD_FLOPS_FACTOR * flops / (t_fwd_bwd - t_fwd) / 1e9 if t_fwd_bwd > t_fwd
                       else None,
                       fwdbwd_tflops=FWD_BWD_FLOPS_FACTOR * flops / t_fwd_bwd / 1e9,
                       rounds=[dict(fwd_ms=t[0], fwd_bwd_ms=t[1]) for t in times[backend]])
            joules = [t[2:] for t in times[backend] if len(t) > 2 and None not in t[2:]]
            if joules:
                j_fwd, j_fwd_bwd = statistics.median(j[0] for j in joules), statistics.median(j[1] for j in joules)
                row.update(fwd_j=j_fwd, fwd_bwd_j=j_fwd_bwd, bwd_j=j_fwd_bwd - j_fwd)
        rows.append(row)
    shape = dict(hdim=hdim, seqlen=seqlen, batch=batch, heads=heads, causal=causal, fwd_flops=flops)
    by_backend = {r["backend"]: r for r in rows}
    if "error" not in by_backend["ringflash"]:
        shape["check"] = check_agreement(inputs, causal, [b for b in ("flash", "cudnn") if b not in errors])
        for peer in ("flash", "cudnn"):
            if "error" in by_backend[peer]:
                continue
            shape[f"ratio_{peer}"] = {phase: ratio(by_backend["ringflash"], by_backend[peer], f"{phase}_tflops")
                                      for phase in ("fwd", "bwd", "fwdbwd")}
    shape["rows"] = rows
    del inputs
    torch.cuda.empty_cache()
    return shape


def fmt(value, spec=".0f"):
    return "-" if value is None else format(value, spec)


CELL = 6  # width of one number in the table


def table(shapes):
    """The compact table: TFLOP/s per backend and phase, ratios, and the agreement check."""
    group = 3 * CELL + 2
    titles = ["fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s", "ringflash / flash", "ringflash / cuDNN"]
    names = [("rf", "flash", "cudnn")] * 3 + [("fwd", "bwd", "f+b")] * 2
    lines = [" " * 18 + " | " + " | ".join(t.center(group) for t in titles) + " |",
             "hdim seqlen causal | " + " | ".join(" ".join(n.rjust(CELL) for n in ns) for ns in names) + " | check"]
    for s in shapes:
        rows = {r["backend"]: r for r in s["rows"]}
        cells = [" ".join(fmt(rows[b].get(f"{phase}_tflops")).rjust(CELL) for b in BACKENDS)
                 for phase in ("fwd", "bwd", "fwdbwd")]
        for peer in ("flash", "cudnn"):
            r = s.get(f"ratio_{peer}") or {}
            cells.append(" ".join(fmt(r.get(p), ".2f").rjust(CELL) for p in ("fwd", "bwd", "fwdbwd")))
        check = s.get("check", {})
        if "error" in rows["ringflash"]:
            verdict = "ringflash ERROR: " + rows["ringflash"]["error"][:80]
        elif "error" in check:
            verdict = "check ERROR: " + check["error"][:80]
        else:
            grads = max(check[f"{g}_rel_diff"] for g in ("dq", "dk", "dv"))
            verdict = (f"{'ok' if check['agrees'] else 'MISMATCH'} vs {check['against']} "
                       f"(rel diff out {check['out_rel_diff']:.1e}, grads {grads:.1e})")
        lines.append(f"{s['hdim']:4d} {s['seqlen']:6d} {('yes' if s['causal'] else 'no'):>6} | "
                     + " | ".join(cells) + " | " + verdict)
        for b in ("flash", "cudnn"):
            if "error" in rows[b]:
                lines.append(f"{'':18} | {b} error: {rows[b]['error'][:100]}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 2
    timer_name, bench = make_timer()
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                device=torch.cuda.get_device_name(), ringflash=ringflash.__version__,
                ringflash_build=ringflash.build_info(), timer=timer_name, warmup_ms=args.warmup, rep_ms=args.rep,
                repeat=args.repeat, interleave=args.interleave, dtype="bf16", total_tokens=TOTAL_TOKENS,
                hidden=HIDDEN)
    energy = Energy() if args.steady else None
    info.update(steady_s=args.steady, energy="nvml" if energy and energy.lib else None)
    if args.interleave:
        timing = f"call by call in turn, {args.interleave} calls per backend"
    elif args.steady:
        timing = (f"back to back for {args.steady:g} s per backend and pass, {args.repeat} round(s); energy "
                  + ("from NVML" if energy.lib else "not read (no NVML)"))
    else:
        timing = f"{timer_name}, warm-up {args.warmup:g} ms, rep {args.rep:g} ms, {args.repeat} round(s)"
    summary = "means per call, medians over rounds" if args.steady else "medians"
    print(f"torch {info['torch']} (CUDA {info['cuda']}, cuDNN {info['cudnn']}) on {info['device']}; "
          f"ringflash {info['ringflash']}; {timing}, {summary}")
    print(ringflash.build_info().rstrip(), flush=True)
    if args.steady:
        warm_up_gpu()

    shapes = []
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            for causal in args.causal:
                shape = run_shape(hdim, seqlen, causal, args, bench, energy)
                shapes.append(shape)
                for row in shape["rows"]:
                    print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
                print(json.dumps(dict(hdim=hdim, seqlen=seqlen, causal=causal, check=shape.get("check"),
                                      ratio_flash=shape.get("ratio_flash"), ratio_cudnn=shape.get("ratio_cudnn"))),
                      flush=True)

    failed = [s for s in shapes if shape_failed(s)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, shapes=shapes, failed=len(failed)), f, indent=1)
        print(f"wrote {args.json}")
    print("\n### gpu_bench table: bf16 TFLOP/s of ringflash (rf) and torch SDPA's flash and cudnn backends; "
          "ratios = ringflash TFLOP/s / backend TFLOP/s")
    print(table(shapes), flush=True)
    if failed:
        print(f"\n{len(failed)} of {len(shapes)} shapes: ringflash failed or disagrees with torch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
