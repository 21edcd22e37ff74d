"""The Hugging Face Trainer: ``GradshareCallback`` on each path, run as a user runs the example.

Each path trains the tiny GPT-2 of ``examples/hf_trainer.py`` on 2 processes for 10 steps,
saving at step 5, then resumes from ``checkpoint-5`` with a fresh model and Trainer and must
end at the same parameters, bit for bit; every run checks its replicas are bit-identical and
that gradshare's metrics reached ``trainer.state.log_history``. The four paths (local twice:
without overlap and with ``overlap=2``, its checkpoint saved with a round in flight) and the
faults (rank files of another run, a skipped fp16 step, a run ending between syncs, a hung
rank) run in one launch (``tests/hf_fits.py``); one path (``local``) also resumes from its
``checkpoint-5`` in new processes, launched as a user launches the example.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from test_integrations import INSTALL, ROOT, TORCHRUN, WORLD, run_example, run_script

STEPS = ["--steps", "10"]
pytestmark = pytest.mark.torch_ops  # run_script's launches run the torch ops


@dataclass
class Fits:
    tmp: Path
    run: subprocess.CompletedProcess[str]

    def said(self, path: str) -> str:
        """What ``path`` printed (rank 0)."""
        return self._read("said.json", path)

    def fault(self, name: str, ranks: range = range(WORLD)) -> list[dict[str, Any]]:
        """The outcome of the fault ``name`` on each of ``ranks``."""
        return [self._read(f"rank{r}.json", name) for r in ranks]

    def _read(self, file: str, key: str) -> Any:
        """``key`` of a file of the launch; when it is not there, the launch's output, in the
        test's error."""
        path = self.tmp / file
        found = json.loads(path.read_text()) if path.exists() else {}
        assert key in found, (
            f"{key} not in {path}: " + self.run.stdout[-2000:] + self.run.stderr[-4000:]
        )
        return found[key]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Fits:
    """``tests/hf_fits.py``: the four paths, each straight through and resumed from
    ``checkpoint-5``, then the faults, in one torchrun launch; each test reads its own part
    (a fault that broke the launch fails its own test, not the others')."""
    pytest.importorskip("transformers", reason=f"needs transformers: {INSTALL}")
    tmp = tmp_path_factory.mktemp("hf")
    return Fits(tmp, run_script(ROOT / "tests" / "hf_fits.py", tmp, launcher=TORCHRUN))


@pytest.mark.parametrize("share", ["gradients", "updates", "local", "local-overlap"])
def test_replicas_agree_and_the_resume_holds(share: str, fits: Fits) -> None:
    out = fits.said(share)
    assert "resumed from step 5: the same parameters, bit for bit" in out, out
    assert "logged: bytes_sent, compression, density, threshold" in out
    assert out.strip().splitlines()[-1].startswith("step 10: rank 0 sent ")
    assert "x less)" in out
    folder = fits.tmp / share / "out" / "checkpoint-5"
    files = [f"gradshare-rank{r}.pt" for r in range(WORLD)]
    assert sorted(p.name for p in folder.glob("gradshare-*")) == files
    state = json.loads((folder / "trainer_state.json").read_text())
    for name in files:  # Trainer's own file holds the token of every rank file
        saved = torch.load(folder / name, weights_only=True)["token"]
        assert saved == {"id": state["stateful_callbacks"]["gradshare"]["id"], "step": 5}


def test_resume_in_new_processes(tmp_path: Path, fits: Fits) -> None:
    """Local steps carry the most per-rank state (each replica, its AdamW moments, the
    residuals and the global copy): a resume in new processes, run as a user runs the
    example, from the ``local`` path's ``checkpoint-5``, ends where that path went straight
    through. ``output_dir`` is another, empty folder: the callback looked for the rank files
    in ``<output_dir>/checkpoint-5``, not in the folder Trainer resumed from, and failed
    (with another run's ``checkpoint-5`` there, it loaded that run's files)."""
    straight = fits.tmp / "local"
    paths = ["--output-dir", tmp_path / "elsewhere", "--resume", straight / "out" / "checkpoint-5"]
    resumed = run_example(
        "hf_trainer.py", "--share", "local", *STEPS, *paths, "--out", tmp_path / "r.pt"
    )
    assert "step 10: rank 0 sent" in resumed.stdout
    whole = torch.load(straight / "straight.pt", weights_only=True)
    assert torch.equal(whole, torch.load(tmp_path / "r.pt", weights_only=True))


def test_rank_files_of_another_run_are_refused(fits: Fits) -> None:
    """Another run saved into the same ``output_dir`` and stopped after Trainer wrote
    ``checkpoint-5``, before the callback's ``on_save``: the rank files there were the first
    run's, and their token beside them agreed, so the resume went on, exit 0, with the first
    run's replicas and AdamW states under the second run's Trainer files. The token now lives
    in Trainer's ``trainer_state.json``: every rank refuses, naming both files."""
    folder = fits.tmp / "reused" / "out" / "checkpoint-5"
    for rank, reused in enumerate(fits.fault("reused")):
        assert "before on_save" in (reused["stopped"] or ""), reused
        resumed = reused["resumed"] or ""
        named = f"{folder / f'gradshare-rank{rank}.pt'} is from another save than {folder}"
        assert f"{named}/trainer_state.json: both are of step 5" in resumed, resumed


def test_a_step_the_scaler_skipped_still_syncs(fits: Fits) -> None:
    """accelerate's GradScaler (``fp16=True``) skips the step of a rank whose gradients
    overflowed; LocalSteps, counting steps, put that rank's syncs a step late in every round,
    so the ranks' collectives no longer matched (the launch broke). The callback now passes
    the scaler (``LocalSteps(grad_scaler=...)``); rank 1 overflows at step 3 of 7."""
    ranks = fits.fault("between")
    for rank in ranks:
        assert rank["error"] is None and rank["reached"] is True, ranks
    assert ranks[1]["scale"] < ranks[0]["scale"]  # rank 1's scaler skipped a step


def test_a_run_ending_between_syncs_ends_with_one_model(fits: Fits) -> None:
    """7 steps, a sync every 5: the replicas differed at the end (Trainer saves rank 0's,
    without the other ranks' last two steps); now they are averaged once, at the end."""
    ranks = fits.fault("between")
    assert [rank["replicas_equal"] for rank in ranks] == [True] * WORLD, ranks


def test_a_hung_rank_holds_the_other_for_the_timeout_at_most(fits: Fits) -> None:
    """Rank 0 stops after step 2, with no sync due: rank 1 waited in Trainer's per-step
    all-gather (``average_tokens_across_devices``) under the group's timeout, which
    ``TrainingArguments`` does not set on CPU (torch's 30 minutes), here until rank 0 left
    after 120 s; the callback now sets it to gradshare's ``timeout`` (5 s)."""
    [hung] = fits.fault("hang", range(1, 2))  # rank 0 left in it
    assert "Timed out waiting 5000ms" in (hung["error"] or ""), hung
    assert 4.5 <= hung["waited"] < 5 + 15, hung
