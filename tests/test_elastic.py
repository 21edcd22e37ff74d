"""LocalSteps trains on when machines come and go (``elastic=``, torchft's quorum): replicas
in processes of their own on 127.0.0.1, a lighthouse in this process, no restart of the
survivors. Each test stays under 30 s."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradshare import codec

from elastic_replicas import TIMEOUT, events, start, wait
from world import _context

pytest.importorskip("torchft", reason="needs torchft: pip install -c constraints.txt -e '.[ft]'")


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> None:
    """The forkserver the replicas fork from, started once (it imports torch and
    gradshare: seconds), so that a test's clock starts with its replicas."""
    p = _context().Process(target=int)
    p.start()
    p.join()


@pytest.fixture
def lighthouse() -> Iterator[str]:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1000
    )
    yield server.address()
    server.shutdown()


def _synced(folder: Path, index: int) -> dict[int, int]:
    """Replica ``index``'s parameters' CRC-32 after each of its syncs, by step."""
    return {e["step"]: e["crc"] for e in events(folder, index) if e["event"] == "synced"}


def _done(folder: Path, index: int) -> dict[str, Any]:
    last = events(folder, index)[-1:]
    assert last and last[0]["event"] == "done", events(folder, index)
    return last[0]


def _when(folder: Path, index: int, step: int, deadline: float) -> None:
    """Wait until replica ``index`` has synced at ``step`` or later."""
    while time.monotonic() < deadline:
        if any(s >= step for s in _synced(folder, index)):
            return
        time.sleep(0.05)
    raise AssertionError(f"replica {index} did not reach step {step}: {events(folder, index)}")


def test_a_killed_rank_is_dropped_and_heals_when_restarted(lighthouse: str, tmp_path: Path) -> None:
    """3 ranks, a sync every 10 steps, 60 steps; rank 2 is SIGKILLed at step 25: ranks 0
    and 1 finish without a restart, identical after every sync. Rank 2, restarted once they
    passed step 30, heals from a live peer at the next sync and all three end bit-identical.
    Today a lost rank stops every other one at its next sync."""
    deadline = time.monotonic() + 28
    plan = {"steps": 60, "pace": 0.1}
    procs = [start(i, lighthouse, tmp_path, plan) for i in range(2)]
    procs.append(start(2, lighthouse, tmp_path, {**plan, "kill_at": 25}))
    _when(tmp_path, 0, 30, deadline)
    procs.append(start(2, lighthouse, tmp_path, plan))  # the same machine, back
    wait(procs, deadline)
    a, b, c = (_synced(tmp_path, i) for i in range(3))
    later = {s: crc for s, crc in a.items() if s > 25}
    assert set(later) == {30, 40, 50, 60}, a
    assert {s: crc for s, crc in b.items() if s > 25} == later  # the failed round's retry too
    back = [e for e in events(tmp_path, 2) if e["event"] == "joined"][-1]
    assert back["step"] >= 40 and back["crc"] == a[back["step"]]  # healed, at that sync
    assert c[60] == a[60]
    crcs = {_done(tmp_path, i)["crc"] for i in range(3)}
    assert len(crcs) == 1


def test_a_hung_rank_is_dropped_after_the_timeout(lighthouse: str, tmp_path: Path) -> None:
    """Rank 2 stops (SIGSTOP) inside the exchange of the sync at step 20, the header sent:
    the others wait for its pieces the timeout, then run the round again without it, and
    they go on identical. A rank stopped between syncs is dropped sooner (its heartbeats
    stop)."""
    deadline = time.monotonic() + 28
    plan = {"steps": 40}
    procs = [start(i, lighthouse, tmp_path, plan) for i in range(2)]
    hung = start(2, lighthouse, tmp_path, {**plan, "hang_in_round": 2})
    wait(procs, deadline)
    hung.kill()
    wait([hung], deadline + 1)
    a, b = _synced(tmp_path, 0), _synced(tmp_path, 1)
    later = {s: crc for s, crc in a.items() if s > 15}
    assert set(later) == {20, 30, 40} and {s: c for s, c in b.items() if s > 15} == later
    assert _done(tmp_path, 0)["crc"] == _done(tmp_path, 1)["crc"]
    waited = [e["seconds"] for e in events(tmp_path, 0) if e["event"] == "synced"]
    assert max(waited) >= TIMEOUT  # the sync at step 20 waited for it, then went on


def test_too_few_ranks_fail_clearly_within_the_timeout(lighthouse: str, tmp_path: Path) -> None:
    """A quorum of 3 that only 2 ranks ever join: each waits the timeout, then raises a
    clear error, instead of torchft's silent wait."""
    deadline = time.monotonic() + 28
    start_at = time.monotonic()
    plan = {"steps": 20, "min": 3, "join": TIMEOUT}
    procs = [start(i, lighthouse, tmp_path, plan) for i in range(2)]
    wait(procs, deadline)
    for i in range(2):
        last = events(tmp_path, i)[-1]
        assert last["event"] == "error", last
        assert "the quorum had 2 rank(s), fewer than the 3" in last["error"], last
    assert time.monotonic() - start_at < TIMEOUT + 20


def test_a_rank_that_leaves_sends_its_whole_residual(lighthouse: str, tmp_path: Path) -> None:
    """Rank 2 calls ``leave()`` at step 25: at its sync at step 30 it sends every residual
    whole (dense pieces: what went in, β·residual + Δ, is what went out) and leaves; the
    other two take it into their global copy and go on identical."""
    deadline = time.monotonic() + 28
    plan = {"steps": 50}
    procs = [start(i, lighthouse, tmp_path, plan) for i in range(2)]
    procs.append(start(2, lighthouse, tmp_path, {**plan, "leave_at": 25, "record": True}))
    wait(procs, deadline)
    left = _done(tmp_path, 2)
    assert left["left"] and left["step"] == 30
    a, b, c = (_synced(tmp_path, i) for i in range(3))
    later = {s: crc for s, crc in a.items() if s > 10}  # a late starter joins at step 10
    assert set(later) == {20, 30, 40, 50} and {s: x for s, x in b.items() if s > 10} == later
    assert c[30] == a[30]  # its last sync, alike on all three
    sent = torch.load(tmp_path / "replica2-leave.pt", weights_only=True)
    assert len(sent) == 4  # every parameter tensor of the toy model, whole
    for each in sent.values():  # the law: what it owed = what it sent + what it kept (0)
        decoded = codec.decode_(each["piece"], torch.zeros_like(each["owed"]))
        assert torch.equal(decoded, each["owed"]) and not each["after"].any()


def test_the_example_trains_on_with_elastic(lighthouse: str, tmp_path: Path) -> None:
    """examples/local_steps.py --elastic, two machines' processes as a user starts them (no
    torchrun): they end with the same parameters."""
    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "local_steps.py"
    args = ["--steps", "20", "--epochs", "1"]

    def start(i: int) -> subprocess.Popen[str]:
        command = [
            sys.executable,
            script,
            "--elastic",
            lighthouse,
            "--replica",
            str(i),
            *args,
            "--out",
            tmp_path / f"replica{i}.pt",
        ]
        return subprocess.Popen(
            command,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    procs = [start(i) for i in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "test accuracy" in outs[0]
    a, b = (torch.load(tmp_path / f"replica{i}.pt", weights_only=True) for i in range(2))
    assert torch.equal(a, b)


def test_no_lighthouse_and_bad_settings_fail_clearly() -> None:
    """No lighthouse at the address: an error naming it within the timeout, before any
    state is made. Settings elastic cannot honour are refused at construction."""
    from gradshare import Elastic, LocalSteps
    from gradshare.distributed.exchange import ExchangeError
    from gradshare.distributed.hosts import rendezvous_port

    from toys import toy_model

    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nobody = f"http://127.0.0.1:{rendezvous_port()}"
    start_at = time.monotonic()
    with pytest.raises(ExchangeError, match=f"no lighthouse answers at {nobody} within"):
        LocalSteps(model, opt, sync_every=10, elastic=Elastic(nobody), timeout=1)
    assert time.monotonic() - start_at < 5
    with pytest.raises(ValueError, match="no `overlap` and one fragment"):
        LocalSteps(model, opt, sync_every=10, overlap=True, elastic=Elastic(nobody))
    with pytest.raises(ValueError, match="min_replicas"):
        Elastic(nobody, min_replicas=0)
    with pytest.raises(TypeError, match="state_dict"):
        Elastic(nobody, heal={"lr": object()})
    assert not opt._optimizer_step_post_hooks  # nothing of the refused LocalSteps stays
