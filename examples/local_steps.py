"""Train an MLP on digits with local steps and sparse syncs (LocalSteps), launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/local_steps.py
    torchrun --standalone --nproc_per_node=2 examples/local_steps.py \
        --checkpoint-dir ckpt --save-every 10     # kill it, run it again: it resumes
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 examples/local_steps.py \
        --checkpoint-dir ckpt --crash-at-step 12  # a rank dies; torchrun restarts, it resumes

    torchrun --standalone --nproc_per_node=3 examples/local_steps.py \
        --checkpoint-dir ckpt               # again with 2 or 3: resumed at the new size
    torchrun --nnodes=1:3 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        --max-restarts=3 examples/local_steps.py --checkpoint-dir ckpt   # one per machine

    torchft_lighthouse --min_replicas 2 &      # train on when machines come and go (torchft)
    python examples/local_steps.py --elastic http://HOST:29510 --replica 0   # on machine 0
    python examples/local_steps.py --elastic http://HOST:29510 --replica 1   # on machine 1 ...

Each rank trains its own replica with AdamW on its own share of the minibatches; every 10 inner
steps the replicas' moves are threshold-encoded with error feedback, exchanged, averaged into
the global copy by the outer optimizer, and every replica restarts from it. The training loop
is an ordinary one: LocalSteps hooks ``inner.step()``. With ``--checkpoint-dir`` every rank
saves its model, inner optimizer and LocalSteps state every ``--save-every`` steps and resumes
from the newest step that every rank saved and can read (past a damaged file, all ranks fall
back alike: ``rank_checkpoints.py``), under ``torchrun --max-restarts`` too. A step saved by
a world of another size (a machine gone for good, or one more, under torchrun's elastic
``--nnodes=MIN:MAX``) resumes resized: ``sync.load_state_dict(every_rank_file, resize=True)``.

The other way needs no restart: with ``--elastic`` (``pip install gradshare[ft]``) each
machine runs one process and torchft's lighthouse says who takes part in each sync. A machine
that dies is dropped at the next sync and the others train on; started again (or a new one),
it heals from a live peer (global copy, optimizers, LR schedule, counters) and enters at the
others' step; SIGTERM makes it leave at its next sync, its residual sent whole.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gradshare
from gradshare.app.datasets import digits, minibatches, mlp

from rank_checkpoints import latest_of_any_world, save


def schedule(split, epochs: int, batch_size: int, rank: int, world: int) -> list:
    """This rank's minibatches: every epoch shuffled alike on all ranks, dealt out evenly."""
    out = []
    for epoch in range(epochs):
        batches = minibatches(split.x_train, split.y_train, batch_size, seed=epoch)
        out += batches[: len(batches) // world * world][rank::world]
    return out


def init_distributed() -> None:
    """``init_process_group("gloo")``; under torchrun's agent store, with a key prefix per
    restart attempt (a restarted attempt would otherwise read the dead one's addresses)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=300))
    attempt_store = dist.PrefixStore(f"attempt{attempt}/", store)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=attempt_store, rank=rank, world_size=world)


def elastic_batches(split, epochs: int, batch_size: int, replica: int) -> list:
    """Under ``--elastic`` the ranks come and go: each replica shuffles with its own seed."""
    out = []
    for epoch in range(epochs):
        out += minibatches(split.x_train, split.y_train, batch_size, seed=1000 * replica + epoch)
    return out


def resume(ckpt: Path, model, inner, sync, rank: int, world: int) -> tuple[int, bool]:
    """Load the newest step every rank can read; a step saved by a world of another size is
    resized (``resize=True``: the departed ranks' residuals are folded into the others', a new
    rank starts from the global copy with a peer's optimizer state). Returns the step, and
    whether the world was resized."""
    start, saved, states = latest_of_any_world(ckpt, rank)
    if not states:
        return 0, False
    peer = states[f"step{start:06d}/rank{rank % saved}.pt"]  # this rank's own, if it was one
    if rank < saved:
        model.load_state_dict(peer["model"])
    inner.load_state_dict(peer["inner"])
    if saved == world:
        sync.load_state_dict(peer["sync"])
    else:
        sync.load_state_dict({name: s["sync"] for name, s in states.items()}, resize=True)
    if rank == 0:
        print(f"resumed from step {start}" + (f", resized from {saved} to {world} ranks"
                                              if saved != world else ""))  # fmt: skip
    return start, saved != world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--out", type=str, default=None, help="rank 0 saves the parameters here")
    parser.add_argument(
        "--elastic",
        metavar="LIGHTHOUSE",
        default=None,
        help="train on when machines come and go: torchft's lighthouse address",
    )
    parser.add_argument("--replica", type=int, default=0, help="this machine's number (--elastic)")
    parser.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="the last rank dies at this step (first attempt only)",
    )
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    split = digits(seed=0)
    model = mlp(split.num_features, split.num_classes, hidden=64, seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.elastic is None:
        init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        sync = gradshare.LocalSteps(model, inner, sync_every=args.sync_every)  # the added line
        batches = schedule(split, args.epochs, args.batch_size, rank, world)
    else:  # no torchrun: a joiner heals here and starts at the others' step
        rank, world = args.replica, 1
        elastic = gradshare.Elastic(args.elastic, replica_id=f"replica{args.replica}")
        sync = gradshare.LocalSteps(model, inner, sync_every=args.sync_every, elastic=elastic)
        batches = elastic_batches(split, args.epochs, args.batch_size, args.replica)
    steps = len(batches) if args.steps is None else min(args.steps, len(batches))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    check = False
    if args.checkpoint_dir is not None and args.elastic is None:
        _, check = resume(args.checkpoint_dir, model, inner, sync, rank, world)
    while sync.steps < steps and not sync.left:  # sync.left: this machine was asked to leave
        step = sync.steps
        if step == args.crash_at_step and rank == world - 1 and first_attempt:
            os._exit(1)  # a worker dies (tests use this)
        x, y = batches[step]
        loss = F.cross_entropy(model(x), y)
        inner.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        syncs = sync.syncs
        inner.step()  # every sync_every-th step ends with a sync
        if check and sync.syncs > syncs:  # the first sync after a resize
            check = False
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)
            same = all(torch.equal(every[0], f) for f in every)
            if rank == 0:
                print(f"replicas {'identical' if same else 'DIFFER'} after the first sync")
        done = sync.steps
        if args.checkpoint_dir is not None and done % args.save_every == 0:
            state = {
                "model": model.state_dict(),
                "inner": inner.state_dict(),
                "sync": sync.state_dict(),
            }
            save(args.checkpoint_dir, done, rank, state)
        if rank == 0 and (done % 50 == 0 or done == steps):
            print(f"step {done:4d}  loss {loss.item():.4f}  syncs {sync.syncs}")
    if args.elastic is None:
        sync.average()  # the replicas end alike, wherever the last sync was
    with torch.no_grad():
        accuracy = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
    if args.out is not None and (rank == 0 or args.elastic is not None):  # each machine its own
        torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), args.out)
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}")
        print(
            f"step {steps}: rank 0 sent {sync.bytes_sent:,} B vs {sync.dense_bytes:,} B dense "
            f"({sync.dense_bytes / max(sync.bytes_sent, 1):.0f}x less)"
        )
    sync.close()
    if args.elastic is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
