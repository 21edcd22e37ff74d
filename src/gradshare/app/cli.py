"""The ``gradshare`` command.

* ``gradshare train``: the same model trained dense and with gradshare, side by side, with a
  table, metrics.csv, summary.json and report.png;
* ``gradshare bench codec|parallel|exchange|launch|convergence|workloads|multinode``: the
  benchmarks under ``bench/`` of the checkout that gradshare runs from (they do not ship in a
  wheel);
* ``gradshare inspect``: what the encoder sends for a synthetic update stream, step by step.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect as pyinspect
import itertools
import math
import runpy
import sys
import textwrap
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

import gradshare
from gradshare.app import train
from gradshare.app.report import compression_text
from gradshare.encoding.encoder import Encoder
from gradshare.encoding.residual import ResidualPostProcessor
from gradshare.encoding.threshold import ThresholdAlgorithm


class UsageError(Exception):
    """A bad option value: reported as one line and exit code 2."""


def parse_threshold(spec: str) -> ThresholdAlgorithm:
    """``adaptive:1e-3`` -> AdaptiveThreshold(1e-3); also ``fixed:T`` and ``target:DENSITY``."""
    try:
        return train.parse_threshold(spec)
    except ValueError as e:
        raise UsageError(f"bad --threshold: {e}") from None


def parse_clip(spec: str | None) -> ResidualPostProcessor | None:
    """``5:5`` -> ResidualClipping(5, 5); None -> no post-processing."""
    try:
        return train.parse_clip(spec)
    except ValueError as e:
        raise UsageError(f"bad --clip: {e}") from None


MAX_STD = 1e37
"""The largest ``inspect --std``: normal samples reach ~6 std within a million draws, and
float32 ends at 3.4e38, so the updates and the residual they build stay finite."""


def inspect(args: argparse.Namespace) -> None:
    """Encode a stream of normal(0, std) updates and print what each step sends."""
    if args.numel < 1 or args.steps < 1:
        raise UsageError(f"--numel and --steps must be >= 1, got {args.numel} and {args.steps}")
    if not (math.isfinite(args.std) and 0 < args.std <= MAX_STD):
        raise UsageError(
            f"--std must be > 0 and at most {MAX_STD:.1e}, got {args.std!r}: it scales every "
            "synthetic float32 update, whose values must stay finite"
        )
    if not 0 <= args.seed <= train.MAX_SEED:
        raise UsageError(f"--seed must be an integer from 0 to 2**63 - 1, got {args.seed}")
    torch.manual_seed(args.seed)
    enc = Encoder(parse_threshold(args.threshold), parse_clip(args.clip))
    print(
        f"gradshare inspect: {args.numel:,} float32 elements, updates ~ normal(0, {args.std:g}), "
        f"threshold {args.threshold}, {args.steps} steps"
    )
    head = (
        f"{'step':>4} {'format':<7} {'threshold':>10} {'entries':>10} {'density':>8} "
        f"{'bytes':>11} {'dense bytes':>12} {'ratio':>12} {'residual L2':>12}"
    )
    print(head)
    print("-" * len(head))
    sent = 0
    for step in range(args.steps):
        enc.encode(torch.randn(args.numel) * args.std, step)
        s = enc.last_stats
        assert s is not None
        sent += s.message_bytes
        print(
            f"{step:>4} {s.format or '-':<7} {s.threshold:>10.3e} {s.entries:>10,} "
            f"{s.density:>8.4f} {s.message_bytes:>11,} {s.dense_bytes:>12,} "
            f"{compression_text(s.dense_bytes, s.message_bytes):>12} {s.residual_norm:>12.4e}"
        )
    dense = args.numel * 4 * args.steps
    ratio = f"{compression_text(dense, sent)} less" if sent else "no step sent a message"
    print(f"\ntotal sent {sent:,} bytes vs {dense:,} dense: {ratio}")


def train_command(args: argparse.Namespace) -> None:
    """Train dense, then with gradshare; print the table; write the files."""
    try:
        config = train.TrainConfig(**{name: getattr(args, name) for name in _option_names()})
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    _check_writable(out)
    if args.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UsageError("--tensorboard needs TensorBoard: pip install tensorboard") from None
    print(
        f"gradshare train: digits, MLP({config.hidden}), {config.workers} workers "
        f"({config.mode}), {config.optimizer} lr {config.lr}, {config.epochs} epochs, "
        f"batch {config.batch_size}, threshold {config.threshold}, clip {config.clip}"
    )
    try:
        results = list(train.run(config, progress=not args.no_progress))
    except train.Diverged as e:
        raise UsageError(str(e)) from None
    from gradshare.app import report

    print()
    print(report.summary_table(results))
    paths = report.write_outputs(out, config, results)
    if args.tensorboard:
        report.write_tensorboard(out, results)
    print("\nwrote " + ", ".join(str(p) for p in paths))


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gradshare-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror or e}") from None


BENCHES = ("codec", "parallel", "exchange", "launch", "convergence", "workloads", "multinode")


def _checkout_root() -> Path:
    """The folder above ``src/gradshare``: the checkout when gradshare runs from its sources."""
    return Path(gradshare.__file__).resolve().parents[2]


def bench_script(name: str) -> Path:
    """``bench/<name>.py`` of the checkout that this gradshare's own sources belong to.

    Never a ``bench/`` of the current folder: whatever file lies there would be executed.
    """
    root = _checkout_root()
    script = root / "bench" / f"{name}.py"
    if not ((root / "pyproject.toml").is_file() and script.is_file()):
        raise UsageError(
            f"bench/{name}.py not found next to this gradshare's sources (in {root}): the "
            "benchmarks ship with the source checkout, not with an installed wheel; clone the "
            "repository and install it with `pip install -e .`"
        )
    return script


def bench_command(args: argparse.Namespace) -> None:
    """Run one of the benchmark scripts under the checkout's bench/ with the remaining arguments."""
    script = bench_script(args.name)
    sys.argv = [str(script), *args.rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (exit code 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _option_names() -> list[str]:
    """The fields of :class:`gradshare.app.train.TrainConfig` that are command-line options (all
    but ``runs``: the command runs both)."""
    return [f.name for f in dataclasses.fields(train.TrainConfig) if f.name != "runs"]


def _config_options() -> dict[str, dict[str, Any]]:
    """``add_argument`` keywords for each option field of :class:`gradshare.app.train.TrainConfig`:
    its default, its type (a ``Literal``'s values as choices) and its docstring as help."""
    hints = typing.get_type_hints(train.TrainConfig)
    docs = _field_docs(train.TrainConfig)
    names = _option_names()
    options = {}
    for f in dataclasses.fields(train.TrainConfig):
        if f.name not in names:
            continue
        kind = hints[f.name]
        shown = "" if f.default is None else " (default: %(default)s)"
        option: dict[str, Any] = {"default": f.default, "help": docs[f.name] + shown}
        if typing.get_origin(kind) is typing.Literal:
            option["choices"] = typing.get_args(kind)
        elif kind in (int, float):
            option["type"] = kind
        elif kind is bool:  # --name / --no-name
            option["action"] = argparse.BooleanOptionalAction
        options[f.name] = option
    return options


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of the class ``cls``, from its source."""
    tree = ast.parse(textwrap.dedent(pyinspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = str(after.value.value).strip().splitlines()[0]
    return docs


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradshare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train dense and with gradshare on digits, side by side")
    for name, option in _config_options().items():
        t.add_argument(f"--{name.replace('_', '-')}", **option)
    t.add_argument("--out", type=Path, default=None, help="output folder (default runs/<time>)")
    t.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=train_command)
    b = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHES))
    b.add_argument("name", choices=BENCHES, help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="its own options (see --help)")
    b.set_defaults(func=bench_command)
    p = sub.add_parser("inspect", help="encode a synthetic update stream and print each message")
    p.add_argument("--numel", type=int, default=1_000_000, help="elements of the update")
    p.add_argument("--std", type=float, default=1e-3, help="std of the normal updates")
    p.add_argument("--threshold", default="adaptive:1e-3", help="adaptive:T, fixed:T or target:S")
    p.add_argument("--clip", default=None, help="residual clipping MULTIPLE:FREQUENCY, e.g. 5:5")
    p.add_argument("--steps", type=int, default=10, help="how many updates to encode")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(func=inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except UsageError as e:
        print(f"gradshare {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gradshare {args.command}: interrupted; every worker was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
