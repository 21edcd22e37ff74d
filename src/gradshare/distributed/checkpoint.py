"""What every gradshare state records about who saved it, and the one check of it on load.

Each rank saves its own state (its residuals differ from every other rank's), so each state
records the rank and world size that saved it and the format it is written in; a load checks
both before anything changes.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["check_format", "check_saved_by", "saved_by"]


def saved_by(group: Any = None) -> dict[str, int]:
    """``{"rank": r, "world_size": w}`` of this process in ``group`` (empty without a process
    group)."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    return {"rank": dist.get_rank(group), "world_size": dist.get_world_size(group)}


def check_saved_by(saved: dict[str, Any], group: Any, what: str) -> None:
    """Refuse ``saved`` unless this rank of a world of the same size saved it (a state that
    records neither passes: it predates the record)."""
    here = saved_by(group)
    there = {k: saved.get(k, v) for k, v in here.items()}
    if there != here:
        raise ValueError(
            f"{what} was saved by rank {there['rank']} of {there['world_size']}, this is rank "
            f"{here['rank']} of {here['world_size']}: each rank loads the state its own rank "
            "saved, in a world of the same size (another size would drop or invent residuals)."
        )


def check_format(saved: dict[str, Any], what: str, current: int) -> int:
    """The format version of ``saved`` (1 when it records none: gradshare 0.1), refusing a
    newer one than this gradshare reads."""
    version = saved.get("format", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= current:
        raise ValueError(
            f"{what} is in format {version!r}; this gradshare reads formats 1 to {current}: it "
            "was saved by a newer gradshare (upgrade), or the checkpoint is corrupted."
        )
    return version
