"""gradshare under accelerate: every rank's gradshare state saved and loaded with
``accelerator.save_state`` / ``load_state`` (imports nothing of accelerate itself)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from gradshare.integrations.rank_files import (
    SaveToken,
    Stateful,
    accelerate_rank_file,
    load_rank_state,
    new_token,
    rank_and_world,
    save_rank_state,
)

__all__ = ["register_rank_checkpointing"]

TOKEN_FILE = "gradshare-save.json"
"""The file in a ``save_state`` directory where the main process writes the save's token."""


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
        rank = rank_and_world()[0]
        token = new_token(int(getattr(obj, "iteration", -1)), timeout=timeout)
        save_rank_state(obj, accelerate_rank_file(output_dir, rank), token=token)
        if rank == 0:  # after its own file: a token here means rank 0's file is complete
            path = Path(output_dir) / TOKEN_FILE
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(token.to_dict()))
            os.replace(tmp, path)

    def load(models: Any, input_dir: str) -> None:
        path = Path(input_dir) / TOKEN_FILE
        token = None
        if path.exists():
            try:
                token = SaveToken.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                token = SaveToken(-1, -1)  # unreadable: no rank file matches it
        load_rank_state(obj, accelerate_rank_file(input_dir, rank_and_world()[0]),
                        token=token, source=str(path), timeout=timeout)  # fmt: skip

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
