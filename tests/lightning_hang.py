"""A Lightning fit whose rank 0 hangs: how long rank 1 waits (run by tests/test_integrations.py).

    torchrun --standalone --nproc_per_node=2 tests/lightning_hang.py DONE_FILE TIMEOUT

``examples/lightning_ddp.py``'s module on 2 CPU processes with
``GradshareDDPStrategy(share="local", sync_every=100, gradshare_timeout=TIMEOUT)``: no sync falls
in the fit, so the only collective that reaches the hung rank is Lightning's own broadcast
from rank 0 at every step (of a SIGTERM flag; Lightning swallows its error). Rank 0 stops at
the end of step 2 until rank 1 wrote DONE_FILE (at most 120 s); rank 1 prints how long after
its own step 2 the fit ended, and how.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lightning_ddp import DigitsMLP

from gradshare.integrations import GradshareDDPStrategy

HANG_AT = 2


class Hang(L.Callback):
    """Rank 0 stops at the end of step ``HANG_AT`` until rank 1 is done (``done`` written) or
    120 s passed; rank 1 notes when it ended that step."""

    def __init__(self, done: Path) -> None:
        self.at: float | None = None
        self.done = done

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != HANG_AT:
            return
        self.at = time.monotonic()
        if trainer.global_rank == 0:
            while not self.done.exists() and time.monotonic() < self.at + 120:
                time.sleep(0.2)
            os._exit(0)


def main() -> None:
    torch.set_num_threads(1)
    hang = Hang(Path(sys.argv[1]))
    strategy = GradshareDDPStrategy(
        share="local",
        sync_every=100,
        gradshare_timeout=float(sys.argv[2]),
        process_group_backend="gloo",
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=6,
        callbacks=[hang],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(DigitsMLP(0.2, 32))
        outcome = "finished the fit"
    except BaseException as e:
        outcome = f"raised {type(e).__name__}: {str(e)[:300]}"
        raise
    finally:
        waited = -1.0 if hang.at is None else time.monotonic() - hang.at
        print(
            f"rank {trainer.global_rank}, {waited:.1f} s after step {HANG_AT}: {outcome}",
            flush=True,
        )
        Path(sys.argv[1]).write_text("done")


if __name__ == "__main__":
    main()
