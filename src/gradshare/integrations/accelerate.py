"""gradshare under accelerate: every rank's gradshare state saved and loaded with
``accelerator.save_state`` / ``load_state`` (imports nothing of accelerate itself)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from gradshare.integrations.rank_files import (
    Stateful,
    load_rank_directory,
    save_rank_directory,
)

__all__ = ["register_rank_checkpointing"]


def register_rank_checkpointing(
    accelerator: Any, obj: Stateful, timeout: float | timedelta | None = None
) -> None:
    """Save and restore ``obj`` per rank with ``accelerator.save_state`` / ``load_state``.

    accelerate writes objects given to ``register_for_checkpointing`` from the main process
    only (``custom_checkpoint_{i}.pkl``) and loads that one file on every rank. This registers
    a save and a load pre-hook instead, which run on every process:

    1. saving, the ranks agree on a token (a random id, and ``obj.iteration`` as the step),
       rank r writes ``<dir>/gradshare-rank{r}.pt`` (:func:`save_rank_state`), then the main
       process writes the token to ``<dir>/gradshare-save.json``;
    2. loading, rank r reads its file back (:func:`load_rank_state`): a file of another save
       than ``gradshare-save.json`` (a save cut short) is refused, on every rank alike, before
       anything is restored.

    ``timeout`` bounds how long these collectives wait for the other ranks.

    Example::

        >>> model, opt, loader = accelerator.prepare(model, opt, loader)  # doctest: +SKIP
        >>> state = gradshare.register_threshold_hook(model)  # doctest: +SKIP
        >>> register_rank_checkpointing(accelerator, state)  # doctest: +SKIP
    """

    def save(models: Any, weights: Any, output_dir: str) -> None:
        step = getattr(obj, "iteration", getattr(obj, "steps", -1))  # the hook state, LocalSteps
        save_rank_directory(obj, output_dir, int(step), timeout)

    def load(models: Any, input_dir: str) -> None:
        load_rank_directory(obj, input_dir, timeout)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
