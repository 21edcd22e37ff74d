"""The Hugging Face Trainer callback of :mod:`gradshare.integrations` (imports transformers:
private, loaded by ``gradshare.integrations.GradshareCallback`` on first use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from gradshare.distributed.ddp_hook import ThresholdHookState, register_threshold_hook
from gradshare.distributed.local_steps import DEFAULT_DECAY, DEFAULT_DENSITY, LocalSteps
from gradshare.distributed.metrics import warn_if_adaptive
from gradshare.distributed.shared_optimizer import SharedOptimizer, _local_gradient_hook
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.integrations.rank_files import load_rank_directory, save_rank_directory

__all__ = ["GradshareCallback"]

Share = Literal["hook", "updates", "local"]


class GradshareCallback(TrainerCallback):
    """gradshare inside an unchanged ``Trainer(...).train()``, on the DDP model Trainer builds.

    Trainer hands its callbacks the plain model, not the DDP model accelerate wraps it in, so
    the callback is attached to the trainer (one line)::

        trainer = Trainer(model=model, args=args, train_dataset=data)
        GradshareCallback(share="updates").attach(trainer)
        trainer.train()

    When training begins (``on_train_begin``: the DDP model, optimizer and scheduler are
    built, and a resumed checkpoint's model and optimizer loaded), per ``share``:

    - ``"hook"``: :func:`gradshare.register_threshold_hook` on the DDP model: gradients are
      threshold-encoded; the optimizer is Trainer's, unchanged (best with SGD: with Adam or
      AdamW share updates instead, a warning says so);
    - ``"updates"``: Trainer's optimizer (AdamW by default) is wrapped in
      :class:`gradshare.SharedOptimizer` with ``ddp=`` the DDP model (``reduction="mean"``):
      gradients stay local, the optimizer's updates are shared; the scheduler keeps working;
    - ``"local"``: DDP's all-reduce is switched off (a hook that leaves every gradient local)
      and :class:`gradshare.LocalSteps` syncs the replicas every ``sync_every`` steps.

    Checkpoints: at every save (``on_save``), each rank writes
    ``checkpoint-N/gradshare-rank{r}.pt`` (its residuals and threshold states; with
    ``"updates"`` and ``"local"`` also its own optimizer state, and with ``"local"`` its own
    replica's parameters, which Trainer's rank-0 files cannot hold), then rank 0
    ``checkpoint-N/gradshare-save.json`` with the save's token. A ``train(resume_from_checkpoint
    =...)`` starting at step N reads ``<resume_from or output_dir>/checkpoint-N`` back after
    Trainer has loaded its own files; a file of another save is refused on every rank alike.

    Logs: ``bytes_sent``, ``dense_bytes``, ``compression`` (dense / sent), ``density`` and
    ``threshold`` of this rank join every log (``trainer.state.log_history``); the callback
    puts itself first among Trainer's callbacks so that reporters see them too.

    Args:
        share: ``"hook"``, ``"updates"`` or ``"local"``.
        sync_every, density, decay, outer_optimizer, overlap, fragments, compact:
            :class:`~gradshare.LocalSteps`' (``share="local"``).
        start_iter, momentum: the hook's (:class:`~gradshare.ThresholdHookState`).
        resume_from: the folder holding ``checkpoint-N`` of a resumed run when it is not
            ``args.output_dir``.
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords (``threshold``, ``reduction``, ``timeout``, ...).

    Attributes:
        shared: what shares, once training began: the :class:`~gradshare.ThresholdHookState`,
            the :class:`~gradshare.SharedOptimizer` or the :class:`~gradshare.LocalSteps`.
    """

    def __init__(
        self,
        share: Share = "hook",
        *,
        sync_every: int = 10,
        density: float = DEFAULT_DENSITY,
        decay: float = DEFAULT_DECAY,
        outer_optimizer: Any = None,
        overlap: bool | int = False,
        fragments: int = 1,
        compact: bool = False,
        start_iter: int = 1,
        momentum: float = 0.0,
        resume_from: str | Path | None = None,
        options: EncodingOptions | None = None,
        **encoding: Any,
    ) -> None:
        if share not in ("hook", "updates", "local"):
            raise ValueError(f'Expect `share` "hook", "updates" or "local", got {share!r}.')
        self.share = share
        self.options = encoding_options(options, encoding, "GradshareCallback")
        self._local = {"sync_every": sync_every, "density": density, "decay": decay,
                       "outer_optimizer": outer_optimizer, "overlap": overlap,
                       "fragments": fragments, "compact": compact}  # fmt: skip
        self._hook: dict[str, Any] = {"start_iter": start_iter, "momentum": momentum}
        self.resume_from = None if resume_from is None else Path(resume_from)
        self.trainer: Any = None
        self.shared: ThresholdHookState | SharedOptimizer | LocalSteps | None = None

    def attach(self, trainer: Any) -> GradshareCallback:
        """Add this callback to ``trainer``, first among its callbacks; returns it."""
        if self.trainer is not None:
            raise ValueError("This GradshareCallback is attached already: make one per Trainer.")
        self.trainer = trainer
        trainer.callback_handler.callbacks.insert(0, self)
        return self

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
        accelerated = trainer.optimizer
        inner = getattr(accelerated, "optimizer", accelerated)
        if self.share == "hook":
            warn_if_adaptive(inner, "GradshareCallback(share='hook')")
            self.shared = register_threshold_hook(ddp, options=self.options, **self._hook)
        elif self.share == "updates":
            self.shared = SharedOptimizer(inner, ddp=ddp, options=self.options)
            accelerated.optimizer = self.shared  # Trainer steps and saves through it
        else:
            ddp.register_comm_hook(None, _local_gradient_hook)
            self.shared = LocalSteps(trainer.model, inner, options=self.options, **self._local)
        if state.global_step > 0:  # resumed: Trainer restored its state and files
            folder = args.output_dir if self.resume_from is None else self.resume_from
            load_rank_directory(_RankFile(self), Path(folder) / f"checkpoint-{state.global_step}",
                                self.options.timeout)  # fmt: skip

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        save_rank_directory(_RankFile(self), folder, state.global_step, self.options.timeout)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.shared is None or logs is None:
            return
        metrics = self.shared.metrics()
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)  # Trainer logged a copy of `logs`

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if isinstance(self.shared, LocalSteps):
            self.shared.close()


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
