"""examples/local_steps.py under torchrun, as a user runs it; a killed worker resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

from world import selected

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
def launched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The launches of the selected tests below, both started at once (each spends seconds
    starting its agent and then its workers, so they overlap): a test waits for its own."""
    jobs = {
        "whole": partial(torchrun, *STEPS, "--out", tmp_path_factory.mktemp("whole") / "whole.pt")
    }
    if selected(request, "test_elastic_restart_ends_where_an_uninterrupted_run_does"):
        tmp = tmp_path_factory.mktemp("elastic")
        jobs["elastic"] = partial(
            torchrun, *STEPS, "--checkpoint-dir", tmp / "ckpt", "--crash-at-step", "12",
            "--out", tmp / "elastic.pt", restarts=1,
        )  # fmt: skip
    with ThreadPoolExecutor(len(jobs)) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


def _out(run: subprocess.CompletedProcess[str]) -> torch.Tensor:
    return torch.load(run.args[run.args.index("--out") + 1], weights_only=True)


@pytest.fixture(scope="module")
def whole(
    launched: dict[str, Future[subprocess.CompletedProcess[str]]],
) -> tuple[str, torch.Tensor]:
    """An uninterrupted run of 20 steps: its stdout and rank 0's final parameters."""
    run = launched["whole"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, _out(run)


def test_runs_and_reports_its_bytes(whole: tuple[str, torch.Tensor]) -> None:
    assert "step 20: rank 0 sent" in whole[0] and "x less)" in whole[0], whole[0]


def test_elastic_restart_ends_where_an_uninterrupted_run_does(
    launched: dict[str, Future[subprocess.CompletedProcess[str]]], whole: tuple[str, torch.Tensor]
) -> None:
    """``--max-restarts=1`` and the last rank dying at step 12: torchrun restarts both, they
    resume from the step-10 checkpoints and end at the uninterrupted run's parameters, bit
    for bit."""
    run = launched["elastic"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from step 10" in run.stdout
    assert torch.equal(_out(run), whole[1])
