"""The torchrun examples, launched as a user would; a killed run resumes from checkpoints."""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from toys import Hostile
from world import selected

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun(script: str, *args: str | Path, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            *TORCHRUN,
            f"--max-restarts={restarts}",
            str(ROOT / "examples" / script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )


STEPS = ["--epochs", "1", "--steps", "20", "--save-every", "5"]


@pytest.fixture(scope="module")
def launched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Any]]]:
    """The torchrun launches of the selected tests below, all started at once (each spends
    seconds starting its agent and then its workers, so they overlap): the test waits for its
    own and asserts on it."""
    jobs: dict[str, Callable[[], Any]] = {}
    if selected(request, "test_elastic_restart_resumes_to_the_uninterrupted_result") or selected(
        request, "test_a_damaged_newest_checkpoint_falls_back_alike"
    ):
        out = tmp_path_factory.mktemp("whole") / "whole.pt"
        jobs["whole"] = partial(torchrun, "torchrun_shared.py", *STEPS, "--out", out)
        tmp = tmp_path_factory.mktemp("elastic")
        crash = [
            "--checkpoint-dir",
            tmp / "ckpt",
            "--crash-at-step",
            "12",
            "--out",
            tmp / "elastic.pt",
        ]
        jobs["elastic"] = partial(torchrun, "torchrun_shared.py", *STEPS, *crash, restarts=1)
    if selected(request, "test_ddp_hook_example_runs"):
        jobs["ddp_hook"] = partial(torchrun, "ddp_hook.py", "--epochs", "1")
    with ThreadPoolExecutor(max(1, len(jobs))) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def uninterrupted(launched: dict[str, Future[Any]]) -> torch.Tensor:
    """The parameters after 20 uninterrupted steps."""
    whole = launched["whole"].result()
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = whole.args[whole.args.index("--out") + 1]
    return torch.load(out, weights_only=True)


def test_a_damaged_newest_checkpoint_falls_back_alike(
    tmp_path: Path, launched: dict[str, Future[Any]], uninterrupted: torch.Tensor
) -> None:
    """On a copy of the elastic launch's checkpoints (steps 5 to 20), rank 1's newest file
    damaged (it could not be read and the run failed, though the checkpoint before was
    whole): every rank falls back to step 15, alike, and the run ends at the uninterrupted
    run's parameters, bit for bit."""
    run = launched["elastic"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run.args[run.args.index("--checkpoint-dir") + 1], ckpt)
    assert sorted(d.name for d in ckpt.iterdir()) == [f"step{s:06d}" for s in (5, 10, 15, 20)]
    (ckpt / "step000020" / "rank1.pt").write_bytes(b"PK\x03\x04 cut short")
    resumed = torchrun(
        "torchrun_shared.py", *STEPS, "--checkpoint-dir", ckpt, "--out", tmp_path / "resumed.pt"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 20 is unreadable on some rank: falling back" in resumed.stdout
    assert "resumed from step 15" in resumed.stdout
    assert torch.equal(torch.load(tmp_path / "resumed.pt", weights_only=True), uninterrupted)


def test_elastic_restart_resumes_to_the_uninterrupted_result(
    launched: dict[str, Future[Any]], uninterrupted: torch.Tensor
) -> None:
    """``torchrun --max-restarts=1``: the last rank dies at step 12 of the first attempt
    (killed, it leaves the checkpoints of steps 5 and 10), torchrun stops the other and
    starts both again, and they resume from the step-10 checkpoints to the uninterrupted
    run's parameters, bit for bit, in one launch."""
    run = launched["elastic"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from step 10" in run.stdout
    assert "exitcode: 1" in run.stderr or "Restarting" in run.stderr, run.stderr[-3000:]
    out = run.args[run.args.index("--out") + 1]
    assert torch.equal(torch.load(out, weights_only=True), uninterrupted)


def _example(script: str) -> ModuleType:
    """Import an example script as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / "examples" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoints_load_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint was read with torch.load's full unpickler whenever it was the default
    (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), so a planted rank file ran code on resume."""
    example = _example("rank_checkpoints.py")  # what the torchrun examples load with
    ran = tmp_path / "ran"
    (tmp_path / "step000005").mkdir()
    torch.save({"step": 5, "model": Hostile(ran)}, tmp_path / "step000005" / "rank0.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        example.load(tmp_path, 5, 0)
    assert not ran.exists()


def test_ddp_hook_example_runs(launched: dict[str, Future[Any]]) -> None:
    run = launched["ddp_hook"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "test accuracy" in run.stdout and "x less" in run.stdout
