"""The Hugging Face Trainer example on each path in the same 2 processes, under torchrun: each
process spends seconds of CPU importing transformers, more than a run of the example takes,
so ``tests/test_hf_trainer.py`` runs the four paths, and the faults below, in one launch
rather than one each.

1. For ``--share`` gradients, updates, local, and local with ``--overlap 2 --no-compact`` in
   turn: 10 steps straight through, saving at step 5, then resumed from ``checkpoint-5`` with
   a fresh model and Trainer (``--check-resume 5``), into ``TMP/{path}/out``, the parameters
   into ``TMP/{path}/straight.pt``.
2. ``reused``: a copy of the local path's ``out`` saved into again by another run (another
   learning rate) whose ranks stop after Trainer wrote ``checkpoint-5``, before the callback's
   ``on_save`` (it raises there); then a resume from that ``checkpoint-5``.
3. ``between``: local steps for 7 steps (the run ends between two syncs), with a
   ``GradScaler`` in accelerate (as ``fp16=True`` gives on CUDA; set by hand on CPU), rank 1's
   gradients overflowing at step 3, so its scaler skips that step.
4. ``hang``, last: local steps with no sync due and ``--timeout 5``; rank 0 stops at the end
   of step 2 until rank 1 is done (at most 120 s), rank 1 waits in Trainer's own per-step
   all-gather. Both then leave with ``os._exit(0)`` (the group is broken).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_fits.py TMP

Rank 0 writes ``TMP/said.json``: what each path printed; rank r writes ``TMP/rank{r}.json``:
each fault's outcome on that rank, after each fault.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer

from gradshare.integrations import GradshareCallback

PATHS = {
    "gradients": ["--share", "gradients"],
    "updates": ["--share", "updates"],
    "local": ["--share", "local"],
    "local-overlap": ["--share", "local", "--overlap", "2", "--no-compact"],
}
"""Each path's options, by name (local with overlap: checkpoint-5 holds a round in flight;
every fragment at once, so the replicas are bit-identical at the end, as the example checks)."""

OVERFLOW_AT = 3
"""The step whose gradients overflow on rank 1 (``between``)."""
HANG_AT = 2
"""The step after which rank 0 stops (``hang``)."""


def build(*argv: str | Path) -> Any:
    """A fresh model and Trainer of the example, with its options ``argv``."""
    args = hf_trainer.parse_args([*map(str, argv)])
    return hf_trainer.build(args, args.output_dir)


def train(trainer: Any, resume: Path | None = None) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))


def error_of(action: Any) -> str | None:
    """Run ``action()``; its error as text, or None."""
    try:
        action()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def reused(tmp: Path) -> dict[str, Any]:
    """Another run saves into a copy of the local path's ``out`` and stops before ``on_save``;
    then the resume from its ``checkpoint-5``."""
    out = tmp / "reused" / "out"
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "local" / "out", out)
    dist.barrier()
    other = ["--share", "local", "--lr", "1e-3", "--output-dir", out]
    killed = RuntimeError("stopped after Trainer's files, before on_save")
    with mock.patch.object(GradshareCallback, "on_save", side_effect=killed):
        stopped = error_of(lambda: train(build(*other, "--steps", "5", "--save-steps", "5")))
    # a relaunch starts once every rank has stopped: rank 1, which writes none of Trainer's
    # files, reached on_save first and read rank 0's trainer_state.json before it was written
    dist.barrier()
    resumed = error_of(lambda: train(build(*other, "--steps", "10"), out / "checkpoint-5"))
    return {"stopped": stopped, "resumed": resumed}


class Overflow(TrainerCallback):
    """Rank 1's gradients overflow at step :data:`OVERFLOW_AT` (a gradient hook, before the
    scaler unscales); notes whether the scaler reached LocalSteps."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.reached: bool | None = None
        if dist.get_rank() == 1:
            next(trainer.model.parameters()).register_hook(self.spoil)

    def spoil(self, grad: torch.Tensor) -> torch.Tensor:
        if self.trainer.state.global_step + 1 != OVERFLOW_AT:
            return grad
        return torch.full_like(grad, float("inf"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        callback = self.trainer.callback_handler.callbacks[0]
        self.reached = callback.shared._scaler is self.trainer.accelerator.scaler


def between(tmp: Path) -> dict[str, Any]:
    """``between``: the run's error, whether the scaler reached LocalSteps, this rank's scale at
    the end, and whether the replicas are bit-identical then."""
    flags = "--share local --steps 7 --timeout 20".split()
    trainer = build(*flags, "--output-dir", tmp / "between" / "out")
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    overflow = Overflow(trainer)
    trainer.add_callback(overflow)
    error = error_of(lambda: train(trainer))
    params = hf_trainer.flat(trainer)
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return {
        "error": error,
        "reached": overflow.reached,
        "scale": trainer.accelerator.scaler.get_scale(),
        "replicas_equal": torch.equal(*gathered),
    }


class Hang(TrainerCallback):
    """Rank 0 stops at the end of step :data:`HANG_AT` until ``done`` exists (at most 120 s),
    then leaves; every rank notes when it ended that step."""

    def __init__(self, done: Path) -> None:
        self.done = done
        self.at: float | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != HANG_AT:
            return
        self.at = time.monotonic()
        if dist.get_rank() == 0:
            while not self.done.exists() and time.monotonic() < self.at + 120:
                time.sleep(0.2)
            os._exit(0)


def hang(tmp: Path) -> dict[str, Any]:
    stop = Hang(tmp / "hang-done")
    flags = "--share local --sync-every 100 --steps 6 --timeout 5".split()
    trainer = build(*flags, "--output-dir", tmp / "hang" / "out")
    trainer.add_callback(stop)
    error = error_of(lambda: train(trainer))
    waited = -1.0 if stop.at is None else time.monotonic() - stop.at
    return {"error": error, "waited": waited}


def main() -> None:
    tmp = Path(sys.argv[1])
    said: dict[str, str] = {}
    for name, chosen in PATHS.items():
        paths = ["--output-dir", str(tmp / name / "out"), "--out", str(tmp / name / "straight.pt")]
        args = hf_trainer.parse_args([*chosen, "--steps", "10", "--check-resume", "5", *paths])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            hf_trainer.run(args)
        said[name] = out.getvalue()
    if dist.get_rank() == 0:
        (tmp / "said.json").write_text(json.dumps(said))
    faults: dict[str, Any] = {}
    for name, fault in (("reused", reused), ("between", between), ("hang", hang)):
        faults[name] = fault(tmp)  # rank 0 leaves in the hang
        (tmp / f"rank{dist.get_rank()}.json").write_text(json.dumps(faults))
    (tmp / "hang-done").write_text("done")
    os._exit(0)


if __name__ == "__main__":
    main()
