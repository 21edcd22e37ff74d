"""The torchrun examples, launched as a user would; a killed run resumes from checkpoints."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from toys import Hostile

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun(script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*TORCHRUN, str(ROOT / "examples" / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    steps = ["--epochs", "1", "--steps", "20", "--save-every", "5"]
    whole = torchrun("torchrun_shared.py", *steps, "--out", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    crashed = torchrun(
        "torchrun_shared.py", *steps, "--checkpoint-dir", ckpt, "--crash-at-step", "12"
    )
    assert crashed.returncode != 0
    assert sorted(d.name for d in ckpt.iterdir()) == ["step000005", "step000010"]
    resumed = torchrun(
        "torchrun_shared.py", *steps, "--checkpoint-dir", ckpt, "--out", tmp_path / "resumed.pt"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 10" in resumed.stdout
    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert torch.equal(a, b)


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
    example = _example("torchrun_shared.py")
    ran = tmp_path / "ran"
    (tmp_path / "step000005").mkdir()
    torch.save({"step": 5, "model": Hostile(ran)}, tmp_path / "step000005" / "rank0.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        example.load(tmp_path, 5, 0)
    assert not ran.exists()


def test_ddp_hook_example_runs() -> None:
    run = torchrun("ddp_hook.py", "--epochs", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "test accuracy" in run.stdout and "x less" in run.stdout
