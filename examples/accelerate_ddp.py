"""Train an MLP on digits with accelerate, DDP's all-reduce replaced by gradshare's hook.

    python examples/accelerate_ddp.py                          # starts its own 2 CPU processes
    python examples/accelerate_ddp.py --steps 30 --save-at 15 --checkpoint-dir ckpt
    python examples/accelerate_ddp.py --steps 30 --resume ckpt

An ordinary accelerate loop plus two lines after ``accelerator.prepare``:
``register_threshold_hook(model)`` on the DDP model accelerate built, and
``register_rank_checkpointing(accelerator, state)`` so that ``accelerator.save_state(dir)``
also writes ``dir/gradshare-rank{r}.pt`` on every rank (accelerate itself writes registered
objects from the main process only). ``accelerate.notebook_launcher`` starts the 2 processes
(gloo, 127.0.0.1, a free port).

``--share local``: no all-reduce at all. Forward and backward run under
``accelerator.no_sync(model)`` (DDP keeps every gradient local), each rank steps its own
replica, and ``LocalSteps(accelerator.unwrap_model(model), opt.optimizer, sync_every=H)``
syncs the replicas every H steps with sparse messages. Between syncs the replicas differ,
so each rank's file holds, besides LocalSteps' state, that rank's own parameters and
optimizer state (``RankState`` below): accelerate's ``load_state`` then loads rank 0's model
and optimizer over them, so ``RankState.restore()`` puts each rank's own back after it.

Batches are accelerate's: the loader is not shuffled (``digits`` is already in random order)
and accelerate deals its batches out, rank r taking batches r, r + 2, ...; every epoch runs
in the same order. A resumed run skips the batches of the epoch it had done
(``accelerator.skip_first_batches``), so it may stop and resume at any step and still end at
the very parameters of the run that was not interrupted. A plain-DDP loop with the same hook
and batches (``_plain_ddp`` in ``tests/test_integrations.py``) ends at the same parameters,
bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, notebook_launcher
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from gradshare import AdaptiveThreshold, LocalSteps, register_threshold_hook
from gradshare.app.datasets import digits, mlp
from gradshare.distributed.hosts import rendezvous_port
from gradshare.integrations import register_rank_checkpointing


class Progress:
    """Steps done: the same on every rank, so accelerate's main-process-only copy will do."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class RankState:
    """What differs between ranks with ``--share local``: LocalSteps' state, and this rank's
    own parameters and optimizer state. Loading keeps them until :meth:`restore`, called
    after ``accelerator.load_state`` (which loads rank 0's model and optimizer)."""

    def __init__(self, sync: LocalSteps) -> None:
        self.sync = sync
        self.saved: dict[str, Any] | None = None

    @property
    def steps(self) -> int:  # the step of each save's token
        return self.sync.steps

    def state_dict(self) -> dict[str, Any]:
        return {
            "sync": self.sync.state_dict(),
            "inner": self.sync.inner.state_dict(),
            "params": [p.detach().clone() for p in self.sync.params],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state

    def restore(self) -> None:
        assert self.saved is not None
        self.sync.load_state_dict(self.saved["sync"])
        self.sync.inner.load_state_dict(self.saved["inner"])
        with torch.no_grad():
            for p, t in zip(self.sync.params, self.saved["params"], strict=True):
                p.copy_(t)
        self.saved = None


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    split = digits(seed=0)
    model = mlp(split.num_features, split.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = TensorDataset(split.x_train, split.y_train)
    loader = DataLoader(data, batch_size=args.batch_size, drop_last=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    local = args.share == "local"
    if local:  # no all-reduce (no_sync below): LocalSteps syncs the replicas
        sync = LocalSteps(accelerator.unwrap_model(model), opt.optimizer, args.sync_every)
        rank_state: Any = RankState(sync)
        register_rank_checkpointing(accelerator, rank_state)
    else:
        state = register_threshold_hook(model, threshold=AdaptiveThreshold(args.threshold))
        register_rank_checkpointing(accelerator, state)  # every rank its own residuals
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume is not None:
        accelerator.load_state(args.resume)
        if local:
            rank_state.restore()  # this rank's replica over rank 0's model
        accelerator.print(f"resumed from step {progress.step}")
    while progress.step < args.steps:
        skip = progress.step % len(loader)
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            opt.zero_grad()
            with accelerator.no_sync(model) if local else contextlib.nullcontext():
                accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            progress.step += 1
            if progress.step == args.save_at:
                accelerator.save_state(args.checkpoint_dir)
                accelerator.print(f"saved step {progress.step} to {args.checkpoint_dir}")
            if progress.step == args.steps:
                break
    sent, dense = (
        (sync.bytes_sent, sync.dense_bytes) if local else (state.bytes_sent, state.dense_bytes)
    )
    accelerator.print(
        f"step {progress.step}: rank 0 sent {sent:,} B vs {dense:,} B "
        f"dense ({dense / max(sent, 1):.0f}x less)"
    )
    if accelerator.is_main_process and args.out is not None:
        params = accelerator.unwrap_model(model).parameters()
        torch.save(torch.cat([p.detach().flatten() for p in params]), args.out)
        print(f"wrote {args.out}")
    accelerator.end_training()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="total optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--threshold", type=float, default=1e-3, help="adaptive, initial value")
    parser.add_argument(
        "--share",
        choices=["gradients", "local"],
        default="gradients",
        help="the DDP hook, or LocalSteps (no all-reduce; sparse syncs every --sync-every)",
    )
    parser.add_argument("--sync-every", type=int, default=10, help="--share local: H")
    parser.add_argument("--checkpoint-dir", type=Path, help="where --save-at saves")
    parser.add_argument("--save-at", type=int, help="save_state after this many steps")
    parser.add_argument("--resume", type=Path, help="a save_state directory to resume from")
    parser.add_argument("--out", type=Path, help="write the final flat parameters here")
    args = parser.parse_args(argv)
    if (args.save_at is None) != (args.checkpoint_dir is None):
        parser.error("--save-at and --checkpoint-dir go together")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    notebook_launcher(train, (args,), num_processes=2, use_port=str(rendezvous_port()))


if __name__ == "__main__":
    main()
