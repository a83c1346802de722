"""Sequence-parallel attention over several ranks, checked against one device.

    torchrun --nproc_per_node 4 examples/python/sequence_parallel.py
    mpiexec -n 4 python examples/python/sequence_parallel.py

Every rank builds the same global q, k and v from a seed, keeps its shard in the strategy's layout,
runs forward and backward, and compares its shard of the output and gradients with the
single-device result: the largest max |diff| / max |single-device| over the four and over the
ranks, within --limit (default 1e-4 in fp32 and 5e-2 in bf16: both round in different places, and
this catches a wrong result, not a last-bit difference). The exit status is 1 if a strategy is
outside it. Each rank runs on the device that ``ringflash.setup_mpi_distributed()`` gives it: one
GPU per rank where CUDA is available (bf16, messages over ringflash's NCCL transport), else the CPU
(fp32, messages over MPI under mpiexec and over gloo under torchrun). ``ringflash.selected()`` says
which.
"""

import argparse
import sys
import time

import torch

import ringflash


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=4099, help="global sequence length (need not divide by P)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hdim", type=int, default=64)
    parser.add_argument("--strategies", default="ring,zigzag,stripe,allgather,ulysses,hybrid")
    parser.add_argument("--limit", type=float, default=None,
                        help="largest relative difference that agrees (default 1e-4 in fp32, 5e-2 in bf16)")
    args = parser.parse_args()

    info = ringflash.setup_mpi_distributed()  # torchrun or mpiexec; a single process works too
    rank, world, device = info["rank"], info["world_size"], info["device"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (1, args.seqlen, args.heads, args.hdim), (1, args.seqlen, args.kv_heads, args.hdim)
    q, dout = torch.randn(shape_q, generator=g), torch.randn(shape_q, generator=g)
    k, v = torch.randn(shape_kv, generator=g), torch.randn(shape_kv, generator=g)
    q, k, v, dout = (t.to(device, dtype) for t in (q, k, v, dout))

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = ringflash.flash_attn_func(*leaves, causal=True)
    reference.backward(dout)
    reference_grads = [t.grad for t in leaves]

    limit = args.limit if args.limit is not None else 1e-4 if dtype == torch.float32 else 5e-2
    failed = []
    if rank == 0:
        print(f"{world} ranks ({info['launcher']}), transport {ringflash.selected(device)['transport']}: "
              f"S={args.seqlen} H={args.heads}/{args.kv_heads} D={args.hdim} {dtype} causal on {device.type}")
        print(f"{'strategy':<10} {'fwd+bwd ms':>10} {'rel diff':>9}  check (within {limit:g})")
    for strategy in args.strategies.split(","):
        group = None
        if strategy == "hybrid":
            if world % 2:
                continue
            group = ringflash.init_process_groups(ulysses_degree=2, ring_degree=world // 2)
        pos = ringflash.shard_positions(args.seqlen, strategy, group, device=device).to(device)
        local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]

        def forward_backward():
            for t in local:
                t.grad = None
            out = ringflash.parallel_attention(*local, strategy, group, causal=True)
            out.backward(dout[:, pos])
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out

        forward_backward()  # the first call on a group also creates its communicators: not timed
        start = time.perf_counter()
        out = forward_backward()
        ms = (time.perf_counter() - start) * 1e3
        pairs = [(out, reference[:, pos])] + [(t.grad, grad[:, pos]) for t, grad in zip(local, reference_grads)]
        diff = torch.stack([relative_diff(a, b) for a, b in pairs]).max()
        torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
        ok = diff.item() <= limit
        if not ok:
            failed.append(strategy)
        if rank == 0:
            print(f"{strategy:<10} {ms:>10.1f} {diff.item():>9.1e}  {'ok' if ok else 'MISMATCH'}")
    if failed:
        if rank == 0:
            print(f"outside {limit:g}: {', '.join(failed)}")
        sys.exit(1)


def relative_diff(a, b):
    """max |a - b| / max |b| in fp32 (max |a - b| where b is all zeros)."""
    a, b = a.float(), b.float()
    scale = b.abs().max()
    diff = (a - b).abs().max()
    return diff / scale if scale > 0 else diff


if __name__ == "__main__":
    main()
