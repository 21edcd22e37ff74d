"""The Lightning strategy of :mod:`gradshare.integrations` (imports Lightning: private, loaded
by ``gradshare.integrations.GradshareDDPStrategy`` on first use)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from gradshare.ddp_hook import ThresholdHookState, register_threshold_hook
from gradshare.integrations import lightning_rank_file, load_rank_state, save_rank_state
from gradshare.residual import ResidualPostProcessor
from gradshare.threshold import ThresholdAlgorithm

__all__ = ["GradshareDDPStrategy"]


class GradshareDDPStrategy(DDPStrategy):
    """Lightning's DDP with gradshare's threshold hook in place of the gradient all-reduce.

    ``Trainer(strategy=GradshareDDPStrategy(), accelerator="cpu", devices=2)``: when fitting,
    the DDP model Lightning builds gets :func:`gradshare.register_threshold_hook` (on CPU as on
    CUDA; Lightning's own ``ddp_comm_hook`` is registered on CUDA only). Every checkpoint the
    trainer saves (``ModelCheckpoint``, ``trainer.save_checkpoint``) gets, beside it, one
    ``<checkpoint>.gradshare-rank{r}.pt`` per rank with that rank's residuals, threshold
    states and byte counters; ``trainer.fit(model, ckpt_path=...)`` loads each rank's file
    back, so a resumed fit continues bit for bit. Removing a checkpoint removes them too.

    Args:
        threshold, post_processor, boundary, start_iter: as for
            :class:`~gradshare.ThresholdHookState`.
        hook_timeout: how long a hook collective may wait for the other ranks (default
            :data:`gradshare.accumulator.DEFAULT_TIMEOUT`).
        **kwargs: :class:`lightning.pytorch.strategies.DDPStrategy`'s (``process_group_backend``,
            ``start_method``, DDP's own keywords, ...), except ``ddp_comm_hook``.

    Attributes:
        hook_state: the :class:`~gradshare.ThresholdHookState` of the current fit (None before
            it; read ``bytes_sent`` / ``dense_bytes`` from it).
    """

    def __init__(
        self,
        *,
        threshold: ThresholdAlgorithm | None = None,
        post_processor: ResidualPostProcessor | None = None,
        boundary: int | None = None,
        start_iter: int = 1,
        hook_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("ddp_comm_hook") is not None or kwargs.get("ddp_comm_state") is not None:
            raise ValueError(
                "GradshareDDPStrategy registers gradshare's threshold hook itself: leave out "
                "`ddp_comm_hook` / `ddp_comm_state` (or use DDPStrategy for another hook)."
            )
        super().__init__(**kwargs)
        self._hook_settings: dict[str, Any] = {
            "threshold": threshold,
            "post_processor": post_processor,
            "boundary": boundary,
            "start_iter": start_iter,
            "timeout": hook_timeout,
        }
        self.hook_state: ThresholdHookState | None = None
        self._restore_from: Path | None = None
        """A checkpoint whose rank files are loaded once the hook is registered."""

    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state = register_threshold_hook(self.model, **self._hook_settings)
        if self._restore_from is not None:
            path = lightning_rank_file(self._restore_from, self.global_rank)
            if not path.exists() and self._restore_from.is_symlink():  # save_last="link"
                path = lightning_rank_file(self._restore_from.resolve(), self.global_rank)
            load_rank_state(self.hook_state, path)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its hook state beside ``filepath``; rank 0 writes the checkpoint."""
        if self.hook_state is not None:
            save_rank_state(self.hook_state, lightning_rank_file(filepath, self.global_rank))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # fitting: configure_ddp registers the hook, restores its state
        self._restore_from = None  # validate / test / predict: no hook, nothing to restore

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load the checkpoint; each rank's hook state follows when :meth:`configure_ddp`
        registers the hook (DDPStrategy restores checkpoints before its ``setup``)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restore_from = Path(checkpoint_path)
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        lightning_rank_file(filepath, self.global_rank).unlink(missing_ok=True)
