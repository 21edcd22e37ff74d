"""Resume and agreement: ranks that disagree on settings or iterations raise one clear error
on every rank, and a resumed run continues bit for bit (its LR schedule included).

The contract: settings that change the sum or the wire are compared at construction (the DDP
hook: at its first exchange) and a difference raises the SAME ``ValueError`` on every rank,
naming each setting and each rank's value; ranks at different iterations raise the same
``ExchangeError`` naming each rank's iteration, before anything is averaged.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradshare import (
    ExchangeError,
    FixedThreshold,
    LocalSteps,
    SharedOptimizer,
    register_threshold_hook,
)
from gradshare.distributed import exchange

from toys import flat, toy_batches, toy_model
from world import spawn

# ---------------------------------------------------------------------- resume with a schedule


def _schedule(rank: int, world: int, tmp: str, phase: str) -> torch.Tensor:
    """20 steps of SGD with momentum under a StepLR built on the wrapper: straight
    (``"straight"``), the first 10 then a save (``"save"``), or a resume then the last 10."""
    model = toy_model()
    opt = SharedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), threshold=FixedThreshold(1e-3)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    batches = toy_batches(20 * world)[rank::world]
    path = Path(tmp) / f"rank{rank}.pt"
    if phase == "resume":
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
    span = {"straight": batches, "save": batches[:10], "resume": batches[10:]}[phase]
    for x, y in span:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    if phase == "save":
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
            path,
        )
    return flat(model)


def test_lr_schedule_survives_a_resume(tmp_path: Path) -> None:
    """torch's load_state_dict puts a new `param_groups` list on the wrapped optimizer: the
    wrapper kept the old one, so after a resume the scheduler's learning rates never reached
    the step."""
    straight = [r.get() for r in spawn(_schedule, 2, str(tmp_path), "straight")]
    [r.get() for r in spawn(_schedule, 2, str(tmp_path), "save")]
    resumed = [r.get() for r in spawn(_schedule, 2, str(tmp_path), "resume")]  # new processes
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- settings that differ


def _shared_cases(rank: int, world: int) -> dict[str, str]:
    """One world, one case after the other: a refused construction leaves the ranks in step."""
    out = {}
    cases = {
        "reduction": dict(reduction="sum" if rank == 0 else "mean"),
        "reduction, hierarchical": dict(reduction="sum" if rank == 0 else "mean", hierarchical=2),
        "dense": dict(dense=rank == 0),
        "hierarchical": dict(hierarchical=2 if rank == 0 else False),
        "threshold": dict(threshold=FixedThreshold(1e-3 if rank == 0 else 1e-2), hierarchical=2),
    }
    for name, kw in cases.items():
        model = toy_model()
        try:
            SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), timeout=20, **kw)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_shared_optimizer_settings_that_differ_raise_alike() -> None:
    """Reduction "sum" on one rank and "mean" on the other drifted apart silently (flat and
    hierarchical); `dense` or `hierarchical` differing aborted a rank in gloo or waited a full
    timeout; a node's ranks with different thresholds kept different node residuals."""
    results = [r.get() for r in spawn(_shared_cases, 2)]
    assert results[0] == results[1]
    got = results[0]
    assert "`reduction` 'sum' on rank 0, 'mean' on rank 1" in got["reduction"]
    assert "`reduction` 'sum' on rank 0, 'mean' on rank 1" in got["reduction, hierarchical"]
    assert "`dense` True on rank 0, False on rank 1" in got["dense"]
    assert "`hierarchical` 2 on rank 0, False on rank 1" in got["hierarchical"]
    assert "`threshold` FixedThreshold(threshold=0.001) on rank 0" in got["threshold"]


def _hook_cases(rank: int, world: int) -> dict[str, str]:
    out = {}
    cases = {
        "reduction": dict(reduction="sum" if rank == 0 else "mean"),
        "start_iter": dict(start_iter=0 if rank == 0 else 1),
        "momentum": dict(momentum=0.9 if rank == 0 else 0.0),
    }
    for name, kw in cases.items():
        model = DistributedDataParallel(toy_model())
        register_threshold_hook(model, timeout=20, **kw)
        x, y = toy_batches(1)[0]
        try:
            F.cross_entropy(model(x), y).backward()
            out[name] = "no error"
        except ValueError as e:  # the original type, not DDP's RuntimeError
            out[name] = str(e)
    return out


def test_hook_settings_that_differ_raise_alike_from_backward() -> None:
    """A `start_iter` that differs left one rank all-reducing while the other all-gathered."""
    results = [r.get() for r in spawn(_hook_cases, 2)]
    assert results[0] == results[1]
    got = results[0]
    assert "`reduction` 'sum' on rank 0, 'mean' on rank 1" in got["reduction"]
    assert "`start_iter` 0 on rank 0, 1 on rank 1" in got["start_iter"]
    assert "`momentum` 0.9 on rank 0, 0.0 on rank 1" in got["momentum"]


def _local_steps_case(rank: int, world: int) -> str:
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        LocalSteps(
            model,
            inner,
            sync_every=2,
            timeout=20,
            threshold=FixedThreshold(1e-3 if rank == 0 else 2e-3),
        )
    except ValueError as e:
        return str(e)
    return "no error"


def test_local_steps_settings_that_differ_show_readable_values() -> None:
    """LocalSteps compared a CRC of its threshold: the error showed two numbers."""
    results = [r.get() for r in spawn(_local_steps_case, 2)]
    assert results[0] == results[1]
    assert "FixedThreshold(threshold=0.001)" in results[0] and "on rank 1" in results[0]


# ---------------------------------------------------------------------- iterations that differ


def _stale(rank: int, world: int, front: str) -> str:
    """Rank 1 resumes from a stale checkpoint (its iteration one behind rank 0's)."""
    model = toy_model()
    batches = toy_batches(4 * world)[rank::world]
    if front == "shared":
        opt = SharedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), timeout=20, threshold=FixedThreshold(1e-3)
        )
    elif front == "dense":
        opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), timeout=20, dense=True)
    else:
        model = DistributedDataParallel(model)
        state = register_threshold_hook(model, timeout=20, start_iter=2 if front == "exact" else 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stale = None
    for step, (x, y) in enumerate(batches):
        if step == 1:
            stale = (opt if front in ("shared", "dense") else state).state_dict()
        if step == 2 and rank == 1:
            (opt if front in ("shared", "dense") else state).load_state_dict(stale)
        opt.zero_grad()
        try:
            F.cross_entropy(model(x), y).backward()
            opt.step()
        except ExchangeError as e:
            return str(e)
    return "no error"


@pytest.mark.parametrize("front", ["shared", "dense", "hook", "exact"])
def test_ranks_at_different_iterations_raise_alike(front: str) -> None:
    """A stale per-rank checkpoint: its rank's step was averaged with the others' (or, for
    the hook, one rank all-reduced while the other all-gathered)."""
    results = [r.get() for r in spawn(_stale, 2, front)]
    assert results[0] == results[1]
    assert "different iterations (2 on rank 0, 1 on rank 1)" in results[0]


# ---------------------------------------------------------------------- collectives that differ


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self, timeout: timedelta) -> None:
        raise self.error


def test_a_collective_mismatch_is_reported_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's "size doesn't match" was reported as "a peer raised, was killed, or the network
    is down"."""
    error = RuntimeError(
        "[enforce fail at pair.cc:456] Received data size doesn't match "
        "expected size. Is there a distributed collective mismatch?"
    )
    monkeypatch.setattr(exchange._inflight, "issue", lambda issue, tensors: _Failed(error))
    with pytest.raises(ExchangeError, match="ranks issued different collectives") as info:
        exchange.collective(
            dist.all_gather,
            torch.zeros(1),
            timeout=timedelta(seconds=1),
            what="size exchange",
            rank=0,
        )
    assert "settings or steps differ" in str(info.value) and "size doesn't match" in str(info.value)
