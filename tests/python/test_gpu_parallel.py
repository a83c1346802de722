"""ringflash.parallel_attention on 2 GPUs (RINGFLASH_TEST_GPUS: 4 or 8) over ringflash's NCCL
transport. Skipped unless there are that many CUDA devices and ringflash was built with CUDA and
NCCL.

Seven worlds of that many processes (the fault tests: 2), torch.distributed backend "nccl", rank r
on cuda:r, each started once:

* accuracy: ring, zigzag, stripe, allgather, ulysses, and hybrid in every 2D layout of the ranks
  (2 x 1 and 1 x 2 on 2 GPUs; ulysses x ring), x {causal, window (300, 0), window (256, 64)} x {MHA 4/4, GQA 8/2} x lengths 1013 and
  4097 (no multiple of 2P) x {fp16, bf16}, head dim 128, plus three cases at head dim 64 (one
  with 6 query and 3 K/V heads, whose middle K/V head ulysses gives both ranks); out, lse,
  dq, dk and dv. Every rank builds the global inputs from a seed, computes the float64 reference
  (reference.attention, on its own GPU) and the single-GPU result (ringflash.flash_attn_func on the
  whole sequence), and checks its shard by DESIGN.md's rule with the single-GPU result as the
  baseline:

      max |parallel - reference| <= 2 * max |single GPU - reference| + ATOL[dtype]

  (the lse, float32, with ATOL[float32]); NaN fails, and infinities must match. Failures are
  collected, not raised, so that both ranks make the same calls; their count is summed over the
  ranks (nccl-tests' CheckData), so every rank agrees on pass or fail. The world also says which
  transport ran: it must be ringflash's own NCCL transport, not the torch bridge.
* packed: every strategy on a packed batch of documents 300, 0, 1, 77, 513 and 2049 long (each
  sharded on its own, the global cu_seqlens on the CPU), causal and window (256, 64), GQA 8/2,
  bf16, against attention_varlen in float64 and ringflash.flash_attn_varlen_func, by the same rule.
* graph: a zigzag (then ulysses) forward+backward, warmed up eagerly, captured in a CUDA graph on
  static inputs and replayed with new values copied into them, gives what an eager call on those
  values gives (the forward bit for bit, the gradients up to the order of atomic adds).
* exit: each rank captures a zigzag forward+backward in a CUDA graph, replays it and keeps the
  graph alive until its process ends; every rank must exit within the world's limit (90 s), which
  is below the communicators' deadline (300 s): NCCL cannot finalise a communicator while a graph
  holds its work, and a rank that waited for that would hang at exit.
* fault: with RINGFLASH_COMM_TIMEOUT=5, rank 1 fails (raises and catches its own error) before its
  second call and stays alive, silent, a little past the deadline; rank 0 makes that call and gets
  a ringflash.CommError naming the op and rank 1 within the deadline plus slack (30 s), and
  neither rank hangs; once in a world that has captured nothing, and twice in one whose ranks
  first capture a zigzag forward+backward in a CUDA graph and keep it alive (NCCL's abort of a
  communicator waits for the graphs that hold its work). The group is not trusted afterwards: its
  ranks leave with os._exit (dist_harness's hard_exit), except in the last case, which leaves by
  the interpreter's usual end with the graph still alive.

One to two minutes on 2 H200 (estimated); every world has a hard time limit.
"""

import dataclasses
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import ringflash
from ringflash.distributed import communicator, selected
from ringflash.parallel import init_process_groups, parallel_attention, shard_positions
from dist_harness import run_world
from graph_check import capture, graph_replay_problems
from reference import ATOL, F64, attention, attention_varlen, cu_seqlens, max_error, rounded_randn

# The world of the accuracy, packed and graph tests: 2 GPUs, or RINGFLASH_TEST_GPUS of them (4 or 8
# on the larger machines); the fault test always runs on 2.
WORLD = int(os.environ.get("RINGFLASH_TEST_GPUS", "2"))
FAULT_WORLD = 2

pytestmark = pytest.mark.skipif(
    not (torch.cuda.device_count() >= WORLD and ringflash.has_cuda() and ringflash._C.has_nccl()),
    reason=f"needs {WORLD} CUDA devices and ringflash built with CUDA and NCCL")

# Never NVLink multicast (NVLS) on the device machines; a broken peer surfaces as a CommError
# within a minute instead of the default 300 s deadline.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "RINGFLASH_COMM_TIMEOUT": "60"}
FAULT_TIMEOUT_S = 5
FAULT_SLACK_S = 25  # rank 0 must have its CommError within FAULT_TIMEOUT_S + FAULT_SLACK_S
FAULT_PEER_GRACE_S = 3  # the silent rank stays alive this long past the deadline

STRATEGIES = ["ring", "zigzag", "stripe", "allgather", "ulysses"]
# (ulysses_degree, ring_degree): every 2D layout of WORLD ranks.
HYBRID = [(u, WORLD // u) for u in range(1, WORLD + 1) if WORLD % u == 0]
MASKS = {
    "causal": dict(causal=True, window=(-1, -1)),
    "window(300,0)": dict(causal=False, window=(300, 0)),
    "window(256,64)": dict(causal=False, window=(256, 64)),
}
HEADS = [(4, 4), (8, 2)]  # MHA, GQA 4:1
LENGTHS = [1013, 4097]
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class Case:
    seqlen: int
    heads: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    mask: str

    def __str__(self):
        return (f"S{self.seqlen}-H{self.heads}/{self.heads_kv}-D{self.head_dim}-{DTYPE_NAMES[self.dtype]}"
                f"-{self.mask}")


CASES = [Case(seqlen, heads, heads_kv, 128, dtype, mask)
         for seqlen in LENGTHS for dtype in DTYPE_NAMES for mask in MASKS for heads, heads_kv in HEADS]
CASES += [Case(1013, 8, 2, 64, torch.bfloat16, "causal"), Case(4097, 4, 4, 64, torch.float16, "window(256,64)"),
          Case(1013, 6, 3, 64, torch.bfloat16, "causal")]  # ulysses: a KV head on both ranks, summed into a slice
RUNS_PER_CASE = len(STRATEGIES) + len(HYBRID)


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank)


def _global_inputs(seqlen, heads, heads_kv, head_dim, dtype, seed, device):
    """q, k, v and dout of the whole sequence, (1, S, H, D), the same on every rank; made on the CPU
    from the seed (rounded to dtype), then moved to device."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, seqlen, heads, head_dim), (1, seqlen, heads_kv, head_dim), (1, seqlen, heads_kv, head_dim),
              (1, seqlen, heads, head_dim)]
    return [rounded_randn(shape, dtype, g).to(device) for shape in shapes]


def _failed_everywhere(failures, device) -> int:
    """The number of failures summed over the ranks of the default group."""
    count = torch.tensor([len(failures)], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    return int(count.item())


def _pass_rule(name, got, ref, single, dtype):
    """None if `got` passes DESIGN.md's rule with the single-GPU result as the baseline, else why not."""
    got, ref, single = got.detach(), ref.detach(), single.detach()
    if got.shape != ref.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    if torch.isnan(got).any():
        return f"{name}: {int(torch.isnan(got).sum())} NaN entries"
    inf_got, inf_ref = torch.isinf(got), torch.isinf(ref)
    if not (torch.equal(inf_got, inf_ref) and torch.equal(got[inf_got].to(F64), ref[inf_ref])):
        return f"{name}: infinities differ: {int(inf_got.sum())} in ringflash, {int(inf_ref.sum())} in the reference"
    err, err_single = max_error(got, ref), max_error(single, ref)
    bound = 2 * err_single + ATOL[dtype]
    if err > bound:
        return (f"{name} ({dtype}): max |parallel - reference| = {err:.3g} > {bound:.3g} = 2 * {err_single:.3g} "
                f"(single GPU) + {ATOL[dtype]:g}")
    return None


class SingleGpuReference:
    """One global case on this rank's GPU: the float64 reference and ringflash's single-GPU result
    (out, lse, dq, dk, dv of each), against which every strategy's shard is checked."""

    def __init__(self, case: Case, seed: int, device: torch.device):
        self.case = case
        self.mask = MASKS[case.mask]
        self.q, self.k, self.v, self.dout = _global_inputs(case.seqlen, case.heads, case.heads_kv, case.head_dim,
                                                           case.dtype, seed, device)
        # reference.attention makes its index masks with factory functions: on this GPU here.
        with torch.device(device):
            xs = [t.to(F64).requires_grad_() for t in (self.q, self.k, self.v)]
            out, lse = attention(*xs, dtype=F64, **self.mask)
            out.backward(self.dout.to(F64))
        self.reference = [out.detach(), lse.detach()] + [x.grad for x in xs]
        del out, lse, xs
        xs = [t.clone().requires_grad_() for t in (self.q, self.k, self.v)]
        out, lse = ringflash.flash_attn_func(*xs, causal=self.mask["causal"], window_size=self.mask["window"],
                                             return_softmax_lse=True)
        out.backward(self.dout)
        self.single = [out.detach(), lse.detach()] + [x.grad for x in xs]

    def check(self, strategy, group, positions, what):
        """Runs the strategy on this rank's shard (global rows `positions`), forward and backward;
        returns the list of what failed (empty if everything passed)."""
        pos = positions.to(self.q.device)
        xs = [t[:, pos].clone().requires_grad_() for t in (self.q, self.k, self.v)]  # (1, S, H, D) -> (1, S_l, H, D)
        out, lse = parallel_attention(*xs, strategy, group, causal=self.mask["causal"],
                                      window_size=self.mask["window"], return_lse=True)
        out.backward(self.dout[:, pos])
        got = [out, lse] + [x.grad for x in xs]
        problems = []
        if out.dtype != self.case.dtype or lse.dtype != torch.float32:
            problems.append(f"{what}: out {out.dtype} and lse {lse.dtype}, expected {self.case.dtype} and float32")
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            if got[i] is None:
                problems.append(f"{what} {name}: no gradient reached the input")
                continue
            rows = (lambda t: t[..., pos]) if name == "lse" else (lambda t: t[:, pos])  # lse (B, H, S)
            problem = _pass_rule(f"{what} {name}", got[i], rows(self.reference[i]), rows(self.single[i]),
                                 torch.float32 if name == "lse" else self.case.dtype)
            if problem:
                problems.append(problem)
        return problems


def _accuracy_body(rank, world):
    device = _device(rank)
    # Made once, by every rank in the same order: each group is a communicator of its own.
    runs = [(strategy, None, strategy) for strategy in STRATEGIES]
    runs += [("hybrid", init_process_groups(ulysses, ring), f"hybrid {ulysses}x{ring}") for ulysses, ring in HYBRID]
    transport = dict(selected=selected(device), communicator=communicator(None, device).transport)
    failures, checked = [], 0
    for seed, case in enumerate(CASES):
        ref = SingleGpuReference(case, seed, device)
        for strategy, group, name in runs:
            positions = shard_positions(case.seqlen, strategy, group, device=device)
            what = f"{name} P={world} {case}"
            try:
                failures += ref.check(strategy, group, positions, what)
            except (ringflash.InvalidArgument, ringflash.NotSupported) as e:
                # Refused before anything is sent, on both ranks alike (the same shapes and options).
                failures.append(f"{what}: {type(e).__name__}: {e}")
            checked += 1
        del ref
    return dict(transport=transport, checked=checked, failures=failures,
                failed_everywhere=_failed_everywhere(failures, device))


@pytest.fixture(scope="module")
def accuracy():
    return run_world(WORLD, _accuracy_body, backend="nccl", env=GPU_ENV, timeout=420)


def test_the_nccl_transport_runs(accuracy):
    for result in accuracy:
        assert result["transport"] == {"selected": {"transport": "nccl", "kernel": "cuda"}, "communicator": "nccl"}


def test_every_strategy_matches_the_single_gpu_result(accuracy):
    assert [r["checked"] for r in accuracy] == [len(CASES) * RUNS_PER_CASE] * WORLD
    totals = {r["failed_everywhere"] for r in accuracy}
    assert len(totals) == 1, f"the ranks disagree on the failure count: {totals}"
    failures = [f"rank {rank}: {f}" for rank, r in enumerate(accuracy) for f in r["failures"]]
    assert totals == {0} and not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


# Packed batches: documents of these lengths (one empty, one of a single token), each sharded on
# its own; GQA 8/2, hdim 128, bf16.
PACKED_LENGTHS = [300, 0, 1, 77, 513, 2049]
PACKED_MASKS = ["causal", "window(256,64)"]


def _packed_references(mask, seed, device):
    """Inputs (q, k, v, dout), the float64 reference and the single-GPU result (out, lse, dq, dk,
    dv each) of one packed batch; cu_seqlens on the CPU."""
    cu = cu_seqlens(PACKED_LENGTHS)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    shapes = [(total, 8, 128), (total, 2, 128), (total, 2, 128), (total, 8, 128)]
    inputs = [rounded_randn(shape, torch.bfloat16, g).to(device) for shape in shapes]
    q, k, v, dout = inputs
    with torch.device(device):
        xs = [t.to(F64).requires_grad_() for t in (q, k, v)]
        out, lse = attention_varlen(*xs, cu, cu, dtype=F64, causal=mask["causal"], window=mask["window"])
        out.backward(dout.to(F64))
    reference = [out.detach(), lse.detach()] + [x.grad for x in xs]
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    cu_gpu, longest = cu.to(device), max(PACKED_LENGTHS)
    out, lse = ringflash.flash_attn_varlen_func(*xs, cu_gpu, cu_gpu, longest, longest, causal=mask["causal"],
                                                window_size=mask["window"], return_softmax_lse=True)
    out.backward(dout)
    single = [out.detach(), lse.detach()] + [x.grad for x in xs]
    return cu, inputs, reference, single


def _packed_body(rank, world):
    device = _device(rank)
    runs = [(strategy, None, strategy) for strategy in STRATEGIES]
    runs += [("hybrid", init_process_groups(ulysses, ring), f"hybrid {ulysses}x{ring}") for ulysses, ring in HYBRID]
    failures, checked = [], 0
    for seed, mask_name in enumerate(PACKED_MASKS):
        mask = MASKS[mask_name]
        cu, (q, k, v, dout), reference, single = _packed_references(mask, 100 + seed, device)
        for strategy, group, name in runs:
            what = f"packed {name} P={world} {mask_name}"
            pos = torch.cat([shard_positions(n, strategy, group, device=device) + int(cu[b])
                             for b, n in enumerate(PACKED_LENGTHS)]).to(device)
            try:
                xs = [t[pos].clone().requires_grad_() for t in (q, k, v)]
                out, lse = parallel_attention(*xs, strategy, group, causal=mask["causal"], window_size=mask["window"],
                                              cu_seqlens=cu, return_lse=True)
                out.backward(dout[pos])
                got = [out, lse] + [x.grad for x in xs]
                for i, part in enumerate(("out", "lse", "dq", "dk", "dv")):
                    rows = (lambda t: t[:, pos]) if part == "lse" else (lambda t: t[pos])  # lse (H, T)
                    problem = _pass_rule(f"{what} {part}", got[i], rows(reference[i]), rows(single[i]),
                                         torch.float32 if part == "lse" else torch.bfloat16)
                    if problem:
                        failures.append(problem)
            except (ringflash.InvalidArgument, ringflash.NotSupported) as e:
                failures.append(f"{what}: {type(e).__name__}: {e}")
            checked += 1
    return dict(checked=checked, failures=failures, failed_everywhere=_failed_everywhere(failures, device))


def test_packed_batches_match_the_single_gpu_result():
    results = run_world(WORLD, _packed_body, backend="nccl", env=GPU_ENV, timeout=300)
    assert [r["checked"] for r in results] == [len(PACKED_MASKS) * RUNS_PER_CASE] * WORLD
    totals = {r["failed_everywhere"] for r in results}
    assert len(totals) == 1, f"the ranks disagree on the failure count: {totals}"
    failures = [f"rank {rank}: {f}" for rank, r in enumerate(results) for f in r["failures"]]
    assert totals == {0} and not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


GRAPH_STRATEGIES = ["zigzag", "ulysses"]
GRAPH_CASE = Case(4097, 8, 2, 128, torch.bfloat16, "causal")


def _graph_body(rank, world):
    device = _device(rank)
    case = GRAPH_CASE
    failures = []
    for strategy in GRAPH_STRATEGIES:
        pos = shard_positions(case.seqlen, strategy, device=device).to(device)
        # Capture, then two replays with other values; one dout throughout.
        values = [[t[:, pos] for t in _global_inputs(case.seqlen, case.heads, case.heads_kv, case.head_dim,
                                                     case.dtype, seed, device)] for seed in (40, 41, 42)]
        dout = values[0][3]

        def attend(q, k, v, strategy=strategy):
            return parallel_attention(q, k, v, strategy, causal=True, return_lse=True)

        problems = graph_replay_problems(attend, [qkvd[:3] for qkvd in values], dout, warmup_steps=2,
                                         exact_grads=False)
        failures += [f"{strategy} {problem}" for problem in problems]
    return dict(failures=failures, failed_everywhere=_failed_everywhere(failures, device))


def test_cuda_graph_capture_and_replay():
    results = run_world(WORLD, _graph_body, backend="nccl", env=GPU_ENV, timeout=240)
    failures = [f"rank {rank}: {f}" for rank, r in enumerate(results) for f in r["failures"]]
    assert [r["failed_everywhere"] for r in results] == [0] * WORLD and not failures, "\n".join(failures)


# Graphs that a rank's body leaves alive: they go only when its process's interpreter ends, after
# ringflash's communicators are released (the order of a script that keeps its graphs).
_KEPT_GRAPHS = []
EXIT_LIMIT_S = 90  # the world's limit, below the communicators' deadline in EXIT_ENV
EXIT_ENV = dict(GPU_ENV, RINGFLASH_COMM_TIMEOUT="300")


def _keep_a_graph(rank):
    """Captures a zigzag forward+backward in a CUDA graph (collective: every rank of the world
    calls it), replays it once and keeps it until the process ends; whether the replay's dq is
    finite."""
    device = _device(rank)
    case = GRAPH_CASE
    pos = shard_positions(case.seqlen, "zigzag", device=device).to(device)
    q, k, v, dout = (t[:, pos] for t in _global_inputs(case.seqlen, case.heads, case.heads_kv, case.head_dim,
                                                       case.dtype, 43, device))
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def step():
        parallel_attention(*static, "zigzag", causal=True).backward(dout)

    graph, _ = capture(step, static, warmup_steps=1)
    graph.replay()
    torch.cuda.synchronize()
    _KEPT_GRAPHS.append(graph)
    return bool(torch.isfinite(static[0].grad).all())


def _kept_graph_body(rank, world):
    return dict(replayed=_keep_a_graph(rank))


def test_ranks_exit_while_a_captured_graph_is_alive():
    # NCCL finalises a communicator only once the graphs that hold its work are gone; a rank that
    # waited for that at exit would hang until the communicators' deadline, past the world's limit.
    start = time.monotonic()
    results = run_world(WORLD, _kept_graph_body, backend="nccl", env=EXIT_ENV, timeout=EXIT_LIMIT_S)
    assert [r["replayed"] for r in results] == [True] * WORLD
    assert time.monotonic() - start < EXIT_LIMIT_S


def _fault_body(rank, world, keep_graph):
    device = _device(rank)
    seqlen = 1013
    pos = shard_positions(seqlen, "zigzag", device=device).to(device)
    q, k, v = (t[:, pos] for t in _global_inputs(seqlen, 4, 4, 128, torch.bfloat16, 50, device)[:3])
    comm = communicator(None, device)
    # One call that both ranks make, so that the communicator exists (its setup is collective) and
    # works before the fault.
    parallel_attention(q, k, v, "zigzag", causal=True)
    comm.synchronize()
    if keep_graph:  # the world's failure then aborts communicators whose work a live graph holds
        _keep_a_graph(rank)
    start = time.monotonic()
    if rank == 1:
        try:
            raise RuntimeError("rank 1 fails before its send")
        except RuntimeError as e:
            # Silent, not gone: alive until rank 0's deadline has passed, so that rank 0 meets the
            # deadline rather than a closed connection.
            time.sleep(FAULT_TIMEOUT_S + FAULT_PEER_GRACE_S)
            return dict(error=str(e), seconds=time.monotonic() - start)
    try:
        parallel_attention(q, k, v, "zigzag", causal=True)
        comm.synchronize()  # stream-ordered: the wait, and so the error, may come only here
    except ringflash.CommError as e:
        return dict(message=str(e), seconds=time.monotonic() - start, timeout=comm.timeout)
    return dict(message=None, seconds=time.monotonic() - start, timeout=comm.timeout)


# (keep_graph, hard_exit): the fault in a world that has captured nothing, and in one whose ranks
# keep a captured graph alive, leaving by os._exit and by the interpreter's usual end.
@pytest.mark.parametrize("keep_graph,hard_exit", [(False, True), (True, True), (True, False)],
                         ids=["eager", "graph-alive", "graph-alive-usual-exit"])
def test_a_silent_peer_ends_in_a_comm_error_at_the_deadline(keep_graph, hard_exit):
    env = dict(GPU_ENV, RINGFLASH_COMM_TIMEOUT=str(FAULT_TIMEOUT_S))
    # A hang of either rank fails the test at the harness's limit.
    waiting, silent = run_world(FAULT_WORLD, _fault_body, keep_graph, backend="nccl", env=env, hard_exit=hard_exit,
                                timeout=150)
    assert silent["error"] == "rank 1 fails before its send"
    assert waiting["timeout"] == FAULT_TIMEOUT_S
    message = waiting["message"]
    assert message is not None, f"rank 0 got no error after {waiting['seconds']:.1f} s from a peer that never sent"
    assert re.match(r"\[\w+\]", message), f"the message does not name the op: {message}"
    assert re.search(r"\brank 1\b(?! of)", message), f"the message does not name the peer, rank 1: {message}"
    assert waiting["seconds"] < FAULT_TIMEOUT_S + FAULT_SLACK_S, (waiting["seconds"], message)
