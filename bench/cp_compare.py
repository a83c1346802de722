"""ringflash's sequence parallelism (bench/cp_bench.py) beside torch's context parallelism
(../shared/peers/torch_cp_bench.py), from their JSON files.

    python bench/cp_compare.py [--dir DIR] [--ringflash PATH] [--torch PATH] [--json PATH]

Reads DIR/cp_bench.json and DIR/torch_cp_w{P}.json (DIR: --dir, default $OUT or .; P: the world
size in cp_bench.json), prints one table row per ringflash row (seqlen, K/V heads, pass,
strategy): ringflash's per-GPU TFLOP/s and efficiency t1 / (P tP), and, for torch CP with the
flash and with the cuDNN SDPA backend, its best rotate method (allgather or alltoall, the lower
time of that pass), its per-GPU TFLOP/s, ringflash's TFLOP/s over it, and torch's efficiency.

torch's per-GPU TFLOP/s are computed here from its times with cp_bench's FLOP count (forward
4 * S^2 * H * D * 0.5, causal; forward+backward 3.5 x): the forward from tcp_f_ms, forward+backward
from tcp_fb_ms. torch's run has 32 query and 32 K/V heads (MHA) at hdim 128; ringflash rows with
another shape (GQA) get no torch columns. The table goes to DIR/cp_compare.json too (--json).
Exit status 1 if cp_bench.json cannot be read; a missing torch file only leaves its columns empty.
"""

import argparse
import json
import os
import sys

FWD_BWD_FLOPS_FACTOR = 3.5
TORCH_BACKENDS = ("flash", "cudnn")
# The shape of torch_cp_bench.py's runs: H = 32 query (and K/V) heads, D = 128, causal.
TORCH_HEADS, TORCH_HDIM = 32, 128
# The time keys of a torch row, per pass.
TORCH_TIME = {"fwd": "tcp_f_ms", "fwd_bwd": "tcp_fb_ms"}
TORCH_ONE_GPU_TIME = {"fwd": "t1_f_ms", "fwd_bwd": "t1_fb_ms"}
TORCH_EFFICIENCY = {"fwd": "eff_f", "fwd_bwd": "eff_fb"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.environ.get("OUT", "."), help="where the JSON files are (default $OUT or .)")
    p.add_argument("--ringflash", help="cp_bench.json (default DIR/cp_bench.json)")
    p.add_argument("--torch", help="torch_cp_bench.py's JSON (default DIR/torch_cp_w{P}.json)")
    p.add_argument("--json", help="where the table goes (default DIR/cp_compare.json)")
    return p.parse_args(argv)


def flops(pass_name, seqlen, heads, hdim):
    """cp_bench's count: causal forward 4 * S^2 * H * D * 0.5, forward+backward 3.5 x."""
    return 4 * seqlen * seqlen * heads * hdim * 0.5 * (FWD_BWD_FLOPS_FACTOR if pass_name == "fwd_bwd" else 1.0)


def comparable(row):
    """Whether torch's runs have this ringflash row's shape (MHA, 32 heads, hdim 128, causal)."""
    return (row["heads"] == TORCH_HEADS and row["heads_kv"] == TORCH_HEADS and row["hdim"] == TORCH_HDIM
            and row.get("causal", True) and row.get("batch", 1) == 1)


def best_torch(torch_rows, backend, seqlen, world, pass_name):
    """torch's fastest rotate method for one backend, seqlen and pass, as a dict, or None."""
    key = TORCH_TIME[pass_name]
    runs = [r for r in torch_rows if r.get("backend") == backend and r.get("seqlen") == seqlen
            and r.get("world") == world and "error" not in r and r.get(key)]
    if not runs:
        return None
    best = min(runs, key=lambda r: r[key])
    tflops = flops(pass_name, seqlen, TORCH_HEADS, TORCH_HDIM) / world / best[key] / 1e9
    one_gpu = best.get(TORCH_ONE_GPU_TIME[pass_name])
    return dict(rotate=best.get("rotate"), tp_ms=best[key], tflops_per_gpu=tflops,
                efficiency=best.get(TORCH_EFFICIENCY[pass_name]), t1_ms=one_gpu,
                one_gpu_tflops=flops(pass_name, seqlen, TORCH_HEADS, TORCH_HDIM) / one_gpu / 1e9 if one_gpu else None)


def torch_errors(torch_rows, seqlen, world):
    """torch's failed runs at this seqlen, as 'backend/rotate: error' strings."""
    return [f"{r.get('backend')}/{r.get('rotate')}: {r['error'][:80]}" for r in torch_rows
            if r.get("seqlen") == seqlen and r.get("world") == world and "error" in r]


def compare(ringflash_rows, torch_rows, world):
    table = []
    for row in ringflash_rows:
        entry = {k: row.get(k) for k in ("seqlen", "heads", "heads_kv", "hdim", "pass", "strategy", "tflops_per_gpu",
                                         "efficiency", "t1_ms", "tp_ms", "one_gpu_tflops")}
        entry["world"] = world
        if "error" in row:
            entry["error"] = row["error"]
        if row.get("check") and not row["check"].get("agrees", False):
            entry["check"] = "MISMATCH" if "error" not in row["check"] else "check error"
        if comparable(row):
            for backend in TORCH_BACKENDS:
                peer = best_torch(torch_rows, backend, row["seqlen"], world, row["pass"])
                if peer is not None and entry["tflops_per_gpu"]:
                    peer["ratio"] = entry["tflops_per_gpu"] / peer["tflops_per_gpu"]
                entry[f"torch_{backend}"] = peer
            errors = torch_errors(torch_rows, row["seqlen"], world)
            if errors:
                entry["torch_errors"] = errors
        table.append(entry)
    return table


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def render(table, world):
    lines = [f"### cp_compare table: P={world}, bf16, causal, 32 query heads, hdim 128; TFLOP/s per GPU; "
             "ratio = ringflash / torch CP (its best rotate method); eff = t1 / (P tP), each on its own t1",
             f"{'seqlen':>7} {'hkv':>4} {'pass':>7} {'strategy':>9} | {'rf TF/GPU':>9} {'rf eff':>6} | "
             + " | ".join(f"{'torch ' + b + ' TF/GPU (rotate)':>29} {'ratio':>5} {'eff':>5}" for b in TORCH_BACKENDS)]
    for e in table:
        cells = []
        for backend in TORCH_BACKENDS:
            peer = e.get(f"torch_{backend}")
            if peer is None:
                why = "n/a: not torch's shape" if f"torch_{backend}" not in e else "-"
                cells.append(f"{why:>29} {'-':>5} {'-':>5}")
            else:
                cells.append(f"{fmt(peer['tflops_per_gpu'], '.1f') + ' (' + str(peer['rotate']) + ')':>29} "
                             f"{fmt(peer.get('ratio'), '.2f'):>5} {fmt(peer['efficiency'], '.2f'):>5}")
        note = ""
        if "error" in e:
            note = "  ringflash ERROR: " + e["error"][:80]
        elif "check" in e:
            note = "  ringflash " + e["check"]
        lines.append(f"{e['seqlen']:>7} {e['heads_kv']:>4} {e['pass']:>7} {e['strategy']:>9} | "
                     f"{fmt(e['tflops_per_gpu'], '9.1f')} {fmt(e['efficiency'], '6.2f')} | " + " | ".join(cells) + note)
    errors = sorted({err for e in table for err in e.get("torch_errors", [])})
    for err in errors:
        lines.append(f"torch error: {err}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    rf_path = args.ringflash or os.path.join(args.dir, "cp_bench.json")
    try:
        with open(rf_path) as f:
            ringflash = json.load(f)
    except (OSError, ValueError) as e:
        print(f"cp_compare: cannot read ringflash's results {rf_path}: {e}", file=sys.stderr)
        return 1
    world = ringflash["info"]["world"]
    torch_path = args.torch or os.path.join(args.dir, f"torch_cp_w{world}.json")
    torch_rows = []
    try:
        with open(torch_path) as f:
            torch_rows = json.load(f)
    except (OSError, ValueError) as e:
        print(f"cp_compare: no torch CP results ({torch_path}: {e}); its columns stay empty", file=sys.stderr)
    table = compare(ringflash["rows"], torch_rows, world)
    print(render(table, world), flush=True)
    out = args.json or os.path.join(args.dir, "cp_compare.json")
    with open(out, "w") as f:
        json.dump(dict(world=world, ringflash=rf_path, torch=torch_path if torch_rows else None, rows=table), f,
                  indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
