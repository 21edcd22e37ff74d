"""Every rank's own checkpoint of a step, for the torchrun examples (``torchrun_shared.py``,
``local_steps.py``): ``<dir>/step{N:06d}/rank{r}.pt``, each written whole, and the newest
step that every rank saved and can read, agreed by the ranks. ``local_steps.py`` also reads
a step saved by a world of another size (every rank reads every file of it:
:func:`latest_of_any_world`), for a restart with more or fewer ranks.

A rank file can be there and still unreadable (damaged, or cut short by a full disk): every
rank then falls back, alike, to the step before, so that a launch, or each attempt of an
elastic restart (``torchrun --max-restarts``), resumes instead of failing with torch's zip
error.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def save(ckpt: Path, step: int, rank: int, state: dict) -> None:
    """Write this rank's ``state`` of ``step``; the file exists only whole (a rename)."""
    d = ckpt / f"step{step:06d}"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".rank{rank}.pt"
    torch.save(state, tmp)
    tmp.rename(d / f"rank{rank}.pt")


def load(ckpt: Path, step: int, rank: int) -> dict:
    """What :func:`save` wrote: tensors, dicts, lists and numbers only (``weights_only``)."""
    return torch.load(ckpt / f"step{step:06d}" / f"rank{rank}.pt", weights_only=True)


def complete_steps(ckpt: Path, world: int) -> list[int]:
    """The steps for which every rank's checkpoint exists, newest first."""
    steps = []
    for d in ckpt.glob("step*"):
        if all((d / f"rank{r}.pt").exists() for r in range(world)):
            steps.append(int(d.name[4:]))
    return sorted(steps, reverse=True)


def latest_readable(ckpt: Path, rank: int, world: int) -> tuple[int, dict | None]:
    """The newest step whose checkpoint every rank can read, and this rank's state of it
    ((0, None) if none). The ranks agree (an all-reduce per step tried), so that all fall
    back alike past a checkpoint that one rank cannot read (a damaged file)."""
    for step in complete_steps(ckpt, world):
        try:
            state = load(ckpt, step, rank)
        except Exception as e:  # damaged, cut short: try the one before
            print(f"rank {rank}: cannot read its checkpoint of step {step}: {e}", flush=True)
            state = None
        ok = torch.tensor([state is not None], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            return step, state
        if rank == 0:
            print(f"step {step} is unreadable on some rank: falling back", flush=True)
    return 0, None


def latest_of_any_world(ckpt: Path, rank: int) -> tuple[int, int, dict[str, dict]]:
    """The newest step saved whole by a world of any size that every rank can read whole:
    (step, that world's size, every one of its rank files by name); (0, 0, {}) if none.
    Every rank reads every file (a resized load folds them all); the world that saved a step
    is the one its rank 0 file records (a step missing a rank's file is incomplete, passed
    over). The ranks agree, as in :func:`latest_readable`."""
    dirs = sorted(ckpt.glob("step*"), key=lambda d: int(d.name[4:]), reverse=True)
    for d in dirs:
        step, states = int(d.name[4:]), {}
        try:
            first = load(ckpt, step, 0)
            world = int(first["sync"]["world_size"])
            states = {f"{d.name}/rank{r}.pt": first if r == 0 else load(ckpt, step, r)
                      for r in range(world)}  # fmt: skip
        except Exception as e:  # missing, damaged, cut short: try the one before
            print(f"rank {rank}: cannot read every rank file of {d.name}: {e}", flush=True)
            states, world = {}, 0
        ok = torch.tensor([bool(states)], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            return step, world, states
        if rank == 0:
            print(f"step {step} is unreadable on some rank: falling back", flush=True)
    return 0, 0, {}
