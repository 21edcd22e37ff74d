"""`gradshare train` and `gradshare bench`: the main job end to end, and bad options."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradshare.app import cli, report, train
from gradshare.app.cli import main
from gradshare.app.datasets import digits, digits_train_size
from gradshare.app.report import COLUMNS

from toys import Hostile

QUIET = ["--no-progress"]
ROOT = Path(__file__).resolve().parents[1]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


class TestTrain:
    def test_end_to_end_encoded_matches_dense(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Default model and data, 4 workers: files written, accuracy within 2 points, > 20x;
        local steps (processes, a sync every 5 steps) within 3 points at > 100x."""
        assert main(["train", "--out", str(tmp_path), *QUIET]) == 0
        out = capsys.readouterr().out
        assert "compression" in out and "gradshare" in out
        for name in ("metrics.csv", "summary.json", "report.png"):
            assert (tmp_path / name).stat().st_size > 0
        runs = _summary(tmp_path)["runs"]
        for fields in runs.values():
            assert {
                "accuracy",
                "seconds",
                "bytes_sent",
                "dense_bytes",
                "compression_ratio",
                "test_loss",
                "steps",
                "epochs",
            } <= set(fields)
        dense, encoded = runs["dense"], runs["gradshare"]
        assert dense["accuracy"] > 0.9
        assert abs(encoded["accuracy"] - dense["accuracy"]) <= 0.02, runs
        assert encoded["compression_ratio"] > 20
        local = runs["local-steps"]
        assert abs(local["accuracy"] - dense["accuracy"]) <= 0.03, runs
        assert local["compression_ratio"] > 100
        with (tmp_path / "metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == COLUMNS
        assert {r["worker"] for r in rows} == {"0", "1", "2", "3"}
        assert {r["format"] for r in rows if r["run"] == "gradshare"} <= {
            "sparse",
            "bitmap",
            "none",
        }
        sent = sum(int(r["message_bytes"]) for r in rows if r["run"] == "gradshare")
        assert sent == encoded["bytes_sent"]
        local_rows = [r for r in rows if r["run"] == "local-steps"]
        syncs = {r["step"] for r in local_rows if r["format"] == "sync"}
        assert syncs == {str(s) for s in range(4, 1 + max(int(r["step"]) for r in local_rows), 5)}
        assert all(int(r["message_bytes"]) == 0 for r in local_rows if r["format"] == "local")

    def test_same_seed_same_numbers(self, tmp_path: Path) -> None:
        argv = "train --epochs 1 --clip 5:5 --optimizer adam --lr 0.01 --local-steps 0".split()
        for name in ("a", "b"):
            assert main([*argv, "--out", str(tmp_path / name), *QUIET]) == 0
        a, b = (_summary(tmp_path / n)["runs"] for n in ("a", "b"))
        for run in ("dense", "gradshare"):
            a[run].pop("seconds"), b[run].pop("seconds")
        assert a == b
        assert (tmp_path / "a" / "metrics.csv").read_text() == (
            tmp_path / "b" / "metrics.csv"
        ).read_text()

    def test_distributed_mode(self, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
        """Every rank printed torch's "Converting a tensor with requires_grad=True to a
        scalar" warning: the loss was recorded with ``float(loss)``."""
        argv = "train --mode distributed --workers 2 --epochs 2 --local-steps 0".split()
        assert main([*argv, "--out", str(tmp_path), *QUIET]) == 0
        assert "requires_grad" not in capfd.readouterr().err
        runs = _summary(tmp_path)["runs"]
        assert runs["gradshare"]["bytes_sent"] < runs["dense"]["bytes_sent"] / 5
        assert runs["gradshare"]["accuracy"] > 0.5


def test_command_line_is_built_from_train_config() -> None:
    """The CLI repeated TrainConfig's defaults by hand; now each field is its option, with
    the field's default, type, choices and docstring."""
    args = cli.build_parser().parse_args(["train"])
    fields = [f.name for f in dataclasses.fields(train.TrainConfig) if f.name != "runs"]
    assert train.TrainConfig(**{name: getattr(args, name) for name in fields}) == (
        train.TrainConfig()
    )
    options = cli._config_options()
    assert list(options) == fields
    assert options["mode"]["choices"] == ("parallel", "distributed")
    assert options["optimizer"]["choices"] == tuple(train.OPTIMIZERS)
    assert options["lr"]["help"].startswith("Learning rate of each worker.")
    assert options["batch_size"]["type"] is int
    assert cli.build_parser().parse_args(["train", "--compact"]).compact is True


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--workers", "-2"], "--workers"),
        (["--workers", "two"], "--workers"),
        (["--threshold", "median:1e-3"], "unknown threshold kind"),
        (["--threshold", "fixed:abc"], "not a number"),
        (["--clip", "x:y"], "--clip"),
        (["--mode", "cluster"], "--mode"),
        (["--optimizer", "lion"], "--optimizer"),
        (["--lr", "0"], "--lr"),
        (["--lr", "inf"], "--lr must be finite"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "-inf"], "--lr"),
        (["--epochs", "0"], "--epochs"),
        (["--device", "tpu"], "--device"),
        (["--local-steps", "-1"], "--local-steps"),
        (["--density", "0.1"], "--density"),
        (["--density", "0"], "--density"),
        (["--threshold", "fixed:1e-46"], "not a finite float32"),  # 0 in float32
        (["--threshold", "fixed:1e39"], "not a finite float32"),  # inf in float32
        (["--threshold", "adaptive:1e39"], "not a finite float32"),
        (["--seed", "18446744073709551616"], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--local-steps", "100000"], "--local-steps 100000 is more than the 80 steps"),
        (["--mode", "distributed", "--batch-size", "450"], "3 minibatches, fewer than the 4"),
        (["--lr", "1e30", "--workers", "1", "--epochs", "1"], "the dense run diverged"),
        (["--out", "/etc/hostname/run"], "cannot write to --out"),
    ],
)
def test_bad_option_exits_2_with_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = [] if "--out" in argv else ["--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["train", *argv, *out, *QUIET]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())  # nothing written


class TestSomethingIsSent:
    """A setting under which a run sends nothing is refused before training: `--local-steps
    100000` exited 0 after a full run with 0 bytes sent, chance accuracy and a compression
    of "infx". (`--density 1e-5` sent nothing too; every tensor now sends 2 entries a sync
    at least, QuantileThreshold's floor.)"""

    def test_local_steps_up_to_the_runs_steps(self) -> None:
        """8 epochs of 43 minibatches (1348 images, 32 each) in rounds of 4: 80 steps."""
        assert digits_train_size() == len(digits().y_train) == 1348
        assert train.TrainConfig(local_steps=80).local_steps == 80
        with pytest.raises(ValueError, match="expect --local-steps from 1 to 80 "):
            train.TrainConfig(local_steps=81)
        with pytest.raises(ValueError, match="expect --local-steps from 1 to 40 "):
            train.TrainConfig(local_steps=41, epochs=4)
        assert train.TrainConfig(local_steps=0, epochs=1).epochs == 1  # no local-steps run

    def test_a_minibatch_for_every_process(self) -> None:
        """Processes deal whole rounds: 1348 images in minibatches of 450 are 3, no round of
        4 (every process run took no step); of 449, 4."""
        config = train.TrainConfig(mode="distributed", batch_size=449, local_steps=0)
        assert config.batch_size == 449
        with pytest.raises(ValueError, match="expect --batch-size 449 or less, or fewer"):
            train.TrainConfig(mode="distributed", batch_size=450, local_steps=0)
        with pytest.raises(ValueError, match="3 minibatches, fewer than the 4 workers"):
            train.TrainConfig(batch_size=450)  # the local-steps run is of processes
        assert train.TrainConfig(batch_size=450, local_steps=0).batch_size == 450  # threads

    def test_nothing_sent_is_said_in_words(self) -> None:
        """A run that sent nothing (a threshold no update crosses) had a compression of
        "infx" in the table and Infinity (not JSON) in summary.json."""
        rows = [{"message_bytes": 0, "dense_bytes": 4000, "epoch": 0, "step": 0}]
        result = train.RunResult("gradshare", rows, [{"epoch": 0, "loss": 2.3, "accuracy": 0.1}])
        assert result.compression_ratio is None and result.summary()["compression_ratio"] is None
        line = report.summary_table([result]).splitlines()[-1]
        assert line.endswith(" 0          4,000 nothing sent") and "inf" not in line
        assert report.compression_text(4000, 32) == "125.0x"


def test_distributed_results_load_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' result files were read with torch.load's full unpickler whenever it was the
    default (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), so a planted file ran code."""
    ran = tmp_path / "ran"

    class Finished:
        processes = ()

        def join(self) -> bool:
            return True

    def start(fn: object, args: tuple, nprocs: int, **_: object) -> Finished:  # tampered files
        for rank in range(nprocs):
            torch.save({"epochs": [], "rows": [Hostile(ran)]}, Path(args[-1]) / f"rank{rank}.pt")
        return Finished()

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    config = train.TrainConfig(mode="distributed", workers=2, epochs=1)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        train.run_one(config, "gradshare", progress=False)
    assert not ran.exists()


def test_bench_runs_the_checkouts_script_not_the_current_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gradshare bench codec` ran ./bench/codec.py first, so any file there was executed."""
    hostile = tmp_path / "bench" / "codec.py"
    hostile.parent.mkdir()
    hostile.write_text("raise SystemExit('hostile bench/codec.py ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    ran: list[tuple[Path, list[str]]] = []
    monkeypatch.setattr(
        cli.runpy, "run_path", lambda path, run_name: ran.append((Path(path), sys.argv[1:]))
    )
    assert main(["bench", "codec", "--sizes", "1000"]) == 0
    assert ran == [(ROOT / "bench" / "codec.py", ["--sizes", "1000"])]


def test_bench_without_a_checkout_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed wheel has no bench/ beside it: say so in one line, run nothing."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "codec.py").write_text("raise SystemExit('ran')\n")
    monkeypatch.setattr(cli, "_checkout_root", lambda: tmp_path / "lib")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "codec"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "installed wheel" in err and "bench/codec.py not found" in err


def test_bench_unknown_name_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nosuch"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _alive(pids: list[int]) -> list[str]:
    """Each process of ``pids`` and its children that still exists: pid, state, command line."""
    family = list(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            family += _children(pid)
    seen: list[str] = []
    for k in dict.fromkeys(family):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{k}/status").read_text().splitlines()
            state = next(line for line in status if line.startswith("State"))
            cmd = Path(f"/proc/{k}/cmdline").read_text().replace("\0", " ")[:120]
            seen.append(f"{k} {state} {cmd}")
    return seen


def test_ctrl_c_to_the_parent_stops_every_rank(tmp_path: Path) -> None:
    """SIGINT to `gradshare train --mode distributed` alone left it waiting forever on ranks
    that kept training; now it stops them, says so in one line and exits 130."""
    train = "train --mode distributed --workers 2 --epochs 200 --local-steps 0".split()
    cmd = [sys.executable, "-m", "gradshare.app.cli", *train, "--out", str(tmp_path), *QUIET]
    # A background job of a non-interactive shell (`make test &`) starts with SIGINT ignored,
    # and so would the command, whose Python then installs no KeyboardInterrupt: give it
    # SIGINT as a terminal does (a handler here is reset to the default in the child).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 2:  # the spawner plus 2 ranks
            time.sleep(0.5)
            ranks = [
                k
                for k in _children(proc.pid)
                if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()
            ]
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(3)  # training
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit 30 s after SIGINT; still there: {_alive([proc.pid, *ranks])}")
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    for k in ranks:
        assert not Path(f"/proc/{k}").exists() or "zombie" in Path(f"/proc/{k}/status").read_text()
