"""Train an MLP on digits with SharedOptimizer: one process per worker, launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_shared.py
    torchrun --standalone --nproc_per_node=2 examples/torchrun_shared.py \
        --checkpoint-dir ckpt --save-every 10     # kill it, run it again: it resumes
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 examples/torchrun_shared.py \
        --checkpoint-dir ckpt --crash-at-step 12  # a rank dies; torchrun restarts, it resumes

Each rank trains on its own share of every epoch's minibatches; the optimizer's updates are
threshold-encoded, exchanged over torch.distributed (gloo on CPU, NCCL on CUDA) and applied
alike on every rank. With ``--checkpoint-dir`` every rank saves its own state (model,
optimizer, residual, threshold) every ``--save-every`` steps and resumes from the newest step
that every rank saved and can read (past a damaged file, all ranks fall back alike:
``rank_checkpoints.py``). That is also what makes an elastic restart whole: under ``torchrun
--max-restarts=N`` a worker that dies takes the others down, torchrun starts them all again
(``TORCHELASTIC_RESTART_COUNT`` counts the attempts), and they resume from the checkpoints to
the parameters an uninterrupted run reaches. ``--crash-at-step K`` kills the
last rank at step K of the first attempt, to try it; ``--hierarchical`` uses
``SharedOptimizer(..., hierarchical=True)`` (dense inside a machine, encoded across).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

from gradshare import AdaptiveThreshold, SharedOptimizer
from gradshare.app.datasets import digits, minibatches, mlp

from rank_checkpoints import latest_readable, save


def schedule(split, epochs: int, batch_size: int, rank: int, world: int) -> list:
    """This rank's minibatches, in order: every epoch shuffled alike on all ranks, dealt out.

    Every rank gets as many steps (a remainder that cannot go round is dropped), since each
    step is a collective that every rank must join.
    """
    out = []
    for epoch in range(epochs):
        batches = minibatches(split.x_train, split.y_train, batch_size, seed=epoch)
        out += batches[: len(batches) // world * world][rank::world]
    return out


def init_distributed() -> None:
    """``init_process_group("gloo")``, with the store's keys kept apart per restart attempt.

    torchrun hands every attempt the same rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``)
    and ``env://`` adds no attempt prefix to its keys, so the gloo group of a restarted
    attempt would read the dead attempt's addresses and hang (torch 2.13, measured); a
    prefix per attempt keeps them apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=300))
    attempt_store = dist.PrefixStore(f"attempt{attempt}/", store)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=attempt_store, rank=rank, world_size=world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--threshold", type=float, default=1e-3, help="adaptive, initial value")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--out",
        type=str,
        default=None,
        help="rank 0 saves the parameters here; every rank if it has {rank}",
    )
    parser.add_argument(
        "--hierarchical",
        action="store_true",
        help="dense all-reduce inside a machine, encoded messages across",
    )
    parser.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="the last rank dies at this step (first attempt only)",
    )
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    split = digits(seed=0)
    model = mlp(split.num_features, split.num_classes, hidden=256, seed=0)
    opt = SharedOptimizer(  # the one line that changes: wrap the optimizer
        torch.optim.SGD(model.parameters(), lr=args.lr),
        threshold=AdaptiveThreshold(args.threshold),
        hierarchical=args.hierarchical,
    )
    batches = schedule(split, args.epochs, args.batch_size, rank, world)
    steps = len(batches) if args.steps is None else min(args.steps, len(batches))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    start = 0
    if args.checkpoint_dir is not None:
        start, state = latest_readable(args.checkpoint_dir, rank, world)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            if rank == 0:
                print(f"resumed from step {start}")
    for step in range(start, steps):
        if step == args.crash_at_step and rank == world - 1 and first_attempt:
            os._exit(1)  # a worker dies (tests use this)
        x, y = batches[step]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        done = step + 1
        if args.checkpoint_dir is not None and done % args.save_every == 0:
            state = {"step": done, "model": model.state_dict(), "optimizer": opt.state_dict()}
            save(args.checkpoint_dir, done, rank, state)
        if rank == 0 and (done % 50 == 0 or done == steps):
            s = opt.last_stats
            assert s is not None
            print(
                f"step {done:4d}  loss {loss.item():.4f}  threshold {s.threshold:.2e}  "
                f"density {s.density:.2e}  sent {opt.bytes_sent:,} B"
            )
    with torch.no_grad():
        accuracy = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if args.out is not None and (rank == 0 or "{rank}" in args.out):
        torch.save(flat, args.out.format(rank=rank))
    if rank == 0:
        dense = 4 * opt.numel * opt.iteration
        print(
            f"test accuracy {accuracy:.4f}; rank 0 sent {opt.bytes_sent:,} B "
            f"vs {dense:,} B dense ({dense / max(opt.bytes_sent, 1):.0f}x less)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
