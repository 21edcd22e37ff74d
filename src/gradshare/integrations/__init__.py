"""gradshare under Lightning and accelerate, with every rank's state checkpointed.

Both frameworks write a checkpoint from rank 0 only (Lightning's ``Trainer.save_checkpoint``,
accelerate's ``save_state``, including objects given to ``register_for_checkpointing``).
gradshare's residuals and threshold states differ from rank to rank, so each rank writes its
own file beside the framework's checkpoint and reads it back on resume:

- Lightning: ``Trainer(strategy=GradshareDDPStrategy(), ...)`` registers the threshold hook
  on the DDP model it builds (on CPU too, where ``DDPStrategy(ddp_comm_hook=...)`` registers
  nothing), or with ``share="updates"`` wraps the optimizer in ``SharedOptimizer(opt,
  ddp=...)``; it writes ``<checkpoint>.gradshare-rank{r}.pt`` beside each checkpoint.
- Hugging Face Trainer: ``GradshareCallback(share="gradients"|"updates"|"local").attach(trainer)``
  registers the hook, wraps Trainer's optimizer in ``SharedOptimizer`` or runs ``LocalSteps``
  on the DDP model Trainer builds; it writes ``checkpoint-N/gradshare-rank{r}.pt`` at every
  save and reads back those of the folder Trainer resumed from, and adds gradshare's metrics
  to Trainer's logs.
- accelerate: after ``accelerator.prepare(...)``,
  ``state = register_threshold_hook(model)`` and ``register_rank_checkpointing(accelerator,
  state)``; ``save_state(dir)`` then also writes ``dir/gradshare-rank{r}.pt``.

Each file records the rank and world size that wrote it, and the save's token (a random id
agreed by the ranks, and the step), which the framework's checkpoint also holds (Lightning's
checkpoint dict and Trainer's ``trainer_state.json`` hold it; accelerate's directory gets
``gradshare-save.json`` once every rank is through ``save_state``); loading refuses another
rank's file, another world size's, or one of another save (a save cut short, another run's
files), on every rank alike. Files are read with ``torch.load(weights_only=True)``.

Why accelerate has the hook only: ``save_state`` writes the optimizer's ``state_dict()`` from
the main process and ``load_state`` loads that one file into every rank's optimizer, with no
way around it for one optimizer; SharedOptimizer's state dict carries the rank's residual, so
the other ranks refuse it (as they must). The hook keeps the optimizer plain, so its rank-0
copy is every rank's. (Lightning lets the strategy load the optimizers itself.)

No framework is imported by ``import gradshare``; this module imports Lightning only when
``GradshareDDPStrategy`` is first used, transformers when ``GradshareCallback`` is (``pip
install -e '.[integrations]'``).

What lives here: :mod:`~gradshare.integrations.rank_files` (every rank's own file),
:mod:`~gradshare.integrations.lightning` (``GradshareDDPStrategy``),
:mod:`~gradshare.integrations.hf_trainer` (``GradshareCallback``),
:mod:`~gradshare.integrations.accelerate` (``register_rank_checkpointing``).

May import: any layer below it (:mod:`gradshare.distributed`, :mod:`gradshare.local`,
:mod:`gradshare.encoding`, :mod:`gradshare.codec`) and the frameworks, lazily; nothing of
gradshare imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradshare.integrations.accelerate import register_rank_checkpointing
from gradshare.integrations.rank_files import (
    SaveToken,
    accelerate_rank_file,
    lightning_rank_file,
    load_rank_state,
    new_token,
    save_rank_state,
)

if TYPE_CHECKING:
    from gradshare.integrations.hf_trainer import GradshareCallback
    from gradshare.integrations.lightning import GradshareDDPStrategy

__all__ = [
    # Lightning
    "GradshareDDPStrategy",
    "lightning_rank_file",
    # Hugging Face Trainer
    "GradshareCallback",
    # accelerate
    "accelerate_rank_file",
    "register_rank_checkpointing",
    # the per-rank files
    "SaveToken",
    "load_rank_state",
    "new_token",
    "save_rank_state",
]

_INSTALL = "pip install -e '.[integrations]'"


def __getattr__(name: str) -> Any:
    if name == "GradshareCallback":
        try:
            from gradshare.integrations.hf_trainer import GradshareCallback
        except ImportError as e:
            raise ImportError(
                f"gradshare.integrations.GradshareCallback needs transformers ({e}): {_INSTALL}"
            ) from e
        return GradshareCallback
    if name == "GradshareDDPStrategy":
        try:
            from gradshare.integrations.lightning import GradshareDDPStrategy
        except ImportError as e:
            raise ImportError(
                f"gradshare.integrations.GradshareDDPStrategy needs Lightning ({e}): {_INSTALL}"
            ) from e
        return GradshareDDPStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
