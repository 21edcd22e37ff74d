"""Replicas of ``LocalSteps(elastic=...)`` for tests/test_elastic.py: each a process of its
own (a torchft replica group of one), no ``init_process_group``, a lighthouse in the test.

:func:`run` starts ``replicas`` processes of :func:`replica` and returns what each reported;
a replica appends one JSON line per event to its log (``synced`` with its step, sync count
and the CRC-32 of its parameters after each sync; ``done``; ``error``), which the test reads
while they run (to restart a replica once another has reached a step).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from toys import toy_batches, toy_model
from world import _context

TIMEOUT = 6.0
"""LocalSteps' timeout in the replicas: a lost rank is found within it."""


def _crc(model: torch.nn.Module) -> int:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return zlib.crc32(flat.numpy().tobytes())


def _log(path: Path, **event: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def replica(index: int, lighthouse: str, folder: str, plan: dict[str, Any]) -> None:
    """Train ``plan["steps"]`` steps with a sync every 10; on the way, per ``plan``: die
    (``kill_at``), stop (``hang_at``, SIGSTOP) or leave (``leave_at``) at a step, or stop
    inside a sync's exchange (``hang_in_round``)."""
    from gradshare import Elastic, LocalSteps

    torch.set_num_threads(1)
    log = Path(folder) / f"replica{index}.log"
    _log(log, event="started", at=time.time())
    try:
        model = toy_model(seed=index)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        elastic = Elastic(
            lighthouse,
            replica_id=f"r{index}",
            min_replicas=plan.get("min", 2),
            join_timeout=plan.get("join", 20),
            hostname="127.0.0.1",
        )
        sync = LocalSteps(model, inner, sync_every=10, elastic=elastic, timeout=TIMEOUT)
        _log(
            log,
            event="joined",
            step=sync.steps,
            syncs=sync.syncs,
            crc=_crc(model),
            world=sync._protocol.world,
            healed=sync._private.healed,
        )
        batches = toy_batches(plan["steps"], seed=100 + index)
        recorded: dict[str, Any] = {}
        if plan.get("record") is not None:
            _record_leave(sync, recorded)
        if plan.get("hang_in_round") is not None:
            _hang_in_round(sync, plan["hang_in_round"])
        while sync.steps < plan["steps"] and not sync.left:
            step = sync.steps
            if step == plan.get("kill_at"):
                os.kill(os.getpid(), signal.SIGKILL)
            if step == plan.get("hang_at"):
                os.kill(os.getpid(), signal.SIGSTOP)
            if step == plan.get("leave_at"):
                elastic.leave()
            time.sleep(plan.get("pace", 0))
            x, y = batches[step]
            inner.zero_grad()
            F.cross_entropy(model(x), y).backward()
            syncs, began = sync.syncs, time.monotonic()
            inner.step()
            if sync.syncs > syncs:
                _log(
                    log,
                    event="synced",
                    step=sync.steps,
                    syncs=sync.syncs,
                    crc=_crc(model),
                    seconds=time.monotonic() - began,
                )
        if recorded:
            torch.save(recorded, Path(folder) / f"replica{index}-leave.pt")
        _log(
            log,
            event="done",
            step=sync.steps,
            syncs=sync.syncs,
            crc=_crc(model),
            left=sync.left,
            bytes=sync.bytes_sent,
        )
        sync.close()
    except BaseException as e:
        _log(log, event="error", error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    os._exit(0)


def _hang_in_round(sync: Any, round: int) -> None:
    """Stop this process (SIGSTOP) inside the exchange of sync round ``round``: after the
    header went out, while the others wait for its pieces."""
    protocol = type(sync._protocol)  # this process's own class (slots: no instance patch)
    exchange = protocol.encoded_mean

    def stopping(*args: Any, **kwargs: Any) -> Any:
        if sync.syncs == round:
            os.kill(os.getpid(), signal.SIGSTOP)
        return exchange(*args, **kwargs)

    protocol.encoded_mean = stopping


def _record_leave(sync: Any, into: dict[str, Any]) -> None:
    """Keep, for each encoder's whole send (a leaving rank's), what it owed (β·residual + Δ,
    in its residual then), the dense piece it sent and its residual after."""
    for i, enc in enumerate(sync.encoders):
        whole = enc.encode_whole

        def recorded(
            update: Any, iteration: int, enc: Any = enc, whole: Any = whole, i: int = i
        ) -> Any:
            owed = enc.residual.clone()
            message = whole(update, iteration)
            into[i] = {"owed": owed, "piece": message.clone(), "after": enc.residual.clone()}
            return message

        enc.encode_whole = recorded


def start(index: int, lighthouse: str, folder: Path, plan: dict[str, Any]) -> Any:
    """Replica ``index`` in a process of its own, forked from the tests' forkserver (which
    has imported torch and gradshare)."""
    p = _context().Process(target=replica, args=(index, lighthouse, str(folder), plan), daemon=True)
    p.start()
    return p


def events(folder: Path, index: int) -> list[dict[str, Any]]:
    path = folder / f"replica{index}.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait(procs: list[Any], deadline: float) -> None:
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
