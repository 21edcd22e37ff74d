"""The Lightning strategy of :mod:`gradshare.integrations` (imports Lightning: private, loaded
by ``gradshare.integrations.GradshareDDPStrategy`` on first use)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from gradshare.distributed.ddp_hook import ThresholdHookState, register_threshold_hook
from gradshare.distributed.shared_optimizer import SharedOptimizer
from gradshare.encoding.options import FIELDS, EncodingOptions, encoding_options
from gradshare.integrations.rank_files import lightning_rank_file, load_rank_state, save_rank_state

__all__ = ["GradshareDDPStrategy"]


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
      that plain SGD steps as under DDP with the same learning rate.

    Every checkpoint the trainer saves (``ModelCheckpoint``, ``trainer.save_checkpoint``) gets,
    beside it, one ``<checkpoint>.gradshare-rank{r}.pt`` per rank with that rank's residuals,
    threshold states and counters (the hook state, or the SharedOptimizer's whole
    ``state_dict``, which Lightning's rank-0 checkpoint cannot hold for the other ranks);
    ``trainer.fit(model, ckpt_path=...)`` loads each rank's file back, so a resumed fit
    continues bit for bit. Removing a checkpoint removes them too.

    Args:
        share: ``"gradients"`` (the hook) or ``"updates"`` (SharedOptimizer).
        start_iter, momentum: the hook's (:class:`~gradshare.ThresholdHookState`).
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords (``threshold``, ``post_processor``, ``boundary``,
            ``magnitude``, ``dense``, ``reduction``), except ``timeout``, which is
            DDPStrategy's own: gradshare's is ``gradshare_timeout``.
        gradshare_timeout: how long gradshare's collectives wait for the other ranks (default
            :data:`gradshare._checks.DEFAULT_TIMEOUT`; DDPStrategy's own ``timeout`` is
            the process group's).
        **kwargs: :class:`lightning.pytorch.strategies.DDPStrategy`'s (``process_group_backend``,
            ``start_method``, ``timeout``, DDP's own keywords, ...), except ``ddp_comm_hook``.

    Attributes:
        hook_state: the :class:`~gradshare.ThresholdHookState` of the current fit
            (``share="gradients"``; None before it). Its ``bytes_sent`` / ``dense_bytes``
            count what this rank sent.
    """

    def __init__(
        self,
        *,
        share: Literal["gradients", "updates"] = "gradients",
        start_iter: int = 1,
        momentum: float = 0.0,
        gradshare_timeout: float | timedelta | None = None,
        options: EncodingOptions | None = None,
        **kwargs: Any,
    ) -> None:
        encoding = {k: kwargs.pop(k) for k in FIELDS if k != "timeout" and k in kwargs}
        if gradshare_timeout is not None:
            encoding["timeout"] = gradshare_timeout
        self.options = encoding_options(options, encoding, "GradshareDDPStrategy")
        if share not in ("gradients", "updates"):
            raise ValueError(f'Expect `share` "gradients" or "updates", got {share!r}.')
        if kwargs.get("ddp_comm_hook") is not None or kwargs.get("ddp_comm_state") is not None:
            raise ValueError(
                "GradshareDDPStrategy registers gradshare's hook itself: leave out "
                "`ddp_comm_hook` / `ddp_comm_state` (or use DDPStrategy for another hook)."
            )
        super().__init__(**kwargs)
        self.share = share
        self._hook_settings: dict[str, Any] = {"start_iter": start_iter, "momentum": momentum}
        self.hook_state: ThresholdHookState | None = None
        self._restore_from: Path | None = None
        """The checkpoint of ``trainer.fit(ckpt_path=...)``, until its rank file is read."""
        self._saved: dict[str, Any] | None = None
        """This rank's file of that checkpoint, until the optimizers are restored."""

    # ------------------------------------------------------------------ set-up

    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        if self.share == "gradients":
            self.hook_state = register_threshold_hook(
                self.model, options=self.options, **self._hook_settings
            )
        if self._restore_from is not None:
            load_rank_state(_RankFile(self), self._rank_file(self._restore_from))
            if self.hook_state is not None:
                assert self._saved is not None
                self.hook_state.load_state_dict(self._saved["hook"])
            self._restore_from = None

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.share == "updates":
            if len(self.optimizers) != 1:
                raise ValueError(
                    "GradshareDDPStrategy(share='updates') shares one optimizer's updates, "
                    f"`configure_optimizers` returned {len(self.optimizers)}: return one, or "
                    "share='gradients'."
                )
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
        """Every rank writes its own state beside ``filepath``; rank 0 writes the checkpoint."""
        if self.hook_state is not None or self._shared_optimizers():
            save_rank_state(_RankFile(self), lightning_rank_file(filepath, self.global_rank))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load the checkpoint; this rank's file is read when :meth:`configure_ddp` has built
        what it restores (DDPStrategy restores checkpoints before its ``setup``)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restore_from = Path(checkpoint_path)
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """SharedOptimizers load this rank's own state (the checkpoint holds rank 0's)."""
        shared = self._shared_optimizers()
        if not shared or self._saved is None:
            super().load_optimizer_state_dict(checkpoint)
        else:
            for opt, state in zip(shared, self._saved["optimizers"], strict=True):
                opt.load_state_dict(state)
        self._saved = None

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        lightning_rank_file(filepath, self.global_rank).unlink(missing_ok=True)

    def teardown(self) -> None:
        super().teardown()
        self._restore_from = self._saved = None  # a later run starts from its own checkpoint

    def _shared_optimizers(self) -> list[SharedOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, SharedOptimizer)]


class _RankFile:
    """What one rank's file holds: the hook state and the SharedOptimizers' state dicts.
    Loading keeps the file's content for the strategy to restore piece by piece."""

    def __init__(self, strategy: GradshareDDPStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        hook = self.strategy.hook_state
        return {
            "share": self.strategy.share,
            "hook": None if hook is None else hook.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.strategy._shared_optimizers()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("share") != self.strategy.share:
            raise ValueError(
                f"The checkpoint was saved with share={state.get('share')!r}, this strategy "
                f"has share={self.strategy.share!r}: resume with the mode that saved it."
            )
        self.strategy._saved = state
