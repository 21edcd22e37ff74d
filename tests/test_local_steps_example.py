"""examples/local_steps.py under torchrun, as a user runs it; a killed worker resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
STEPS = ["--epochs", "1", "--steps", "20", "--save-every", "10"]


def torchrun(*args: str | Path, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TORCHRUN, f"--max-restarts={restarts}", str(ROOT / "examples" / "local_steps.py"),
         *map(str, args)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.Tensor]:
    """An uninterrupted run of 20 steps: its stdout and rank 0's final parameters."""
    out = tmp_path_factory.mktemp("whole") / "whole.pt"
    run = torchrun(*STEPS, "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, torch.load(out, weights_only=True)


def test_runs_and_reports_its_bytes(whole: tuple[str, torch.Tensor]) -> None:
    assert "step 20: rank 0 sent" in whole[0] and "x less)" in whole[0], whole[0]


def test_elastic_restart_ends_where_an_uninterrupted_run_does(
    tmp_path: Path, whole: tuple[str, torch.Tensor]
) -> None:
    """``--max-restarts=1`` and the last rank dying at step 12: torchrun restarts both, they
    resume from the step-10 checkpoints and end at the uninterrupted run's parameters, bit
    for bit."""
    run = torchrun(
        *STEPS, "--checkpoint-dir", tmp_path / "ckpt", "--crash-at-step", "12",
        "--out", tmp_path / "elastic.pt", restarts=1,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from step 10" in run.stdout
    assert torch.equal(torch.load(tmp_path / "elastic.pt", weights_only=True), whole[1])
