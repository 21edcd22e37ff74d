"""gradshare under accelerate: every rank's gradshare state saved and loaded with
``accelerator.save_state`` / ``load_state`` (imports nothing of accelerate itself)."""

from __future__ import annotations

from typing import Any

from gradshare.integrations.rank_files import (
    Stateful,
    accelerate_rank_file,
    load_rank_state,
    rank_and_world,
    save_rank_state,
)

__all__ = ["register_rank_checkpointing"]


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
        save_rank_state(obj, accelerate_rank_file(output_dir, rank_and_world()[0]))

    def load(models: Any, input_dir: str) -> None:
        load_rank_state(obj, accelerate_rank_file(input_dir, rank_and_world()[0]))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
