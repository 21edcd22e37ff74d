"""Every rank's own state file beside a framework's checkpoint.

Lightning and accelerate write a checkpoint from rank 0 only; gradshare's residuals and
threshold states differ from rank to rank, so each rank writes its own file with
:func:`save_rank_state` and reads it back with :func:`load_rank_state`. Each file records
the rank and world size that wrote it; loading refuses another rank's file or another world
size's. Files are read with ``torch.load(weights_only=True)``.

Every save has a :class:`SaveToken`: a random id agreed across ranks (:func:`new_token`) and
the step. Each rank writes it into its file, and the integrations tie it to the framework's
own checkpoint: Lightning's checkpoint dict holds it, Trainer's ``trainer_state.json`` holds
it, accelerate's directory gets it once every rank has written all its files. A save cut
short (a rank killed while it wrote), or another run's files in the same folder, leave files
and checkpoint of different saves, so such a rank file is refused by name, with both steps
(both ids when the steps are the same). At every load the ranks also gather their files'
tokens (through :func:`gradshare.distributed.exchange.collective`) and refuse alike, before
anything is restored, when one rank could not read its file or the files are of different
saves.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradshare._checks import to_seconds
from gradshare.distributed.exchange import collective

__all__ = [
    "SaveToken",
    "Stateful",
    "accelerate_rank_file",
    "lightning_rank_file",
    "load_rank_state",
    "new_token",
    "rank_and_world",
    "save_rank_state",
    "wait_for_ranks",
]


@dataclass(frozen=True, slots=True)
class SaveToken:
    """Which save a rank file belongs to: the same on every rank of one save, new each save."""

    id: int
    """A random 63-bit number drawn by rank 0 and broadcast."""
    step: int
    """The step (iteration) saved; -1 when unknown."""

    def to_dict(self) -> dict[str, int]:
        return {"id": self.id, "step": self.step}

    @classmethod
    def from_dict(cls, saved: Any) -> SaveToken | None:
        """The token stored by :meth:`to_dict`, or None when ``saved`` holds none."""
        if not isinstance(saved, dict) or not {"id", "step"} <= saved.keys():
            return None
        return cls(int(saved["id"]), int(saved["step"]))


class Stateful(Protocol):
    """What has its own checkpoint: ``ThresholdHookState``, optimizers, modules."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors live: NCCL takes CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_token(
    step: int, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None
) -> SaveToken:
    """A token for this save: rank 0 draws the id and every rank gets it (a collective: every
    rank of ``group`` calls this, at the same save)."""
    _, world = rank_and_world(group)
    ident = torch.tensor([secrets.randbits(63)], dtype=torch.int64)
    if world > 1:
        ident = ident.to(_device(group))
        src = 0 if group is None else dist.get_global_rank(group, 0)
        collective(
            dist.broadcast,
            ident,
            src=src,
            group=group,
            what="save token broadcast",
            timeout=timedelta(seconds=to_seconds(timeout)),
            rank=dist.get_rank(),
        )
    return SaveToken(int(ident.item()), int(step))


def save_rank_state(
    obj: Stateful,
    path: str | os.PathLike[str],
    group: dist.ProcessGroup | None = None,
    token: SaveToken | None = None,
) -> Path:
    """Write ``obj.state_dict()`` of this rank to ``path``, with the rank, world size and the
    save's ``token``.

    The file appears whole or not at all (written beside it, then renamed). Returns the path.
    """
    path = Path(path)
    rank, world = rank_and_world(group)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    saved = {"rank": rank, "world_size": world, "state": obj.state_dict()}
    if token is not None:
        saved["token"] = token.to_dict()
    torch.save(saved, tmp)
    os.replace(tmp, path)
    return path


def _step(token: SaveToken | None) -> str:
    return "unknown" if token is None or token.step < 0 else str(token.step)


def _read(
    path: Path, rank: int, world: int, token: SaveToken | None, source: str
) -> dict[str, Any]:
    """This rank's file, checked against its rank, world size and the checkpoint's token."""
    if not path.exists():
        raise FileNotFoundError(
            f"No gradshare state at {path}: every rank writes its own file when the checkpoint "
            "is saved; resume from a checkpoint saved with gradshare's integration, by a "
            "world of the same size."
        )
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise ValueError(
            f"Cannot read gradshare's rank file {path} ({type(e).__name__}: {e}): it is "
            "damaged or not a gradshare file (a save cut short?). Resume from an earlier "
            "checkpoint; nothing was restored."
        ) from e
    if not isinstance(saved, dict) or "state" not in saved:
        raise ValueError(f"{path} is not a gradshare rank file (no `state` in it).")
    if (saved.get("rank"), saved.get("world_size")) != (rank, world):
        raise ValueError(
            f"{path} was written by rank {saved.get('rank')} of {saved.get('world_size')}, "
            f"this is rank {rank} of {world}: each rank loads its own file, in a world of the "
            "same size."
        )
    mine = SaveToken.from_dict(saved.get("token"))
    if token is not None and mine != token:
        raise ValueError(
            f"{path} is from another save than {source}: {_versus(mine, token)}. A save was "
            "cut short (a rank stopped while it or the framework wrote), or another run saved "
            "into this folder, so this checkpoint is incomplete: resume from an earlier one."
        )
    return saved


def _versus(mine: SaveToken | None, token: SaveToken) -> str:
    """How a rank file's token differs from the checkpoint's, in words."""
    if mine is not None and mine.step == token.step >= 0:
        return (
            f"both are of step {token.step}, but of different saves (the file's id "
            f"{mine.id:#x}, the checkpoint's {token.id:#x})"
        )
    return f"the file is of step {_step(mine)}, the checkpoint of step {_step(token)}"


def load_rank_state(
    obj: Stateful,
    path: str | os.PathLike[str],
    group: dist.ProcessGroup | None = None,
    *,
    token: SaveToken | None = None,
    source: str = "the checkpoint",
    timeout: float | timedelta | None = None,
) -> None:
    """Read what :func:`save_rank_state` wrote for this rank into ``obj.load_state_dict``.

    1. Read this rank's file (tensors, dicts, lists and numbers only: ``weights_only=True``)
       and check its rank, world size and, when given, that it carries ``token``: the token
       that the framework checkpoint ``source`` holds for this save.
    2. In a world of several ranks, gather every rank's outcome and file token (a
       collective: every rank calls this at the same load), so that every rank refuses
       alike, naming the ranks and steps, when one rank failed or the files are of
       different saves.
    3. Only then ``obj.load_state_dict(state)``.

    Raises FileNotFoundError or ValueError, with nothing restored.
    """
    path = Path(path)
    rank, world = rank_and_world(group)
    error: Exception | None = None
    saved: dict[str, Any] = {}
    try:
        saved = _read(path, rank, world, token, source)
    except (OSError, ValueError) as e:
        error = e
    if world > 1:
        mine = SaveToken.from_dict(saved.get("token")) or SaveToken(0, -1)
        row = torch.tensor([error is not None, mine.id, mine.step], dtype=torch.int64)
        row = row.to(_device(group))
        table = [torch.empty_like(row) for _ in range(world)]
        collective(
            dist.all_gather,
            table,
            row,
            group=group,
            what="rank file agreement",
            timeout=timedelta(seconds=to_seconds(timeout)),
            rank=dist.get_rank(),
        )
        rows = [t.tolist() for t in table]
        failed = [r for r, (bad, _, _) in enumerate(rows) if bad]
        if error is not None:
            raise error
        if failed:
            raise ValueError(
                f"Rank(s) {failed} could not load their gradshare rank file (see their "
                f"errors), so no rank restores its own ({path} here): resume from an earlier "
                "checkpoint."
            )
        if len({(i, s) for _, i, s in rows}) > 1:
            steps = ", ".join(
                f"rank {r}'s of step {s if s >= 0 else 'unknown'}"
                for r, (_, _, s) in enumerate(rows)
            )
            raise ValueError(
                f"The ranks' gradshare files are of different saves ({steps}; {path} here): "
                "a save was cut short, so this checkpoint is incomplete. Resume from an "
                "earlier one; nothing was restored."
            )
    elif error is not None:
        raise error
    obj.load_state_dict(saved["state"])


def lightning_rank_file(checkpoint: str | os.PathLike[str], rank: int) -> Path:
    """Where :class:`GradshareDDPStrategy` keeps rank ``rank``'s hook state beside a Lightning
    checkpoint file."""
    return Path(f"{os.fspath(checkpoint)}.gradshare-rank{rank}.pt")


def accelerate_rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where :func:`register_rank_checkpointing` keeps rank ``rank``'s state in a checkpoint
    directory of ``accelerator.save_state`` (and ``GradshareCallback`` in Trainer's
    ``checkpoint-N``)."""
    return Path(directory) / f"gradshare-rank{rank}.pt"


def wait_for_ranks(
    what: str, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None
) -> None:
    """Return once every rank of ``group`` has called this (a collective, bounded by
    ``timeout``; ``what`` names it in the error of a rank that waited in vain)."""
    if rank_and_world(group)[1] == 1:
        return
    flag = torch.ones(1, dtype=torch.int64).to(_device(group))
    collective(
        dist.all_reduce,
        flag,
        group=group,
        what=what,
        timeout=timedelta(seconds=to_seconds(timeout)),
        rank=dist.get_rank(),
    )
