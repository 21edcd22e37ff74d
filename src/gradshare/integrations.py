"""gradshare under Lightning and accelerate, with every rank's state checkpointed.

Both frameworks write a checkpoint from rank 0 only (Lightning's ``Trainer.save_checkpoint``,
accelerate's ``save_state``, including objects given to ``register_for_checkpointing``).
gradshare's residuals and threshold states differ from rank to rank, so each rank writes its
own file beside the framework's checkpoint and reads it back on resume:

- Lightning: ``Trainer(strategy=GradshareDDPStrategy(), ...)`` registers the threshold hook
  on the DDP model it builds (on CPU too, where ``DDPStrategy(ddp_comm_hook=...)`` registers
  nothing), or with ``share="updates"`` wraps the optimizer in ``SharedOptimizer(opt,
  ddp=...)``; it writes ``<checkpoint>.gradshare-rank{r}.pt`` beside each checkpoint.
- accelerate: after ``accelerator.prepare(...)``,
  ``state = register_threshold_hook(model)`` and ``register_rank_checkpointing(accelerator,
  state)``; ``save_state(dir)`` then also writes ``dir/gradshare-rank{r}.pt``.

Each file records the rank and world size that wrote it; loading refuses another rank's file
or another world size's. Files are read with ``torch.load(weights_only=True)``.

Why accelerate has the hook only: ``save_state`` writes the optimizer's ``state_dict()`` from
the main process and ``load_state`` loads that one file into every rank's optimizer, with no
way around it for one optimizer; SharedOptimizer's state dict carries the rank's residual, so
the other ranks refuse it (as they must). The hook keeps the optimizer plain, so its rank-0
copy is every rank's. (Lightning lets the strategy load the optimizers itself.)

Neither framework is imported by ``import gradshare``; this module imports Lightning only
when ``GradshareDDPStrategy`` is first used (``pip install -e '.[integrations]'``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from gradshare._lightning import GradshareDDPStrategy

__all__ = [
    # Lightning
    "GradshareDDPStrategy",
    "lightning_rank_file",
    # accelerate
    "accelerate_rank_file",
    "register_rank_checkpointing",
    # the per-rank files
    "load_rank_state",
    "save_rank_state",
]

_INSTALL = "pip install -e '.[integrations]'"


class Stateful(Protocol):
    """What has its own checkpoint: ``ThresholdHookState``, optimizers, modules."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _rank_and_world(group: Any = None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def save_rank_state(obj: Stateful, path: str | os.PathLike[str], group: Any = None) -> Path:
    """Write ``obj.state_dict()`` of this rank to ``path``, with the rank and world size.

    The file appears whole or not at all (written beside it, then renamed). Returns the path.
    """
    path = Path(path)
    rank, world = _rank_and_world(group)
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
    rank, world = _rank_and_world(group)
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


def register_rank_checkpointing(accelerator: Any, obj: Stateful) -> None:
    """Save and restore ``obj`` per rank with ``accelerator.save_state`` / ``load_state``.

    accelerate writes objects given to ``register_for_checkpointing`` from the main process
    only (``custom_checkpoint_{i}.pkl``) and loads that one file on every rank. This registers
    a save and a load pre-hook instead, which run on every process: rank r writes and reads
    ``<dir>/gradshare-rank{r}.pt`` (:func:`save_rank_state`, :func:`load_rank_state`).

    Example::

        >>> model, opt, loader = accelerator.prepare(model, opt, loader)  # doctest: +SKIP
        >>> state = gradshare.register_threshold_hook(model)  # doctest: +SKIP
        >>> register_rank_checkpointing(accelerator, state)  # doctest: +SKIP
    """

    def save(models: Any, weights: Any, output_dir: str) -> None:
        save_rank_state(obj, accelerate_rank_file(output_dir, _rank_and_world()[0]))

    def load(models: Any, input_dir: str) -> None:
        load_rank_state(obj, accelerate_rank_file(input_dir, _rank_and_world()[0]))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def __getattr__(name: str) -> Any:
    if name == "GradshareDDPStrategy":
        try:
            from gradshare._lightning import GradshareDDPStrategy
        except ImportError as e:
            raise ImportError(
                f"gradshare.integrations.GradshareDDPStrategy needs Lightning ({e}): {_INSTALL}"
            ) from e
        return GradshareDDPStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
