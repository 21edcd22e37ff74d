"""The Hugging Face Trainer: ``GradshareCallback`` on each path, run as a user runs the example.

Each path trains the tiny GPT-2 of ``examples/hf_trainer.py`` on 2 processes for 10 steps,
saving at step 5, then resumes from ``checkpoint-5`` with a fresh model and Trainer and must
end at the same parameters, bit for bit; every run checks its replicas are bit-identical and
that gradshare's metrics reached ``trainer.state.log_history``. The four paths (local twice:
without overlap and with ``overlap=2``, its checkpoint saved with a round in flight) run in one
launch (``tests/hf_fits.py``); one (``local``) also resumes from its ``checkpoint-5`` in new
processes, launched as a user launches the example.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from test_integrations import INSTALL, ROOT, TORCHRUN, WORLD, run_example, run_script

STEPS = ["--steps", "10"]


@pytest.fixture(scope="module", autouse=True)
def _torch_kernels() -> Iterator[None]:
    """The torch ops, bit for bit the kernels', without numba's compilation in every rank (for
    every process this module starts)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADSHARE_KERNELS", "0")
        yield


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """``tests/hf_fits.py``: the four paths, each straight through and resumed from
    ``checkpoint-5``, in one torchrun launch; what each printed, by path."""
    pytest.importorskip("transformers", reason=f"needs transformers: {INSTALL}")
    tmp = tmp_path_factory.mktemp("hf")
    run = run_script(ROOT / "tests" / "hf_fits.py", tmp, launcher=TORCHRUN)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return tmp, json.loads((tmp / "said.json").read_text())


@pytest.mark.parametrize("share", ["hook", "updates", "local", "local-overlap"])
def test_replicas_agree_and_the_resume_holds(share: str, fits: tuple[Path, dict[str, str]]) -> None:
    tmp, said = fits
    out = said[share]
    assert "resumed from step 5: the same parameters, bit for bit" in out, out
    assert "logged: bytes_sent, compression, density, threshold" in out
    assert out.strip().splitlines()[-1].startswith("step 10: rank 0 sent ")
    assert "x less)" in out
    folder = tmp / share / "out" / "checkpoint-5"
    assert sorted(p.name for p in folder.glob("gradshare-*")) == [
        *(f"gradshare-rank{r}.pt" for r in range(WORLD)), "gradshare-save.json"
    ]  # fmt: skip


def test_resume_in_new_processes(tmp_path: Path, fits: tuple[Path, dict[str, str]]) -> None:
    """Local steps carry the most per-rank state (each replica, its AdamW moments, the
    residuals and the global copy): a resume in new processes, run as a user runs the
    example, from the ``local`` path's ``checkpoint-5``, ends where that path went straight
    through."""
    straight = fits[0] / "local"
    resumed = run_example(
        "hf_trainer.py", "--share", "local", *STEPS, "--output-dir", straight / "out",
        "--resume", straight / "out" / "checkpoint-5", "--out", tmp_path / "r.pt",
    )  # fmt: skip
    assert "step 10: rank 0 sent" in resumed.stdout
    whole = torch.load(straight / "straight.pt", weights_only=True)
    assert torch.equal(whole, torch.load(tmp_path / "r.pt", weights_only=True))
