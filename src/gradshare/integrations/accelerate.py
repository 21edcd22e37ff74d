"""gradshare under accelerate: every rank's gradshare state saved and loaded with
``accelerator.save_state`` / ``load_state`` (imports nothing of accelerate itself)."""

from __future__ import annotations

import functools
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
    wait_for_ranks,
)

__all__ = ["register_rank_checkpointing"]

TOKEN_FILE = "gradshare-save.json"
"""The file of a ``save_state`` directory where the main process writes the save's token."""


def register_rank_checkpointing(
    accelerator: Any, obj: Stateful, timeout: float | timedelta | None = None
) -> None:
    """Save and restore ``obj`` per rank with ``accelerator.save_state`` / ``load_state``.

    accelerate writes objects given to ``register_for_checkpointing`` from the main process
    only (``custom_checkpoint_{i}.pkl``) and loads that one file on every rank. This registers
    a save and a load pre-hook instead, which run on every process, and wraps
    ``accelerator.save_state``:

    1. saving, before accelerate writes anything, the ranks agree on a token (a random id,
       and ``obj.iteration`` or ``obj.steps`` as the step) and rank r writes
       ``<dir>/gradshare-rank{r}.pt`` (:func:`save_rank_state`);
    2. once accelerate has written its files on every rank (model, optimizer, each rank's RNG
       state, the registered objects), the main process writes the token to
       ``<dir>/gradshare-save.json``: a token there means the whole save is on disk;
    3. loading, before accelerate loads anything, rank r reads its file back
       (:func:`load_rank_state`): a file of another save than ``gradshare-save.json`` names,
       or one without that file (a save cut short: say the main process killed after step 1,
       leaving new rank files beside the model of an earlier save), is refused on every rank
       alike, before anything is restored.

    ``timeout`` bounds how long these collectives wait for the other ranks.

    Example::

        >>> model, opt, loader = accelerator.prepare(model, opt, loader)  # doctest: +SKIP
        >>> state = gradshare.register_threshold_hook(model)  # doctest: +SKIP
        >>> register_rank_checkpointing(accelerator, state)  # doctest: +SKIP
    """
    saves = _RankSaves(obj, timeout)
    accelerator.register_save_state_pre_hook(saves.write_rank_file)
    accelerator.register_load_state_pre_hook(saves.read_rank_file)
    accelerator.save_state = saves.then_token(accelerator.save_state)


class _RankSaves:
    """One registered object's rank files: each save's token from its pre-hook until the end
    of ``save_state``."""

    def __init__(self, obj: Stateful, timeout: float | timedelta | None) -> None:
        self.obj = obj
        self.timeout = timeout
        self.pending: tuple[Path, SaveToken] | None = None
        """The directory and token of the save under way (its rank file written)."""

    def write_rank_file(self, models: Any, weights: Any, output_dir: str) -> None:
        step = getattr(self.obj, "iteration", getattr(self.obj, "steps", -1))  # hook, LocalSteps
        token = new_token(int(step), timeout=self.timeout)
        path = accelerate_rank_file(output_dir, rank_and_world()[0])
        save_rank_state(self.obj, path, token=token)
        self.pending = (Path(output_dir), token)

    def read_rank_file(self, models: Any, input_dir: str) -> None:
        token, source = _read_token(Path(input_dir) / TOKEN_FILE)
        path = accelerate_rank_file(input_dir, rank_and_world()[0])
        load_rank_state(self.obj, path, token=token, source=source, timeout=self.timeout)

    def then_token(self, save_state: Any) -> Any:
        """``save_state``, then, once every rank is through it, the token file."""

        @functools.wraps(save_state)
        def save_state_then_token(*args: Any, **kwargs: Any) -> Any:
            self.pending = None
            location = save_state(*args, **kwargs)
            if self.pending is not None:
                directory, token = self.pending
                self.pending = None
                wait_for_ranks("wait for every rank's save_state", timeout=self.timeout)
                if rank_and_world()[0] == 0:
                    _write_token(directory / TOKEN_FILE, token)
            return location

        return save_state_then_token


def _write_token(path: Path, token: SaveToken) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(token.to_dict()))
    os.replace(tmp, path)


def _read_token(path: Path) -> tuple[SaveToken, str]:
    """The token in ``path`` and how to name it; one no rank file matches when it is absent
    or unreadable."""
    if not path.exists():
        return SaveToken(-1, -1), f"{path} (absent: the save did not end)"
    try:
        token = SaveToken.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        token = None
    if token is None:
        return SaveToken(-1, -1), f"{path} (unreadable)"
    return token, str(path)
