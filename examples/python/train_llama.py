"""Trains a small Llama on one long packed sequence, split across ranks, with each strategy.

    torchrun --nproc_per_node 4 examples/python/train_llama.py
    mpiexec -n 4 python examples/python/train_llama.py
    torchrun --nproc_per_node 4 examples/python/train_llama.py --strategies zigzag,ulysses --seqlen 8192

A randomly initialised LlamaForCausalLM (no download; GQA: 8 query heads, 2 key/value heads) runs
unchanged on ringflash attention: `ringflash.hf.apply(model, strategy)` is the only change to the
model. Every rank builds the same global batch, one row of several documents packed together
(position_ids restart at 0 for each), keeps its shard (`shard_batch`), and trains for a few steps
on it. Every strategy starts from the same weights, so their losses agree step by step; the
script prints the loss and tokens per second of each step, then a table.

CPU ranks over gloo (torchrun) or MPI (mpiexec); one thread per rank by default (--threads).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ringflash.hf
from ringflash.distributed import selected, setup_mpi_distributed
from ringflash.parallel import STRATEGIES, init_process_groups, parallel_group


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, from {','.join(STRATEGIES)} (default: all)")
    p.add_argument("--seqlen", type=int, default=4096, help="tokens in the packed sequence (default 4096)")
    p.add_argument("--docs", type=int, default=5, help="documents packed into it (default 5)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per strategy (default 4)")
    p.add_argument("--ulysses-degree", type=int, default=0,
                   help="hybrid: ranks in a ulysses group; the ring takes the rest (default: 2 when the "
                        "world size is even, else 1)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in args.strategies:
        if s not in STRATEGIES:
            p.error(f"--strategies: {s!r} is not one of {', '.join(STRATEGIES)}")
    if args.docs < 1 or args.seqlen < args.docs:
        p.error(f"--docs must be between 1 and --seqlen, got {args.docs}")
    return args


def packed_batch(args):
    """One row of `docs` documents of random lengths; the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(args.seed)
    cuts = torch.randperm(args.seqlen - 1, generator=g)[: args.docs - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [args.seqlen]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    input_ids = torch.randint(0, args.vocab, (1, args.seqlen), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[0, bounds[1:-1]] = -100  # a document's first token is no target of the previous one
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}, lengths


def build_model(args, strategy):
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=(8 * args.hidden // 3 + 15) // 16 * 16,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=max(args.seqlen, 2048))
    torch.manual_seed(args.seed)  # the same initial weights on every rank and for every strategy
    model = LlamaForCausalLM(config).train()
    return ringflash.hf.apply(model, strategy)


def train(args, strategy, group, batch, rank):
    model = build_model(args, strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    local = ringflash.hf.shard_batch(batch, strategy, group)
    labels = local.pop("shift_labels")
    losses, seconds = [], []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        logits = model(**local, use_cache=False).logits                  # (1, S_local, V)
        loss = ringflash.hf.sequence_parallel_loss(logits, labels, group)  # global mean, on every rank
        loss.backward()
        ringflash.hf.all_reduce_gradients(model, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        losses.append(float(loss.detach()))
        seconds.append(elapsed)
        if rank == 0:
            print(f"[{strategy:>9}] step {step + 1}/{args.steps}  loss {losses[-1]:.5f}  {elapsed:6.2f} s  "
                  f"{args.seqlen / elapsed:8.0f} tokens/s", flush=True)
    return losses, seconds, local["input_ids"].shape[1]


def main():
    args = parse_args()
    info = setup_mpi_distributed()
    torch.set_num_threads(args.threads)
    rank, world = info["rank"], info["world_size"]
    batch, lengths = packed_batch(args)
    groups = {s: parallel_group() for s in args.strategies}
    if "hybrid" in args.strategies:
        ulysses = args.ulysses_degree or (2 if world % 2 == 0 else 1)
        if world % ulysses:
            raise SystemExit(f"--ulysses-degree {ulysses} does not divide the world size {world}")
        groups["hybrid"] = init_process_groups(ulysses, world // ulysses)  # collective: every rank
        hybrid_name = f"hybrid {ulysses}x{world // ulysses}"
    if rank == 0:
        print(f"{world} ranks ({info['launcher']}, transport {selected()['transport']}), {args.threads} thread(s) "
              f"each; Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV "
              f"heads, vocab {args.vocab}; {args.seqlen} tokens in {len(lengths)} documents {lengths}", flush=True)
    results = {}
    for strategy in args.strategies:
        results[strategy] = train(args, strategy, groups[strategy], batch, rank)
    if rank == 0:
        first = [r[0][0] for r in results.values()]
        print(f"\n{'strategy':<12}{'rank-0 tokens':>14}{'loss first':>12}{'loss last':>12}{'s/step':>9}"
              f"{'tokens/s':>10}")
        for strategy, (losses, seconds, local_len) in results.items():
            timed = seconds[1:] or seconds  # the first step warms up
            name = hybrid_name if strategy == "hybrid" else strategy
            print(f"{name:<12}{local_len:>14}{losses[0]:>12.5f}{losses[-1]:>12.5f}"
                  f"{statistics.median(timed):>9.2f}{args.seqlen / statistics.median(timed):>10.0f}")
        print(f"(tokens/s: the whole sequence over the median step after the first; first-step losses agree "
              f"within {max(first) - min(first):.1e})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
