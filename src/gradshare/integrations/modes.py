"""The sharing modes every integration offers, under one name each.

``"gradients"`` (the DDP hook: gradients threshold-encoded), ``"updates"``
(:class:`~gradshare.SharedOptimizer`: the optimizer's updates shared) and ``"local"``
(:class:`~gradshare.LocalSteps`: local steps, synced every ``sync_every``). The Hugging Face
callback called the first ``"hook"``: that name still works, with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Literal

# DDP's own hook that communicates nothing: each bucket keeps this rank's gradient
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

__all__ = ["SHARES", "Share", "local_gradient_hook", "share_mode"]

Share = Literal["gradients", "updates", "local", "hook"]
SHARES = ("gradients", "updates", "local")
"""The modes, by their one name."""
ALIASES = {"hook": "gradients"}
"""Deprecated names of a mode."""

local_gradient_hook = noop_hook
"""The DDP communication hook that leaves every gradient local (torch's ``noop_hook``): for
``"updates"`` and ``"local"``, where gradshare shares something else."""


def share_mode(share: str, front_end: str) -> str:
    """The mode ``share`` names (a deprecated alias warns), or a ValueError naming them."""
    if share in ALIASES:
        warnings.warn(
            f"{front_end}(share={share!r}) is deprecated: the mode is called "
            f"{ALIASES[share]!r} in every integration; the old name goes in gradshare 0.3.",
            DeprecationWarning,
            stacklevel=3,
        )
        return ALIASES[share]
    if share not in SHARES:
        raise ValueError(
            f'Expect `share` "gradients", "updates" or "local", got {share!r}: "gradients" '
            'encodes the gradients (the DDP hook), "updates" shares the optimizer updates '
            '(SharedOptimizer), "local" syncs local steps (LocalSteps).'
        )
    return share
