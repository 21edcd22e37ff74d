"""The Lightning strategy of :mod:`gradshare.integrations` (imports Lightning: private, loaded
by ``gradshare.integrations.GradshareDDPStrategy`` on first use)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from gradshare._checks import to_seconds
from gradshare.distributed.ddp_hook import ThresholdHookState, register_threshold_hook
from gradshare.distributed.local_steps import LocalSteps, LocalStepsOptions
from gradshare.distributed.local_steps.options import FIELDS as LOCAL_FIELDS
from gradshare.distributed.local_steps.options import local_steps_options
from gradshare.distributed.metrics import warn_if_adaptive
from gradshare.distributed.shared_optimizer import SharedOptimizer
from gradshare.encoding.options import FIELDS, EncodingOptions, encoding_options
from gradshare.integrations.modes import Share, local_gradient_hook, share_mode
from gradshare.integrations.rank_files import (
    SaveToken,
    lightning_rank_file,
    load_rank_state,
    new_token,
    save_rank_state,
)

__all__ = ["GradshareDDPStrategy"]

_TOKEN_KEY = "gradshare"
"""Where rank 0 writes the save's :class:`SaveToken` in Lightning's checkpoint dict."""


class GradshareDDPStrategy(DDPStrategy):
    """Lightning's DDP with gradshare's exchange in place of the gradient all-reduce.

    ``Trainer(strategy=GradshareDDPStrategy(), accelerator="cpu", devices=2)``: when fitting,
    either

    - ``share="gradients"`` (the default): the DDP model Lightning builds gets
      :func:`gradshare.register_threshold_hook` (on CPU as on CUDA; Lightning's own
      ``ddp_comm_hook`` is registered on CUDA only); the optimizer is yours, unchanged; or
    - ``share="updates"``: the optimizer of ``configure_optimizers`` (one) is wrapped in
      :class:`gradshare.SharedOptimizer` with ``ddp=`` the DDP model: gradients stay local,
      the optimizer's updates (AdamW's, say) are shared. ``reduction="mean"`` by default, so
      that plain SGD steps as under DDP with the same learning rate; or
    - ``share="local"``: DDP's all-reduce is switched off (a comm hook that leaves every
      gradient local) and :class:`gradshare.LocalSteps` over the LightningModule, with the
      optimizer of ``configure_optimizers`` (one) as its inner optimizer, syncs the replicas
      every ``sync_every`` steps (DiLoCo / SparseLoCo). Under ``precision="16-mixed"`` the
      precision plugin's ``GradScaler`` goes to ``LocalSteps(grad_scaler=...)``, so a rank
      whose step the scaler skipped (its gradients overflowed) still syncs with the others.

    Every checkpoint the trainer saves (``ModelCheckpoint``, ``trainer.save_checkpoint``) gets,
    beside it, one ``<checkpoint>.gradshare-rank{r}.pt`` per rank with that rank's residuals,
    threshold states and counters (the hook state, or the SharedOptimizer's whole
    ``state_dict``, or LocalSteps' state with the rank's own optimizer state and parameters,
    since replicas differ between syncs: Lightning's rank-0 checkpoint cannot hold the other
    ranks');
    ``trainer.fit(model, ckpt_path=...)`` loads each rank's file back, so a resumed fit
    continues bit for bit. Removing a checkpoint removes them too.

    Each save draws a token (a random id agreed by the ranks, and the global step): every
    rank writes it into its file, then rank 0 into the checkpoint (key ``"gradshare"``). A
    rank file left from another save (a rank killed while the checkpoint was written) is
    refused on resume, by name and with both steps, on every rank alike and before anything
    is restored. A checkpoint saved without gradshare (plain ``"ddp"``) has no rank files and
    is refused too, unless ``resume_without_rank_files=True``.

    Args:
        share: ``"gradients"`` (the hook), ``"updates"`` (SharedOptimizer) or ``"local"``
            (LocalSteps); ``"hook"`` is a deprecated alias of ``"gradients"``.
        local: :class:`~gradshare.LocalStepsOptions` (``share="local"``), or give its fields
            as keywords (``sync_every``, ``density``, ``decay``, ``outer_optimizer``,
            ``offload``, ``overlap``, ``fragments``, ``compact``, ``broadcast_buffers``).
        start_iter, momentum: the hook's (:class:`~gradshare.ThresholdHookState`).
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords (``threshold``, ``post_processor``, ``boundary``,
            ``magnitude``, ``dense``, ``reduction``), except ``timeout``, which is
            DDPStrategy's own: gradshare's is ``gradshare_timeout``.
        gradshare_timeout: how long gradshare's collectives wait for the other ranks (default
            :data:`gradshare._checks.DEFAULT_TIMEOUT`). It is also the process group's
            ``timeout`` unless that is given: Lightning broadcasts on the default group every
            step, so with torch's 30-minute default a hung rank would hold the others that long.
        resume_without_rank_files: resume from a checkpoint without reading the rank files:
            residuals and threshold states start empty (as on a fresh fit), the model and the
            optimizer come from the checkpoint (with ``share="updates"``, into the wrapped
            optimizer). For a checkpoint saved by plain ``"ddp"``; off by default, when a
            missing rank file is an error.
        **kwargs: :class:`lightning.pytorch.strategies.DDPStrategy`'s (``process_group_backend``,
            ``start_method``, ``timeout``, DDP's own keywords, ...), except ``ddp_comm_hook``.

    Attributes:
        hook_state: the :class:`~gradshare.ThresholdHookState` of the current fit
            (``share="gradients"``; None before it). Its ``bytes_sent`` / ``dense_bytes``
            count what this rank sent.
        local_steps: the :class:`~gradshare.LocalSteps` of the current fit (``share="local"``;
            None before it), with its ``bytes_sent`` / ``dense_bytes`` and ``metrics()``.
    """

    def __init__(
        self,
        *,
        share: Share = "gradients",
        local: LocalStepsOptions | None = None,
        start_iter: int = 1,
        momentum: float = 0.0,
        gradshare_timeout: float | timedelta | None = None,
        resume_without_rank_files: bool = False,
        options: EncodingOptions | None = None,
        **kwargs: Any,
    ) -> None:
        encoding = {k: kwargs.pop(k) for k in FIELDS if k != "timeout" and k in kwargs}
        if gradshare_timeout is not None:
            encoding["timeout"] = gradshare_timeout
        self.options = encoding_options(options, encoding, "GradshareDDPStrategy")
        fields = {k: kwargs.pop(k) for k in LOCAL_FIELDS if k in kwargs}
        self.local = local_steps_options(local, fields, "GradshareDDPStrategy")
        mode = share_mode(share, "GradshareDDPStrategy")
        if kwargs.get("ddp_comm_hook") is not None or kwargs.get("ddp_comm_state") is not None:
            raise ValueError(
                "GradshareDDPStrategy registers gradshare's hook itself: leave out "
                "`ddp_comm_hook` / `ddp_comm_state` (or use DDPStrategy for another hook)."
            )
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = timedelta(seconds=to_seconds(gradshare_timeout))
        super().__init__(**kwargs)
        self.share = mode
        self.resume_without_rank_files = resume_without_rank_files
        self._hook_settings: dict[str, Any] = {"start_iter": start_iter, "momentum": momentum}
        self.hook_state: ThresholdHookState | None = None
        self.local_steps: LocalSteps | None = None
        self._saved: dict[str, Any] | None = None
        """This rank's file of the checkpoint of ``trainer.fit(ckpt_path=...)``, read and
        agreed on by every rank when it is loaded, until the optimizers are restored."""
        self._without_files = False
        """The checkpoint being restored was loaded with ``resume_without_rank_files``."""

    # ------------------------------------------------------------------ set-up

    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        if self.share == "gradients":
            self.hook_state = register_threshold_hook(
                self.model, options=self.options, **self._hook_settings
            )
        elif self.share == "local":
            self.model.register_comm_hook(None, local_gradient_hook)
        if self._saved is not None and self.hook_state is not None:
            self.hook_state.load_state_dict(self._saved["hook"])

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.share == "gradients":
            for opt in self.optimizers:
                warn_if_adaptive(opt, "GradshareDDPStrategy(share='gradients')")
        if self.share in ("updates", "local") and len(self.optimizers) != 1:
            raise ValueError(
                f"GradshareDDPStrategy(share={self.share!r}) needs one optimizer, "
                f"`configure_optimizers` returned {len(self.optimizers)}: return one, or "
                "share='gradients'."
            )
        if self.share == "local":
            if self.local_steps is not None:
                self.local_steps.close()
            assert self.lightning_module is not None
            scaler = getattr(self.precision_plugin, "scaler", None)  # "16-mixed": skipped steps
            self.local_steps = LocalSteps(
                self.lightning_module,
                self.optimizers[0],
                local=self.local,
                grad_scaler=scaler,
                options=self.options,
            )
        if self.share == "updates":
            assert isinstance(self.model, DistributedDataParallel)
            shared = SharedOptimizer(self.optimizers[0], ddp=self.model, options=self.options)
            self.optimizers = [shared]  # schedulers keep working: same param_groups

    def _rank_file(self, checkpoint: Path) -> Path:
        path = lightning_rank_file(checkpoint, self.global_rank)
        if not path.exists() and checkpoint.is_symlink():  # ModelCheckpoint(save_last="link")
            path = lightning_rank_file(checkpoint.resolve(), self.global_rank)
        return path

    # ------------------------------------------------------------------ checkpointing

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its own state beside ``filepath`` with this save's token; then
        rank 0 writes the checkpoint, with the token."""
        if self.hook_state is not None or self._shared_optimizers() or self.local_steps:
            token = new_token(checkpoint.get("global_step", -1), timeout=self.options.timeout)
            path = lightning_rank_file(filepath, self.global_rank)
            save_rank_state(_RankFile(self), path, token=token)
            checkpoint[_TOKEN_KEY] = token.to_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load the checkpoint and this rank's file, every rank agreeing on it before anything
        is restored; :meth:`configure_ddp` and :meth:`load_optimizer_state_dict` restore its
        content once they have built what it restores (DDPStrategy restores checkpoints
        before its ``setup``)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._saved = None
        self._without_files = self.resume_without_rank_files
        if self._without_files:
            return checkpoint
        path = Path(checkpoint_path)
        token = SaveToken.from_dict(checkpoint.get(_TOKEN_KEY))
        try:
            load_rank_state(
                _RankFile(self),
                self._rank_file(path),
                token=token,
                source=str(path),
                timeout=self.options.timeout,
            )
        except FileNotFoundError as e:
            if token is not None:
                raise
            raise FileNotFoundError(
                f"{path} has no gradshare rank files (saved without gradshare, by plain "
                '"ddp"?): pass GradshareDDPStrategy(resume_without_rank_files=True) to resume '
                "it with empty residuals and fresh threshold states."
            ) from e
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """SharedOptimizers, and LocalSteps with its inner optimizer and the replica, load
        this rank's own state (the checkpoint holds rank 0's)."""
        shared = self._shared_optimizers()
        local = self.local_steps
        if local is not None and self._saved is not None:
            saved = self._saved["local"]
            local.load_state_dict(saved["state"])
            local.inner.load_state_dict(saved["inner"])
            with torch.no_grad():
                for p, t in zip(local.params, saved["params"], strict=True):
                    p.copy_(t)
        elif shared and self._saved is not None:
            for opt, state in zip(shared, self._saved["optimizers"], strict=True):
                opt.load_state_dict(state)
        elif shared and self._without_files:  # the wrapped optimizers' part of rank 0's
            for opt, state in zip(shared, checkpoint["optimizer_states"], strict=True):
                opt.optim.load_state_dict({k: v for k, v in state.items() if k != "gradshare"})
        else:
            super().load_optimizer_state_dict(checkpoint)
        self._saved = None
        self._without_files = False

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        lightning_rank_file(filepath, self.global_rank).unlink(missing_ok=True)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.local_steps is not None:  # where the replicas may differ: their mean
            self.local_steps.average()

    def teardown(self) -> None:
        super().teardown()
        if self.local_steps is not None:
            self.local_steps.close()  # its counters stay readable
        self._saved = None  # a later run starts from its own checkpoint
        self._without_files = False

    def _shared_optimizers(self) -> list[SharedOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, SharedOptimizer)]


class _RankFile:
    """What one rank's file holds: the hook state, the SharedOptimizers' state dicts, and
    LocalSteps' state with its inner optimizer's and the replica's parameters.
    Loading keeps the file's content for the strategy to restore piece by piece."""

    def __init__(self, strategy: GradshareDDPStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        hook, local = self.strategy.hook_state, self.strategy.local_steps
        return {
            "share": self.strategy.share,
            "hook": None if hook is None else hook.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.strategy._shared_optimizers()],
            "local": None
            if local is None
            else {
                "state": local.state_dict(),
                "inner": local.inner.state_dict(),
                "params": [p.detach().clone() for p in local.params],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("share") != self.strategy.share:
            raise ValueError(
                f"The checkpoint was saved with share={state.get('share')!r}, this strategy "
                f"has share={self.strategy.share!r}: resume with the mode that saved it."
            )
        self.strategy._saved = state
