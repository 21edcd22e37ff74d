"""`gradshare inspect`: runs, prints a row per step, and turns bad values into exit code 2."""

from __future__ import annotations

import pytest

from gradshare.app.cli import main


def test_inspect_prints_each_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--numel", "20000", "--steps", "3", "--threshold", "fixed:1e-2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 3
    assert "total sent" in out


def test_inspect_says_when_nothing_is_sent(capsys: pytest.CaptureFixture[str]) -> None:
    """A step that sent no message printed a ratio of "infx", and the total "12000.0x less"
    of 0 bytes sent."""
    argv = ["inspect", "--numel", "1000", "--steps", "2", "--threshold", "fixed:10"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 2 and all(" 0        4,000 nothing sent " in row for row in rows)
    assert out.rstrip().endswith("total sent 0 bytes vs 8,000 dense: no step sent a message")
    assert "inf" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--threshold", "nope:1"],
        ["inspect", "--threshold", "fixed:-1"],
        ["inspect", "--clip", "0.5:5"],
        ["inspect", "--numel", "-3"],
        ["inspect", "--std", "0"],
        ["inspect", "--std", "inf"],
        ["inspect", "--std=-inf"],
        ["inspect", "--std", "nan"],
        ["inspect", "--std", "1e38"],  # normal(0, 1e38) overflows float32
        ["inspect", "--seed", "18446744073709551616"],
    ],
)
def test_bad_values_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradshare inspect: error:") and "\n" not in err
