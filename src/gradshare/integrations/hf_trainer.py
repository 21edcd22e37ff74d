"""The Hugging Face Trainer callback of :mod:`gradshare.integrations` (imports transformers:
private, loaded by ``gradshare.integrations.GradshareCallback`` on first use)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from gradshare._checks import to_seconds
from gradshare.distributed.ddp_hook import ThresholdHookState, register_threshold_hook
from gradshare.distributed.local_steps import LocalSteps, LocalStepsOptions
from gradshare.distributed.local_steps.options import FIELDS as LOCAL_FIELDS
from gradshare.distributed.local_steps.options import local_steps_options
from gradshare.distributed.metrics import warn_if_adaptive
from gradshare.distributed.shared_optimizer import SharedOptimizer
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.integrations.modes import Share, local_gradient_hook, share_mode
from gradshare.integrations.rank_files import (
    SaveToken,
    accelerate_rank_file,
    load_rank_state,
    new_token,
    save_rank_state,
)

__all__ = ["GradshareCallback"]

logger = logging.getLogger(__name__)

_TOKEN_KEY = "gradshare"
"""Where the callback keeps the next save's token id in ``TrainerState.stateful_callbacks``,
which Trainer writes into each checkpoint's ``trainer_state.json`` (a key that names no
callback class, so Trainer restores no callback from it)."""


class GradshareCallback(TrainerCallback):
    """gradshare inside an unchanged ``Trainer(...).train()``, on the DDP model Trainer builds.

    Trainer hands its callbacks the plain model, not the DDP model accelerate wraps it in, so
    the callback is attached to the trainer (one line)::

        trainer = Trainer(model=model, args=args, train_dataset=data)
        GradshareCallback(share="updates").attach(trainer)
        trainer.train()

    When training begins (``on_train_begin``: the DDP model, optimizer and scheduler are
    built, and a resumed checkpoint's model and optimizer loaded), per ``share``:

    - ``"gradients"``: :func:`gradshare.register_threshold_hook` on the DDP model: gradients are
      threshold-encoded; the optimizer is Trainer's, unchanged (best with SGD: with Adam or
      AdamW share updates instead, a warning says so);
    - ``"updates"``: Trainer's optimizer (AdamW by default) is wrapped in
      :class:`gradshare.SharedOptimizer` with ``ddp=`` the DDP model (``reduction="mean"``):
      gradients stay local, the optimizer's updates are shared; the scheduler keeps working;
    - ``"local"``: DDP's all-reduce is switched off (a hook that leaves every gradient local)
      and :class:`gradshare.LocalSteps` syncs the replicas every ``sync_every`` steps.

    Checkpoints: when training begins the ranks agree on a token for the next save (a random
    id), which the callback keeps in Trainer's state (``stateful_callbacks["gradshare"]``),
    so Trainer writes it into the checkpoint's ``trainer_state.json``. Then, at that save
    (``on_save``, once Trainer's files are written), each rank writes
    ``checkpoint-N/gradshare-rank{r}.pt`` with that token (its residuals and threshold
    states; with ``"updates"`` and ``"local"`` also its own optimizer state, and with
    ``"local"`` its own replica's parameters, which Trainer's rank-0 files cannot hold), and
    the ranks agree on the next token. ``train(resume_from_checkpoint=...)`` (a folder, or
    ``True`` for the newest in ``output_dir``) reads the rank files of the very folder Trainer
    resumed from (``attach`` wraps ``trainer.train`` to note it) after Trainer has loaded its
    own files, and checks them against the token of the ``trainer_state.json`` Trainer
    restored: rank files of another save (a rank killed after Trainer wrote
    ``checkpoint-N`` but before ``on_save``, the same ``output_dir`` saved into by another
    run) are refused on every rank alike, naming both, before anything is restored.

    Timeout: Trainer's own collectives (each step's token count with
    ``average_tokens_across_devices``, the logged loss) wait on the default process group
    under its timeout, which ``TrainingArguments(ddp_timeout=...)`` does not reach on CPU
    (torch's 30 minutes there). When training begins the callback sets that group's timeout to
    ``ddp_timeout`` if you changed it, else to gradshare's ``timeout`` (300 s by default), so a
    hung rank holds the others that long at most; the setting stays for the process.

    Mixed precision: with ``"local"``, accelerate's ``GradScaler`` (``fp16=True``) goes to
    ``LocalSteps(grad_scaler=...)``, so a rank whose step the scaler skipped still syncs with
    the others.

    The end of training (``on_train_end``), with ``"local"``: LocalSteps closes (a round in
    flight is merged), and when the replicas may differ (the run did not end on a sync, or
    with ``overlap`` or ``fragments``) they are averaged once, densely
    (:meth:`~gradshare.LocalSteps.average`: one all-reduce of the parameters, counted in
    ``bytes_sent``): every rank then holds the same model, the
    mean of the replicas, which ``trainer.save_model()`` saves, rather than rank 0's replica
    without the other ranks' last partial round. A checkpoint of the last step, saved before,
    keeps each rank's own replica, so a resume from it continues as the run went.

    Logs: ``bytes_sent``, ``dense_bytes``, ``compression`` (dense / sent), ``density`` and
    ``threshold`` of this rank join every log (``trainer.state.log_history``); the callback
    puts itself first among Trainer's callbacks so that reporters see them too.

    Args:
        share: ``"gradients"``, ``"updates"`` or ``"local"`` (``"hook"``: a deprecated
            alias of ``"gradients"``).
        local: :class:`~gradshare.LocalStepsOptions` (``share="local"``), or give its fields
            as keywords (``sync_every``, ``density``, ``decay``, ``outer_optimizer``,
            ``offload``, ``overlap``, ``fragments``, ``compact``, ``broadcast_buffers``).
        start_iter, momentum: the hook's (:class:`~gradshare.ThresholdHookState`).
        resume_from: the folder holding ``checkpoint-N`` of a resumed run, for the rare case
            that the callback cannot learn it (``train`` reached otherwise than through
            ``trainer.train``); ``args.output_dir`` if not given.
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords (``threshold``, ``reduction``, ``timeout``, ...).

    Attributes:
        shared: what shares, once training began: the :class:`~gradshare.ThresholdHookState`,
            the :class:`~gradshare.SharedOptimizer` or the :class:`~gradshare.LocalSteps`.
    """

    def __init__(
        self,
        share: Share = "gradients",
        *,
        local: LocalStepsOptions | None = None,
        start_iter: int = 1,
        momentum: float = 0.0,
        resume_from: str | Path | None = None,
        options: EncodingOptions | None = None,
        **fields: Any,
    ) -> None:
        self.share = share_mode(share, "GradshareCallback")
        own = {k: fields.pop(k) for k in LOCAL_FIELDS if k in fields}
        self.local = local_steps_options(local, own, "GradshareCallback")
        self.options = encoding_options(options, fields, "GradshareCallback")
        self._hook: dict[str, Any] = {"start_iter": start_iter, "momentum": momentum}
        self.resume_from = None if resume_from is None else Path(resume_from)
        self.trainer: Any = None
        self.shared: ThresholdHookState | SharedOptimizer | LocalSteps | None = None
        self._resumed: Path | None = None
        """The checkpoint folder ``trainer.train`` was given to resume from."""

    def attach(self, trainer: Any) -> GradshareCallback:
        """Add this callback to ``trainer``, first among its callbacks, and note the
        checkpoint folder each ``trainer.train(resume_from_checkpoint=...)`` resumes from;
        returns it."""
        if self.trainer is not None:
            raise ValueError("This GradshareCallback is attached already: make one per Trainer.")
        self.trainer = trainer
        trainer.callback_handler.callbacks.insert(0, self)
        train = trainer.train

        @functools.wraps(train)
        def train_noting_checkpoint(
            resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            return train(self._note_checkpoint(resume_from_checkpoint), *args, **kwargs)

        trainer.train = train_noting_checkpoint
        return self

    def _note_checkpoint(self, resume: Any) -> Any:
        """``resume_from_checkpoint`` as Trainer will take it (``True``: the newest
        checkpoint in ``output_dir``, resolved here as Trainer resolves it), its folder
        noted."""
        if resume is True and os.path.isdir(self.trainer.args.output_dir):
            resume = get_last_checkpoint(self.trainer.args.output_dir) or True
        self._resumed = Path(resume) if isinstance(resume, (str, os.PathLike)) else None
        return resume

    # ------------------------------------------------------------------ set-up

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError(
                "GradshareCallback needs its trainer: add it with "
                "`GradshareCallback(...).attach(trainer)`, not `callbacks=[...]`."
            )
        ddp = trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            raise RuntimeError(
                f"GradshareCallback shares between DDP ranks, but Trainer built a "
                f"{type(ddp).__name__}: launch the script on several processes (torchrun "
                "--nproc_per_node=2 ...)."
            )
        if self.shared is not None:
            raise RuntimeError("GradshareCallback runs one train(): make a new one per Trainer.")
        _set_group_timeout(self._group_timeout(args))
        resume = self._resume(args, state) if state.global_step > 0 else None  # Trainer resumed
        self.shared = self._share(trainer, ddp)
        if resume is not None:
            self._load(resume)
        self._next_token(state)

    def _share(self, trainer: Any, ddp: DistributedDataParallel) -> Any:
        accelerated = trainer.optimizer
        inner = getattr(accelerated, "optimizer", accelerated)
        if self.share == "gradients":
            warn_if_adaptive(inner, "GradshareCallback(share='gradients')")
            return register_threshold_hook(ddp, options=self.options, **self._hook)
        if self.share == "updates":
            shared = SharedOptimizer(inner, ddp=ddp, options=self.options)
            accelerated.optimizer = shared  # Trainer steps and saves through it
            return shared
        ddp.register_comm_hook(None, local_gradient_hook)
        scaler = getattr(trainer.accelerator, "scaler", None)  # fp16: skipped steps still sync
        return LocalSteps(
            trainer.model, inner, local=self.local, grad_scaler=scaler, options=self.options
        )

    def _group_timeout(self, args: Any) -> timedelta:
        """``ddp_timeout`` when changed from TrainingArguments' default, else gradshare's."""
        fields = {f.name: f for f in dataclasses.fields(args)}
        given = getattr(args, "ddp_timeout", None)
        if "ddp_timeout" in fields and given != fields["ddp_timeout"].default:
            return timedelta(seconds=to_seconds(given, "ddp_timeout"))
        return timedelta(seconds=to_seconds(self.options.timeout))

    # ------------------------------------------------------------------ checkpoints

    def _resume(self, args: Any, state: Any) -> _Resume:
        """The checkpoint Trainer resumed from, with the token of the ``trainer_state.json``
        Trainer restored (refused, on every rank alike, when it holds none)."""
        step = state.global_step
        if self._resumed is not None:
            folder, source = self._resumed, str(self._resumed / "trainer_state.json")
            fix = "resume from a checkpoint saved with GradshareCallback"
        else:  # train() reached otherwise: the folder is a guess
            folder = Path(self.resume_from or args.output_dir) / f"checkpoint-{step}"
            source = "the trainer_state.json Trainer restored"
            fix = "pass `GradshareCallback(resume_from=<the folder holding checkpoint-N>)`"
        held = state.stateful_callbacks.get(_TOKEN_KEY)
        if not isinstance(held, dict) or not isinstance(held.get("id"), int):
            raise ValueError(
                f"Expect the trainer state Trainer resumed ({source}) to hold a gradshare save "
                f"token (`stateful_callbacks[{_TOKEN_KEY!r}]`), got {held!r}: the checkpoint "
                "was not saved by this GradshareCallback (plain Trainer, or an older "
                "gradshare). Resume from a checkpoint saved with it; nothing was restored."
            )
        return _Resume(folder, source, fix, SaveToken(held["id"], step))

    def _load(self, resume: _Resume) -> None:
        """This rank's file of ``resume``, checked against its token (on every rank alike)."""
        path = accelerate_rank_file(resume.folder, dist.get_rank())
        try:
            load_rank_state(
                _RankFile(self),
                path,
                token=resume.token,
                source=resume.source,
                timeout=self.options.timeout,
            )
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{e} Trainer resumed {resume.folder.name}: {resume.fix}."
            ) from e

    def _next_token(self, state: Any) -> None:
        """The ranks agree on the next save's token id; Trainer writes it with its state."""
        token = new_token(-1, timeout=self.options.timeout)
        state.stateful_callbacks[_TOKEN_KEY] = {"id": token.id}

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Trainer has written ``checkpoint-N`` with the token: every rank's file joins it."""
        token = SaveToken(state.stateful_callbacks[_TOKEN_KEY]["id"], state.global_step)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        save_rank_state(_RankFile(self), accelerate_rank_file(folder, dist.get_rank()), token=token)
        self._next_token(state)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.shared is None or logs is None:
            return
        metrics = self.shared.metrics()
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)  # Trainer logged a copy of `logs`

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync = self.shared
        if isinstance(sync, LocalSteps):
            sync.close()
            sync.average()  # where the replicas may differ: every rank ends with their mean


def _set_group_timeout(timeout: timedelta) -> None:
    """The default process group's timeout, for the collectives issued from now on."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # not in this torch: the group keeps the timeout it was made with
        logger.warning("GradshareCallback cannot set the process group's timeout here.")
        return
    setter(timeout, None)


@dataclasses.dataclass(frozen=True, slots=True)
class _Resume:
    """The checkpoint Trainer resumed from: where the rank files are, and what they must hold."""

    folder: Path
    source: str
    """What holds the token, as the errors name it."""
    fix: str
    """What to do when a rank file is missing."""
    token: SaveToken


class _RankFile:
    """What one rank's file holds, per ``share``."""

    def __init__(self, callback: GradshareCallback) -> None:
        self.callback = callback

    def state_dict(self) -> dict[str, Any]:
        shared = self.callback.shared
        out: dict[str, Any] = {"share": self.callback.share}
        if shared is not None:
            out["state"] = shared.state_dict()
        if isinstance(shared, LocalSteps):
            out["inner"] = shared.inner.state_dict()
            out["params"] = [p.detach().clone() for p in shared.params]
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        shared = self.callback.shared
        if saved.get("share") != self.callback.share:
            raise ValueError(
                f"The checkpoint was saved with share={saved.get('share')!r}, this callback "
                f"has share={self.callback.share!r}: resume with the mode that saved it."
            )
        assert shared is not None
        shared.load_state_dict(saved["state"])
        if isinstance(shared, LocalSteps):
            shared.inner.load_state_dict(saved["inner"])
            with torch.no_grad():
                for p, t in zip(shared.params, saved["params"], strict=True):
                    p.copy_(t)
