"""Kernel threads fit the process: a rank's share of the machine, torch's setting untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gradshare.codec import threads

HERE = Path(__file__).resolve().parent
TUNING = (
    "OMP_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_WAIT_POLICY",
    threads.ENV_VAR,
    "LOCAL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user who set no tuning variable."""
    env = {k: v for k, v in os.environ.items() if k not in TUNING}
    return {**env, **extra}


MODES = ("shared", "hook")
LAUNCHES = {
    "spawn": [sys.executable, str(HERE / "launch_threads.py"), "spawn"],
    "torchrun": [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(HERE / "launch_threads.py"),
        "torchrun",
    ],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], list[dict]]:
    """``reports(launch, mode)``: each rank's report. One launch per launcher runs both modes
    in turn (a launch is mostly process start), on the first test that asks for it."""
    done: dict[str, Path] = {}

    def get(launch: str, mode: str) -> list[dict]:
        if launch not in done:
            tmp = tmp_path_factory.mktemp(launch)
            cmd = [*LAUNCHES[launch], str(tmp), ",".join(MODES)]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_clean_env())
            assert run.returncode == 0, run.stderr[-3000:]
            done[launch] = tmp
        return [json.loads((done[launch] / f"rank{r}-{mode}.json").read_text()) for r in range(2)]

    return get


def _expected(report: dict) -> int:
    """The share: torch's count, capped by the CPUs over the 2 ranks of this host."""
    return max(1, min(report["torch_before"], report["cpus"] // 2))


class TestDefaultLaunch:
    """Two ranks on one host, launched with no thread variable set: each rank's kernels use
    its share of the CPUs (single-threaded on 2 cores, so numba's pool never starts) and
    torch's own thread count is what it was."""

    @pytest.mark.parametrize("mode", MODES)
    def test_mp_spawn(self, mode: str, reports: Callable[[str, str], list[dict]]) -> None:
        for report in reports("spawn", mode):
            assert report["kernel_threads"] == _expected(report), report
            assert report["torch_after"] == report["torch_before"], report
            assert report["pool_started"] == (report["kernel_threads"] > 1), report

    @pytest.mark.parametrize("mode", MODES)
    def test_torchrun(self, mode: str, reports: Callable[[str, str], list[dict]]) -> None:
        for report in reports("torchrun", mode):
            assert report["torch_before"] == 1  # torchrun sets OMP_NUM_THREADS=1
            assert report["kernel_threads"] == 1 and not report["pool_started"], report
            assert report["torch_after"] == 1, report


def test_explicit_count_runs_parallel_kernels_and_keeps_torch_setting() -> None:
    """numba's OpenMP layer raises the shared runtime's thread count as its pool starts (torch
    then reported 2 under OMP_NUM_THREADS=1); the count torch was given must survive."""
    script = (
        "import sys, torch, gradshare\n"
        "from gradshare import threads\n"
        "before = torch.get_num_threads()\n"
        "enc = gradshare.Encoder(gradshare.FixedThreshold(0.5))\n"
        "enc.encode(torch.linspace(-1, 1, 1 << 20), 0)\n"
        "pool = sys.modules['numba.np.ufunc.parallel']._is_initialized\n"
        "print(before, torch.get_num_threads(), threads.kernel_threads(), pool)\n"
    )
    env = _clean_env(OMP_NUM_THREADS="1", **{threads.ENV_VAR: "2"})
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "1", "2", "True"]


def test_share_of_one_never_starts_numba_pool() -> None:
    script = (
        "import sys, torch, gradshare\n"
        "enc = gradshare.Encoder(gradshare.FixedThreshold(0.5))\n"
        "enc.encode(torch.linspace(-1, 1, 1 << 20), 0)\n"
        "parallel = sys.modules.get('numba.np.ufunc.parallel')\n"
        "print(bool(parallel and parallel._is_initialized))\n"
    )
    env = _clean_env(**{threads.ENV_VAR: "1"})
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


class TestSettings:
    def test_rejects_bad_counts(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="num_threads"):
                threads.set_kernel_threads(bad)  # type: ignore[arg-type]
        monkeypatch.setenv(threads.ENV_VAR, "two")
        threads.set_kernel_threads(None)
        with pytest.raises(ValueError, match=threads.ENV_VAR):
            threads.kernel_threads()
        monkeypatch.delenv(threads.ENV_VAR)
        threads.set_kernel_threads(None)

    def test_explicit_wins_and_none_restores_the_share(self) -> None:
        auto = threads.kernel_threads()
        threads.set_kernel_threads(3)
        try:
            assert threads.kernel_threads() == 3
        finally:
            threads.set_kernel_threads(None)
        assert threads.kernel_threads() == auto
