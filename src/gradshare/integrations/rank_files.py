"""Every rank's own state file beside a framework's checkpoint.

Lightning and accelerate write a checkpoint from rank 0 only; gradshare's residuals and
threshold states differ from rank to rank, so each rank writes its own file with
:func:`save_rank_state` and reads it back with :func:`load_rank_state`. Each file records
the rank and world size that wrote it; loading refuses another rank's file or another world
size's. Files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "Stateful",
    "accelerate_rank_file",
    "lightning_rank_file",
    "load_rank_state",
    "rank_and_world",
    "save_rank_state",
]


class Stateful(Protocol):
    """What has its own checkpoint: ``ThresholdHookState``, optimizers, modules."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rank_and_world(group: Any = None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def save_rank_state(obj: Stateful, path: str | os.PathLike[str], group: Any = None) -> Path:
    """Write ``obj.state_dict()`` of this rank to ``path``, with the rank and world size.

    The file appears whole or not at all (written beside it, then renamed). Returns the path.
    """
    path = Path(path)
    rank, world = rank_and_world(group)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"rank": rank, "world_size": world, "state": obj.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


def load_rank_state(obj: Stateful, path: str | os.PathLike[str], group: Any = None) -> None:
    """Read what :func:`save_rank_state` wrote for this rank into ``obj.load_state_dict``.

    Tensors, dicts, lists and numbers only (``weights_only=True``); refuses a file of another
    rank or world size before anything changes.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"No gradshare state at {path}: every rank writes its own file when the checkpoint "
            "is saved; resume from a checkpoint saved with gradshare's integration, by a "
            "world of the same size."
        )
    saved = torch.load(path, weights_only=True, map_location="cpu")
    rank, world = rank_and_world(group)
    if (saved.get("rank"), saved.get("world_size")) != (rank, world):
        raise ValueError(
            f"{path} was written by rank {saved.get('rank')} of {saved.get('world_size')}, "
            f"this is rank {rank} of {world}: each rank loads its own file, in a world of the "
            "same size."
        )
    obj.load_state_dict(saved["state"])


def lightning_rank_file(checkpoint: str | os.PathLike[str], rank: int) -> Path:
    """Where :class:`GradshareDDPStrategy` keeps rank ``rank``'s hook state beside a Lightning
    checkpoint file."""
    return Path(f"{os.fspath(checkpoint)}.gradshare-rank{rank}.pt")


def accelerate_rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where :func:`register_rank_checkpointing` keeps rank ``rank``'s state in a checkpoint
    directory of ``accelerator.save_state``."""
    return Path(directory) / f"gradshare-rank{rank}.pt"
