"""CPU time of ``LocalSteps``' sync work per round, by phase, on the 25.4M GPT of
``bench/exchange.py``, in ms and in copies of the model: what each rank spends besides its own
steps, this tree against earlier revisions in one run.

Run (from the repository root; the venv of ``make .venv/.installed``):

  python bench/local_steps_sync.py --before 9389794 --before 3f017b9 \\
      --out bench/results/local_steps_sync.json

One process per setting and revision (gloo, world 1, one torch and kernel thread, as
torchrun gives each of several ranks on a host) builds the model, plain SGD as the inner
optimizer and ``LocalSteps(model, sgd, sync_every=10, compact=True, ...)``; ``--before REV``
measures git revision REV's ``src`` (``git archive`` into a temporary folder, removed
afterwards) with this script's own measurement, through ``PYTHONPATH``. Each round moves every
parameter by a little noise, then takes 10 inner steps (no gradients: SGD leaves the
parameters, the sync hook runs). After one untimed round, ``--rounds`` rounds are timed; each
phase is a method of LocalSteps' parts (private, so this bench follows their names in each
layout, :data:`PHASES`), timed around its calls and given in ms per round of 10 steps:

* ``delta+encode``: Δ = global copy (+ carry) - replica into the residuals, with its
  finiteness count, and each parameter's encode (and, with ``compact``, its compact form):
  since the encode follows each parameter's Δ at once (97dcbbb), one method;
* ``exchange+decode``: the exchange (here with itself) and the decode of every message into
  the mean (on the exchange's thread with overlap); where the outer step takes the pieces as
  they are (plain SGD, e1a05e4), the exchange alone;
* ``outer+take``: the outer step on the global copy (with the decode of the pieces it takes,
  or plain SGD's step on their elements) and the replica taking it, wherever they run (the
  merge's too);
* ``merge``: with overlap, the merge τ steps after each sync (the outer step, the carry and
  the take; the lead with τ = ``sync_every``);
* ``sync``: the whole of each sync call (with overlap: up to the launch of the exchange);
* ``round``: everything the inner steps' hook ran in the round (syncs, merges, waits).

In the same process it times ``copy_`` of the model's parameters into tensors like them, the
same tensors every round (3 before the sync's step, where no exchange runs beside them; their
median), and gives every phase as a multiple of that copy: "copies per round". The VM's
speed drifts 10-20 % within minutes, so the revisions' processes alternate (every setting of
every revision, then again, ``--repeats`` times) and the table gives each figure's median over
the repeats; the machine's load average is kept with each process.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from _env import environment, free_port

ROOT = Path(__file__).resolve().parent.parent
COMMAND = (
    "python bench/local_steps_sync.py --before 9389794 --before 3f017b9 "
    "--out bench/results/local_steps_sync.json"
)
"""The command that made bench/results/local_steps_sync.json."""

SETTINGS = {
    "default": {"compact": True},
    "DL4J messages": {"compact": False},
    "fragments 5": {"fragments": 5, "compact": True},
    "overlap 2": {"overlap": 2, "compact": True},
    "overlap 10": {"overlap": 10, "compact": True},
    "fragments 5, overlap 2": {"fragments": 5, "overlap": 2, "compact": True},
}
"""LocalSteps' keywords per setting (``compact`` given: it became the default in 9389794)."""

PHASES = {
    "delta+encode": [
        "Fragment.pseudo_gradient_",
        "Fragment.encode",
        "Fragment.message",
        "LocalSteps._compute_delta",
        "LocalSteps._encode",
    ],
    "exchange+decode": [
        "Protocol.encoded_mean",
        "Protocol.dense_mean",
        "LocalSteps._encoded_mean",
        "LocalSteps._dense_mean",
    ],
    "outer+take": [
        "Fragment.outer_step",
        "Fragment.take_global",
        "LocalSteps._outer_step",
        "LocalSteps._take_global",
    ],
    "merge": [
        "Overlap.merge",
        "Overlap.merge_with_lead",
        "LocalSteps._merge_due",
        "LocalSteps._merge_with_lead",
    ],
    "sync": ["LocalSteps._sync"],
    "round": ["LocalSteps._tick"],
}
"""Per phase, the methods it times, in every layout of LocalSteps (those a revision lacks are
skipped): the package since 9389794 (Fragment, Protocol, Overlap, LocalSteps) and the one
module of 3f017b9 (LocalSteps alone). The methods of a phase run one after the other, never
one inside another, so their times add up."""
MODULES = [
    "gradshare.distributed.local_steps.core",
    "gradshare.distributed.local_steps.fragment",
    "gradshare.distributed.local_steps.protocol",
    "gradshare.distributed.local_steps.overlap",
    "gradshare.distributed.local_steps",
]
"""Where those classes live (a module a revision lacks is skipped)."""
COLUMNS = [*PHASES, "copy"]


def measure(setting: str, rounds: int) -> dict[str, object]:
    """In this process: ms per round of each phase of one setting, and of one copy."""
    os.environ.update(OMP_NUM_THREADS="1", GRADSHARE_NUM_THREADS="1")
    import importlib

    import torch
    import torch.distributed as dist

    import gradshare
    from _models import gpt

    spent = dict.fromkeys(PHASES, 0.0)
    wrapped: set[tuple[str, str]] = set()

    def timed(phase: str, owner: type, method: str) -> None:
        inner = owner.__dict__[method]

        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        setattr(owner, method, wrapper)

    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for phase, targets in PHASES.items():
            for target in targets:
                cls, method = target.split(".")
                owner = getattr(module, cls, None)
                if (
                    isinstance(owner, type)
                    and method in owner.__dict__
                    and (cls, method) not in wrapped
                ):
                    timed(phase, owner, method)
                    wrapped.add((cls, method))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    net = gpt("gpt-25m", 100)
    params = [p.detach() for p in net.parameters()]
    copies = [torch.empty_like(p) for p in params]
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    sync = gradshare.LocalSteps(net, opt, sync_every=10, **SETTINGS[setting])
    noise = torch.Generator().manual_seed(0)
    copy_ms: list[float] = []
    for r in range(rounds + 1):
        if r == 1:
            spent.update(dict.fromkeys(PHASES, 0.0))  # the first round is not timed
            copy_ms.clear()
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=noise), alpha=1e-3)
        for i in range(10):
            if i == 9:  # the copies: where no exchange runs beside them (with overlap, the
                for _ in range(3):  # round in flight ended long ago)
                    start = time.perf_counter()
                    for c, p in zip(copies, params, strict=True):
                        c.copy_(p)
                    copy_ms.append(1e3 * (time.perf_counter() - start))
            opt.step()
    sync.close()
    dist.destroy_process_group()
    out: dict[str, object] = {phase: 1e3 * s / rounds for phase, s in spent.items()}
    out["copy"] = statistics.median(copy_ms)
    out["timed"] = sorted(f"{c}.{m}" for c, m in wrapped)
    out["gradshare"] = gradshare.__file__
    return out


def _source(rev: str, into: Path) -> str:
    """Revision ``rev``'s ``src`` written under ``into``; its short hash."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", sha, "src"],
        check=True,
        capture_output=True,
    ).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    tar.unlink()
    return sha


def _this_tree() -> str:
    """This checkout's label: its short hash, ``+changes`` when ``src`` differs from it."""
    git = ["git", "-C", str(ROOT)]
    sha = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "src"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return f"{sha}+changes" if dirty else sha


def _child(src: Path, setting: str, rounds: int) -> dict[str, object]:
    """One process measuring ``setting`` with the gradshare of ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, __file__, "--one", setting, "--rounds", str(rounds)],
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    if not str(row["gradshare"]).startswith(str(src)):
        raise RuntimeError(f"expect gradshare from {src}, the child imported {row['gradshare']}")
    return row


def _medians(runs: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per column, the median over ``runs`` of its ms and of its copies (each process's ms
    over its own copy's)."""
    return {
        c: {
            "ms": statistics.median(float(r[c]) for r in runs),  # type: ignore[arg-type]
            "copies": statistics.median(
                float(r[c]) / float(r["copy"])  # type: ignore[arg-type]
                for r in runs
            ),
        }
        for c in COLUMNS
    }


def _table(setting: str, labels: list[str], medians: dict[str, dict[str, dict[str, float]]]) -> str:
    """One setting's phases: ms and copies per round for each revision."""
    head = f"{setting:24s}" + "".join(f"{lab:>22s}" for lab in labels)
    sub = f"{'':24s}" + "".join(f"{'ms':>12s}{'copies':>10s}" for _ in labels)
    lines = [head, sub]
    for phase in COLUMNS:
        cells = ""
        for lab in labels:
            m = medians[lab][phase]
            cells += f"{m['ms']:12.1f}{m['copies']:10.2f}"
        lines.append(f"{phase:24s}" + cells)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of 10 steps")
    parser.add_argument(
        "--repeats", type=int, default=3, help="processes per setting and revision, alternated"
    )
    parser.add_argument(
        "--before",
        action="append",
        default=[],
        metavar="REV",
        help="also measure this git revision's src (repeatable)",
    )
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=None, help="save the runs as JSON here")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one setting, printed as JSON
        print(json.dumps(measure(args.one, args.rounds)))
        return
    command = "python " + shlex.join(["bench/local_steps_sync.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="local_steps_sync.") as tmp:
        trees: dict[str, Path] = {}
        for i, rev in enumerate(args.before):
            folder = Path(tmp) / f"rev{i}"
            folder.mkdir()
            trees[_source(rev, folder)] = folder / "src"
        trees[_this_tree()] = ROOT / "src"
        labels = list(trees)
        print(
            f"ms and copies of the model per round of 10 steps, one thread, 25.4M GPT, "
            f"{args.rounds} rounds, median of {args.repeats} processes; load "
            f"{os.getloadavg()[0]:.2f}"
        )
        runs: list[dict[str, object]] = []
        for repeat in range(args.repeats):
            for setting in args.settings:
                for label, src in trees.items():
                    load = os.getloadavg()[0]
                    row = _child(src, setting, args.rounds)
                    runs.append(
                        {
                            "revision": label,
                            "setting": setting,
                            "repeat": repeat,
                            "load_start": load,
                            "load_end": os.getloadavg()[0],
                            **row,
                        }
                    )
                    print(
                        f"  repeat {repeat} {setting} {label}: round {row['round']:.1f} ms, "
                        f"copy {row['copy']:.1f} ms, load {load:.2f}",
                        flush=True,
                    )
    medians = {
        s: {
            lab: _medians([r for r in runs if r["setting"] == s and r["revision"] == lab])
            for lab in labels
        }
        for s in args.settings
    }
    for setting in args.settings:
        print()
        print(_table(setting, labels, medians[setting]))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": command,
                    "environment": environment(),
                    "revisions": labels,
                    "medians": medians,
                    "runs": runs,
                },
                indent=1,
            )
        )
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
