"""A forward+backward captured in a CUDA graph against eager calls: the check of test_cuda.py (one
GPU) and test_gpu_parallel.py (a strategy on 2 GPUs over NCCL).

    problems = graph_replay_problems(attend, values, dout, warmup_steps=3, exact_grads=False)

``attend(q, k, v) -> (out, lse)``. The graph is captured on static copies of ``values[0]`` and
replayed with each later set of ``values`` copied into them; every replay is compared with an eager
call on the same values. ``capture(step, static, warmup_steps)`` is its warm-up and capture alone.
"""

import torch

__all__ = ["capture", "graph_replay_problems"]

RESULT_NAMES = ("out", "lse", "dq", "dk", "dv")


def capture(step, static, warmup_steps):
    """step() run `warmup_steps` times on a side stream (torch.cuda.graphs: whole-network capture),
    then captured in a CUDA graph with the gradients of `static` (its input leaves) unset, so that
    the graph allocates them and its replays overwrite them. Returns the graph and what step()
    returned during the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_steps):
            for t in static:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def graph_replay_problems(attend, values, dout, *, warmup_steps, exact_grads):
    """Captures attend(q, k, v) and out.backward(dout) in a CUDA graph and replays it.

    values: three or more [q, k, v] sets, on the CPU or on dout's device; the static inputs (leaves
    that require grad) are copies on dout's device. The capture runs on values[0], after
    `warmup_steps` eager steps on a side stream; each later set is copied into the static inputs and
    the graph replayed. out and lse must equal the eager call's bit for bit, and so must dq, dk, dv
    where exact_grads (deterministic kernels); otherwise they are held to assert_close, since atomic
    adds may come in another order. Two replays on different values must give different outs, or
    the graph ignored its inputs.

    Returns what differed, one line each (empty if nothing did). It does not raise on a difference,
    so that the ranks of a collective `attend` go on making the same calls.
    """
    device = dout.device
    static = [t.to(device, copy=True).requires_grad_() for t in values[0]]

    def step():
        out, lse = attend(*static)
        out.backward(dout)
        return out, lse

    graph, (static_out, static_lse) = capture(step, static, warmup_steps)

    problems, replayed_outs = [], []
    for new in values[1:]:
        with torch.no_grad():
            for t, value in zip(static, new):
                t.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_out.detach().clone(), static_lse.detach().clone()] + [t.grad.clone() for t in static]
        xs = [t.to(device, copy=True).requires_grad_() for t in new]
        out, lse = attend(*xs)
        out.backward(dout)
        eager = [out.detach(), lse.detach()] + [x.grad for x in xs]
        for name, got, expected in zip(RESULT_NAMES, replayed, eager):
            if exact_grads or name in ("out", "lse"):
                if not torch.equal(got, expected):
                    problems.append(f"{name}: the replay differs from the eager call by "
                                    f"{(got.float() - expected.float()).abs().max().item():.3g}")
            else:  # atomics may add in another order: last-bit differences only
                try:
                    torch.testing.assert_close(got, expected)
                except AssertionError as e:
                    problems.append(f"{name}: the replay differs from the eager call: {e}")
        replayed_outs.append(replayed[0])
    if torch.equal(replayed_outs[0], replayed_outs[1]):
        problems.append("out: two replays on different inputs gave the same out")
    return problems
