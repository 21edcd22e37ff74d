"""Twelve fits of ``examples/lightning_ddp.py``'s module in the same 2 processes, under
torchrun: each Lightning process spends ~6 s of CPU importing Lightning, ten times what a fit
of the example takes, so ``tests/test_integrations.py`` runs these in one launch rather than
twelve.

Every fit calls the example's ``main`` with a fresh model, strategy and Trainer; what one fit
leaves in the process (the process group) the next one reuses, as Lightning does under
torchrun. In order, each ``--steps-per-epoch 3 --epochs 2``:

1. ``--share gradients`` straight through, checkpointed at each epoch's end, then resumed from
   ``step=3.ckpt`` (through a ``last.ckpt`` link, as ``ModelCheckpoint(save_last="link")``
   makes it); the same for ``--share updates``.
2. ``--share local --sync-every 2`` straight through, then resumed from ``step=3.ckpt`` (saved
   between two syncs: the replicas differ, each rank's own in its rank file); the same with
   ``--overlap 1 --fragments 2 --no-compact`` (the checkpoint saved with a fragment's round in
   flight; DL4J's messages).
3. On a copy of the gradients fit's checkpoint: rank 1's file left from the save before
   (refused), then the checkpoint as plain ``ddp`` saves it, without rank files (refused, then
   resumed with ``--resume-without-rank-files``).
4. ``local-scaler``: ``share="local", sync_every=2`` under ``precision="16-mixed"`` with a
   CPU ``GradScaler`` (Lightning makes none on CPU), for 6 steps; rank 1's gradients
   overflow at step 1, so its scaler skips that step.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/lightning_fits.py TMP

Rank r writes ``TMP/rank{r}.json``: each refused fit's error and each fit's printed lines
(``local-scaler``: its outcome); rank 0 also the parameters (``TMP/{share}/straight.pt``,
``resumed.pt``, ``TMP/plain.pt``).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import MixedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import lightning_ddp

from gradshare.integrations import GradshareDDPStrategy, lightning_rank_file
from test_integrations import WORLD, make_stale

EPOCHS = ["--steps-per-epoch", "3", "--epochs", "2"]
OVERFLOW_AT = 1
"""The step whose gradients overflow on rank 1 (``local-scaler``)."""


def fit(*args: str | Path) -> tuple[str, str | None]:
    """One fit; what it printed, and its error (None when it ended)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            lightning_ddp.main([*map(str, args)])
    except Exception as e:  # a refusal: every rank raises alike, and the next fit goes on
        return out.getvalue(), f"{type(e).__name__}: {e}"
    return out.getvalue(), None


def on_rank_zero(action: Callable[[], object]) -> None:
    """``action()`` on rank 0 while the other waits (rank 0 arranges the files)."""
    if dist.get_rank() == 0:
        action()
    dist.barrier()


class Overflow(L.Callback):
    """Rank 1's gradients overflow at step :data:`OVERFLOW_AT` (after the backward, before the
    scaler unscales them); notes whether the precision plugin's scaler reached LocalSteps."""

    reached: bool | None = None

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == 1 and trainer.global_step + 1 == OVERFLOW_AT:
            grad = next(module.parameters()).grad
            assert grad is not None
            grad.fill_(float("inf"))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        local = trainer.strategy.local_steps
        self.reached = local._scaler is trainer.precision_plugin.scaler


def scaled_fit() -> dict[str, Any]:
    """``local-scaler``: the fit's error, whether the scaler reached LocalSteps, this rank's
    scale at the end, and whether the replicas are bit-identical then."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    overflow = Overflow()
    trainer = L.Trainer(
        strategy=GradshareDDPStrategy(
            share="local", sync_every=2, gradshare_timeout=20, process_group_backend="gloo"
        ),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=6,
        callbacks=[overflow],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = lightning_ddp.DigitsMLP(0.2, 32)
    error = fit_error(lambda: trainer.fit(model))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return {
        "error": error,
        "reached": overflow.reached,
        "scale": scaler.get_scale(),
        "replicas_equal": torch.equal(*gathered),
    }


def fit_error(action: Callable[[], object]) -> str | None:
    try:
        action()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    tmp = Path(sys.argv[1])
    results: dict[str, Any] = {}
    local = ["--share", "local", "--sync-every", "2"]
    fits = {
        "gradients": ["--share", "gradients"],
        "updates": ["--share", "updates"],
        "local": local,
        "local-overlap": [*local, "--overlap", "1", "--fragments", "2", "--no-compact"],
    }
    for name, chosen in fits.items():
        ckpt = tmp / name / "ckpt"
        args = [*chosen, *EPOCHS]
        results[f"{name}-straight"] = fit(
            *args, "--checkpoint-dir", ckpt, "--out", tmp / name / "straight.pt"
        )
        link = ckpt / "last.ckpt"
        on_rank_zero(partial(link.symlink_to, "step=3.ckpt"))
        results[f"{name}-resumed"] = fit(
            *args, "--resume", link, "--out", tmp / name / "resumed.pt"
        )

    saved = tmp / "spoiled" / "step=3.ckpt"
    args = ["--share", "gradients", *EPOCHS, "--resume", saved]

    def copy_and_spoil() -> None:
        shutil.copytree(tmp / "gradients" / "ckpt", saved.parent, symlinks=True)
        make_stale(lightning_rank_file(saved, 1))

    on_rank_zero(copy_and_spoil)
    results["stale"] = fit(*args)

    def as_plain_ddp_saves_it() -> None:
        checkpoint = torch.load(saved, weights_only=False)
        del checkpoint["gradshare"]
        torch.save(checkpoint, saved)  # no token, no rank files
        for r in range(WORLD):
            lightning_rank_file(saved, r).unlink()

    on_rank_zero(as_plain_ddp_saves_it)
    results["plain"] = fit(*args)
    results["plain-allowed"] = fit(*args, "--resume-without-rank-files", "--out", tmp / "plain.pt")
    results["local-scaler"] = scaled_fit()
    (tmp / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
