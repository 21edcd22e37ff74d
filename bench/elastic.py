"""Machines come and go: restart everything from checkpoints (torchrun) against training on
without a restart (``LocalSteps(elastic=Elastic(...))``), on the 25M-parameter GPT.

Run (PYTHONPATH=src; ``pip install -c constraints.txt -e '.[ft]'`` for torchft; about 15
minutes on 2 cores):

  python bench/elastic.py --out bench/results/elastic.json
  python bench/elastic.py --report bench/results/elastic.json      (table + plot; runs nothing)

Four runs of ``--steps`` steps on ``--world`` ranks, one process each, ``OMP_NUM_THREADS=1``;
every run's LocalSteps has every default but ``sync_every``; AdamW and ``clip_grad_norm_(1)``;
rank r's batch of step s is drawn from a generator seeded by (r, s), so a run that repeats a
step repeats its batch:

* ``plain``: torchrun, plain LocalSteps, nothing fails (the step time and loss to compare);
* ``elastic``: ``LocalSteps(elastic=Elastic(...))`` under a torchft lighthouse in this
  process, nothing fails;
* ``restart`` (a): torchrun ``--max-restarts``, every rank saves its checkpoint every
  ``--save-every`` steps; the last rank is SIGKILLed at each step of ``--kills``, torchrun
  stops every worker and starts them all again (at once: a spare machine is ready), and they
  resume from the newest checkpoint;
* ``train-on`` (b): as ``elastic``; the last rank is SIGKILLed at the same steps and started
  again once the others are ``--down`` steps further; meanwhile they train on.

Reported per run: wall seconds; per failure the wall seconds it cost against the same run
without faults and the steps lost (rank-steps redone from a checkpoint, or the killed rank's
steps since its last sync: the round in flight); the time and bytes of a heal against loading
a checkpoint; the final validation loss against ``plain``; the median step time (between
syncs, and of a sync step) against ``plain``. The plot shows each run's steps against wall
time, the kills marked. The ranks share 2 cores here, so while a rank is down the others run
faster; the per-failure wall cost is measured against the run's own fault-free twin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

from _env import environment  # noqa: E402
from _models import adamw, gpt, lm_loss, text, text_batch, vocab_size  # noqa: E402

RUNS = ("plain", "elastic", "restart", "train-on")


# ---------------------------------------------------------------------- a worker


def _log(folder: Path, rank: int, **event: Any) -> None:
    with open(folder / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


def _batch(ids: torch.Tensor, a: argparse.Namespace, rank: int, step: int) -> Any:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    return text_batch(ids, a.batch, a.context, g)


@torch.no_grad()
def _validation_loss(model: torch.nn.Module, ids: torch.Tensor, context: int) -> float:
    g = torch.Generator().manual_seed(12345)
    model.eval()
    losses = [
        float(lm_loss(model(x), y)) for x, y in (text_batch(ids, 16, context, g) for _ in range(4))
    ]
    return statistics.mean(losses)


def _example() -> Any:
    """examples/local_steps.py as a module (bench/ has a local_steps.py of its own)."""
    import importlib.util

    path = HERE.parent / "examples" / "local_steps.py"
    spec = importlib.util.spec_from_file_location("example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(a: argparse.Namespace) -> None:
    """One rank of run ``a.run``: train, log every step, and die at the kill steps."""
    import gradshare

    torch.set_num_threads(1)
    folder = Path(a.folder)
    ids = text()
    split = int(ids.numel() * 0.9)
    train, val = ids[:split], ids[split:]
    model = gpt(a.size, vocab_size(ids), a.context, seed=0)
    inner = adamw(list(model.parameters()))
    elastic = a.run in ("elastic", "train-on")
    if elastic:
        rank, world = a.replica, a.world
        _log(folder, rank, event="start")
        config = gradshare.Elastic(
            a.lighthouse, replica_id=f"r{rank}", min_replicas=2, hostname="127.0.0.1"
        )
        sync = gradshare.LocalSteps(
            model, inner, sync_every=a.sync_every, elastic=config, timeout=a.timeout
        )
        t = sync._private.transport
        if sync._private.healed:
            _log(folder, rank, event="healed", step=sync.steps, seconds=t.seconds, bytes=t.bytes)
    else:
        from rank_checkpoints import latest_readable, save

        _example().init_distributed()  # torchrun's agent store, a prefix per attempt
        rank, world = dist.get_rank(), dist.get_world_size()
        _log(folder, rank, event="start")
        sync = gradshare.LocalSteps(model, inner, sync_every=a.sync_every, timeout=a.timeout)
        if a.run == "restart":
            start = time.monotonic()
            step, state = latest_readable(folder / "ckpt", rank, world)
            if state is not None:
                model.load_state_dict(state["model"])
                inner.load_state_dict(state["inner"])
                sync.load_state_dict(state["sync"])
                size = (folder / "ckpt" / f"step{step:06d}" / f"rank{rank}.pt").stat().st_size
                _log(
                    folder,
                    rank,
                    event="resumed",
                    step=step,
                    seconds=time.monotonic() - start,
                    bytes=size,
                )
    kills = set(a.kills) if a.run in ("restart", "train-on") and rank == world - 1 else set()
    while sync.steps < a.steps and not sync.left:
        step = sync.steps
        marker = folder / f"killed{step}"
        if step in kills and not marker.exists():
            marker.touch()
            last_sync = step // a.sync_every * a.sync_every
            _log(folder, rank, event="killed", step=step, last_sync=last_sync)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(train, a, rank, step)
        began = time.monotonic()
        loss = lm_loss(model(x), y)
        inner.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        syncs = sync.syncs
        inner.step()
        _log(
            folder,
            rank,
            event="step",
            step=sync.steps,
            seconds=time.monotonic() - began,
            synced=sync.syncs > syncs,
            loss=loss.item(),
        )
        if a.run == "restart" and sync.steps % a.save_every == 0:
            state = {
                "model": model.state_dict(),
                "inner": inner.state_dict(),
                "sync": sync.state_dict(),
            }
            save(folder / "ckpt", sync.steps, rank, state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    done = {
        "step": sync.steps,
        "crc": zlib.crc32(flat.numpy().tobytes()),
        "bytes_sent": sync.bytes_sent,
    }
    if rank == 0:
        done["val_loss"] = _validation_loss(model, val, a.context)
    _log(folder, rank, event="done", **done)
    sync.close()
    if not elastic:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the runs


def _worker_args(a: argparse.Namespace, run: str, folder: Path) -> list[str]:
    keep = [
        "--size",
        a.size,
        "--world",
        a.world,
        "--steps",
        a.steps,
        "--sync-every",
        a.sync_every,
        "--batch",
        a.batch,
        "--context",
        a.context,
        "--save-every",
        a.save_every,
        "--timeout",
        a.timeout,
        "--kills",
        *a.kills,
    ]
    return [str(HERE / "elastic.py"), "--worker", run, "--folder", str(folder), *map(str, keep)]


def _env() -> dict[str, str]:
    src = str(HERE.parent / "src")
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "RUST_LOG": "warn",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def events(folder: Path, rank: int) -> list[dict[str, Any]]:
    path = folder / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _torchrun(a: argparse.Namespace, run: str, folder: Path) -> None:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={a.world}",
        f"--max-restarts={len(a.kills)}",
    ]
    subprocess.run(
        [*launcher, *_worker_args(a, run, folder)],
        env=_env(),
        check=True,
        timeout=a.limit,
        stdout=subprocess.DEVNULL,
    )


def _train_on(a: argparse.Namespace, run: str, folder: Path) -> None:
    """The replicas under a lighthouse here; the killed one started again ``--down`` steps
    later."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=2000
    )
    args = [*_worker_args(a, run, folder), "--lighthouse", lighthouse.address()]

    def start(r: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, *args, "--replica", str(r)], env=_env(), stdout=subprocess.DEVNULL
        )

    procs = [start(r) for r in range(a.world)]
    deadline = time.monotonic() + a.limit
    last = a.world - 1
    try:
        while time.monotonic() < deadline:
            if procs[last].poll() is not None and procs[last].returncode == -signal.SIGKILL:
                killed = [e for e in events(folder, last) if e["event"] == "killed"][-1]
                mine = [e["step"] for e in events(folder, 0) if e["event"] == "step"]
                if mine and mine[-1] >= killed["step"] + a.down:
                    procs[last] = start(last)
            if all(p.poll() == 0 for p in procs):
                return
            if all(p.poll() == 0 for p in procs[:last]) and procs[last].poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # back too late: the
                    procs[last].wait(10)  # others are done, nobody is left to join
                return
            if any(p.poll() not in (None, 0, -signal.SIGKILL) for p in procs):
                raise RuntimeError(f"{run}: a replica failed, see {folder}")
            time.sleep(0.05)
        raise TimeoutError(f"{run}: not done within {a.limit} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()


def _summary(a: argparse.Namespace, run: str, folder: Path, wall: float) -> dict[str, Any]:
    every = {r: events(folder, r) for r in range(a.world)}
    steps = [e for e in every[0] if e["event"] == "step"]
    plain = [e["seconds"] for e in steps if not e["synced"]]
    synced = [e["seconds"] for e in steps if e["synced"]]
    done = [e for r in every for e in every[r] if e["event"] == "done"]
    kills = [e for e in every[a.world - 1] if e["event"] == "killed"]
    healed = [e for e in every[a.world - 1] if e["event"] == "healed" and e["step"] > 0]
    resumed = [e for e in every[0] if e["event"] == "resumed"]
    lost = 0
    if run == "restart":  # every rank redoes the steps since the checkpoint it resumed from
        lost = sum(k["step"] - r["step"] for k, r in zip(kills, resumed, strict=False)) * a.world
    elif run == "train-on":  # the killed rank's steps since its last sync
        lost = sum(k["step"] - k["last_sync"] for k in kills)
    zero = [e for e in done if "val_loss" in e]
    return {
        "run": run,
        "wall_s": wall,
        "failures": len(kills),
        "rank_steps_lost": lost,
        "step_ms": 1000 * statistics.median(plain) if plain else None,
        "sync_step_ms": 1000 * statistics.median(synced) if synced else None,
        "val_loss": zero[-1]["val_loss"] if zero else None,
        "identical_at_end": len({e["crc"] for e in done if e["step"] == a.steps}) == 1,
        "heal_s": [e["seconds"] for e in healed],
        "heal_bytes": [e["bytes"] for e in healed],
        "load_s": [e["seconds"] for e in resumed],
        "load_bytes": [e["bytes"] for e in resumed],
        "progress": [(e["t"], e["step"]) for e in steps],
        "kill_times": [k["t"] for k in kills],
    }


def run_all(a: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "environment": environment(),
        "config": {
            k: getattr(a, k)
            for k in (
                "size",
                "world",
                "steps",
                "sync_every",
                "batch",
                "context",
                "save_every",
                "kills",
                "down",
                "timeout",
            )
        },
    }
    results["command"] = "python bench/elastic.py " + " ".join(sys.argv[1:])
    work = Path(a.work)
    for run in a.runs:
        folder = work / run
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.mkdir(parents=True)
        start = time.monotonic()
        (_torchrun if run in ("plain", "restart") else _train_on)(a, run, folder)
        results[run] = _summary(a, run, folder, time.monotonic() - start)
        print(f"{run}: {results[run]['wall_s']:.1f} s", flush=True)
        a.out.write_text(json.dumps(results, indent=1))
    return results


# ---------------------------------------------------------------------- the report


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None


def report(path: Path) -> None:
    r = json.loads(path.read_text())
    base = {"restart": "plain", "train-on": "elastic"}
    ref = r.get("plain", {}).get("val_loss")
    head = (
        "run",
        "wall s",
        "failures",
        "wall s lost / failure",
        "rank-steps lost / failure",
        "step ms",
        "sync step ms",
        "heal or load s",
        "MB",
        "val loss",
        "vs plain",
        "identical",
    )
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        s = r.get(run)
        if s is None:
            continue
        n = s["failures"]
        twin = r.get(base.get(run, ""), {})
        cost = (s["wall_s"] - twin["wall_s"]) / n if n and twin else None
        moved_s = _mean(s["heal_s"]) or _mean(s["load_s"])
        moved_b = _mean(s["heal_bytes"]) or _mean(s["load_bytes"])
        cells = [
            run,
            f"{s['wall_s']:.1f}",
            str(n),
            "" if cost is None else f"{cost:.1f}",
            f"{s['rank_steps_lost'] / n:.1f}" if n else "",
            f"{s['step_ms']:.0f}",
            f"{s['sync_step_ms']:.0f}",
            "" if moved_s is None else f"{moved_s:.3f}",
            "" if moved_b is None else f"{moved_b / 1e6:.1f}",
            f"{s['val_loss']:.4f}",
            f"{s['val_loss'] / ref:.4f}x" if ref else "",
            str(s["identical_at_end"]),
        ]
        print("| " + " | ".join(cells) + " |")
    if "plain" in r and "elastic" in r:
        p, e = r["plain"], r["elastic"]
        steps = r["config"]["steps"]
        print(
            f"\nfault-free step time, elastic / plain: between syncs "
            f"{e['step_ms'] / p['step_ms']:.3f}x, sync steps "
            f"{e['sync_step_ms'] / p['sync_step_ms']:.3f}x, wall per step "
            f"{(e['wall_s'] / steps) / (p['wall_s'] / steps):.3f}x"
        )
    _plot(r, path.with_suffix(".png"))


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {
        "plain": "tab:gray",
        "elastic": "tab:blue",
        "restart": "tab:red",
        "train-on": "tab:green",
    }
    for run in RUNS:
        s = r.get(run)
        if not s or not s["progress"]:
            continue
        t0 = s["progress"][0][0]
        ax.plot(
            [t - t0 for t, _ in s["progress"]],
            [k for _, k in s["progress"]],
            label=run,
            color=colors[run],
        )
        for t in s["kill_times"]:
            ax.axvline(t - t0, color=colors[run], linestyle=":", linewidth=1)
    c = r["config"]
    ax.set_xlabel("wall seconds (rank 0)")
    ax.set_ylabel("steps done (rank 0)")
    ax.set_title(f"{c['size']}, {c['world']} ranks, a rank killed at steps {c['kills']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="gpt-25m")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--save-every", type=int, default=20, help="restart: checkpoint period")
    p.add_argument("--kills", type=int, nargs="*", default=[35, 75], help="steps a rank dies at")
    p.add_argument("--down", type=int, default=10, help="train-on: steps until it is back")
    p.add_argument("--timeout", type=float, default=30.0, help="LocalSteps' timeout, seconds")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    p.add_argument("--limit", type=float, default=1800, help="seconds a run may take")
    p.add_argument("--work", default="/tmp/gradshare-bench-elastic")
    p.add_argument("--out", type=Path, default=Path("bench/results/elastic.json"))
    p.add_argument("--report", type=Path, default=None, help="print this result file; run nothing")
    p.add_argument("--worker", choices=RUNS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        a.run = a.worker
        worker(a)
        return
    if a.report is not None:
        report(a.report)
        return
    run_all(a)
    report(a.out)


if __name__ == "__main__":
    main()
