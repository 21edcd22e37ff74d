"""examples/local_steps.py under torchrun, as a user runs it; a killed worker resumes, and a
damaged checkpoint is passed over."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from world import selected

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
STEPS = ["--epochs", "1", "--steps", "20", "--save-every", "10"]


def torchrun(
    *args: str | Path, restarts: int = 0, ranks: int = 2
) -> subprocess.CompletedProcess[str]:
    launcher = [*TORCHRUN[:-1], f"--nproc_per_node={ranks}"]
    script = str(ROOT / "examples" / "local_steps.py")
    return subprocess.run(
        [*launcher, f"--max-restarts={restarts}", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def launched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The launches of the selected tests below, started at once (each spends seconds
    starting its agent and then its workers, so they overlap): a test waits for its own.
    The uninterrupted run saves at steps 10 and 20; the damaged launch starts from a copy of
    those checkpoints once it has ended."""
    tmp = tmp_path_factory.mktemp("whole")
    whole = partial(torchrun, *STEPS, "--checkpoint-dir", tmp / "ckpt", "--out", tmp / "whole.pt")
    jobs = {"whole": whole}
    if selected(request, "test_elastic_restart_ends_where_an_uninterrupted_run_does"):
        tmp = tmp_path_factory.mktemp("elastic")
        crash = ["--crash-at-step", "12", "--out", tmp / "elastic.pt"]
        jobs["elastic"] = partial(
            torchrun, *STEPS, "--checkpoint-dir", tmp / "ckpt", *crash, restarts=1
        )
    with ThreadPoolExecutor(len(jobs) + 2) as pool:
        runs = {name: pool.submit(job) for name, job in jobs.items()}
        if selected(request, "test_a_third_rank_resumes_the_two_ranks_checkpoint"):
            runs["resized"] = pool.submit(_resized, runs["whole"], tmp_path_factory.mktemp("3"))
        if selected(request, "test_a_damaged_newest_checkpoint_is_passed_over"):
            tmp = tmp_path_factory.mktemp("damaged")
            runs["damaged"] = pool.submit(_damaged, runs["whole"], tmp)
        yield runs


def _damaged(whole: Future[subprocess.CompletedProcess[str]], tmp: Path) -> Any:
    """Once ``whole`` has ended: a copy of its checkpoints, rank 1's newest file (step 20)
    damaged, resumed by a launch that may restart once."""
    run = whole.result()
    ckpt = tmp / "ckpt"
    shutil.copytree(run.args[run.args.index("--checkpoint-dir") + 1], ckpt)
    (ckpt / "step000020" / "rank1.pt").write_bytes(b"PK\x03\x04 cut short")
    return torchrun(*STEPS, "--checkpoint-dir", ckpt, "--out", tmp / "resumed.pt", restarts=1)


def _resized(whole: Future[subprocess.CompletedProcess[str]], tmp: Path) -> Any:
    """Once ``whole`` (2 ranks) has ended: its checkpoints resumed by 3 ranks."""
    run = whole.result()
    ckpt = tmp / "ckpt"
    shutil.copytree(run.args[run.args.index("--checkpoint-dir") + 1], ckpt)
    return torchrun("--epochs", "3", "--steps", "30", "--save-every", "10", "--checkpoint-dir",
                    ckpt, ranks=3)  # fmt: skip


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


def test_a_damaged_newest_checkpoint_is_passed_over(
    launched: dict[str, Future[subprocess.CompletedProcess[str]]], whole: tuple[str, torch.Tensor]
) -> None:
    """Rank 1's file of step 20 is damaged: the example loaded the newest checkpoint every
    rank had, and every attempt, restarts included, failed with torch's raw zip error. Every
    rank now falls back to step 10, alike, and the run ends at the uninterrupted run's
    parameters, bit for bit."""
    run = launched["damaged"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 20 is unreadable on some rank: falling back" in run.stdout
    assert "resumed from step 10" in run.stdout
    assert torch.equal(_out(run), whole[1])


def test_a_third_rank_resumes_the_two_ranks_checkpoint(
    launched: dict[str, Future[subprocess.CompletedProcess[str]]],
) -> None:
    """A state saved by 2 ranks was refused by 3 (another world size): a machine that came
    back could not join. The example now resumes at step 20 resized (``resize=True``), and
    the 3 replicas are identical after their first sync (tests/test_local_steps.py holds
    the law, 3 -> 2 -> 3)."""
    run = launched["resized"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from step 20, resized from 2 to 3 ranks" in run.stdout, run.stdout
    assert "replicas identical after the first sync" in run.stdout, run.stdout
