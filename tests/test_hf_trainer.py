"""The Hugging Face Trainer: ``GradshareCallback`` on each path, run as a user runs the example.

Each path trains the tiny GPT-2 of ``examples/hf_trainer.py`` on 2 processes for 10 steps,
saving at step 5, then resumes from ``checkpoint-5`` with a fresh model and Trainer and must
end at the same parameters, bit for bit; every run checks its replicas are bit-identical and
that gradshare's metrics reached ``trainer.state.log_history``. One path (``local``) also
resumes from its ``checkpoint-5`` in new processes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from test_integrations import INSTALL, WORLD, run_example

STEPS = ["--steps", "10"]


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch ops, bit for bit the kernels', without numba's compilation in every rank."""
    monkeypatch.setenv("GRADSHARE_KERNELS", "0")


def _check_resume(tmp: Path, share: str) -> subprocess.CompletedProcess[str]:
    """Straight through, saving at step 5 (parameters into ``tmp/straight.pt``), then
    resumed from ``tmp/out/checkpoint-5`` in the same processes."""
    return run_example(
        "hf_trainer.py", "--share", share, *STEPS, "--check-resume", "5",
        "--output-dir", tmp / "out", "--out", tmp / "straight.pt",
    )  # fmt: skip


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The ``local`` path's run, shared by both tests below that need it."""
    pytest.importorskip("transformers", reason=f"needs transformers: {INSTALL}")
    tmp = tmp_path_factory.mktemp("local")
    return tmp, _check_resume(tmp, "local")


@pytest.mark.parametrize("share", ["hook", "updates", "local"])
def test_replicas_agree_and_the_resume_holds(
    tmp_path: Path, share: str, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("transformers", reason=f"needs transformers: {INSTALL}")
    if share == "local":
        tmp_path, run = request.getfixturevalue("local_run")
    else:
        run = _check_resume(tmp_path, share)
    assert "resumed from step 5: the same parameters, bit for bit" in run.stdout, run.stdout
    assert "logged: bytes_sent, compression, density, threshold" in run.stdout
    assert run.stdout.strip().splitlines()[-1].startswith("step 10: rank 0 sent ")
    assert "x less)" in run.stdout
    folder = tmp_path / "out" / "checkpoint-5"
    assert sorted(p.name for p in folder.glob("gradshare-*")) == [
        *(f"gradshare-rank{r}.pt" for r in range(WORLD)), "gradshare-save.json"
    ]  # fmt: skip


def test_resume_in_new_processes(tmp_path: Path, local_run: tuple[Path, Any]) -> None:
    """Local steps carry the most per-rank state (each replica, its AdamW moments, the
    residuals and the global copy): a resume in new processes, from the ``local`` run's
    ``checkpoint-5``, ends where that run went straight through."""
    straight, _ = local_run
    resumed = run_example(
        "hf_trainer.py", "--share", "local", *STEPS, "--output-dir", straight / "out",
        "--resume", straight / "out" / "checkpoint-5", "--out", tmp_path / "r.pt",
    )  # fmt: skip
    assert "step 10: rank 0 sent" in resumed.stdout
    whole = torch.load(straight / "straight.pt", weights_only=True)
    assert torch.equal(whole, torch.load(tmp_path / "r.pt", weights_only=True))
