"""LocalSteps: local steps with sparse error-feedback syncs, on real gloo ranks (127.0.0.1).

Each test spawns a world of processes (``tests/world.py``); the functions named ``_rank_*``
run on every rank and return what the test asserts on.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradshare import ExchangeError, FixedThreshold, LocalSteps, codec
from gradshare.distributed.local_steps import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_LR_SGD,
    default_outer_lr,
)

from toys import flat, logged, mlp, toy_batches, toy_model
from world import pooled, spawn


def _train(model: nn.Module, inner: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        inner.zero_grad()
        F.cross_entropy(model(x), y).backward()
        inner.step()


def _record(sync: LocalSteps, i: int, log: list) -> None:
    """Make parameter ``i``'s encoder append (Δ, message) of each encode to ``log``, Δ taken
    from the sync as the encode starts: global copy - replica (the model has not taken the
    global copy yet), in float64."""
    enc = sync.encoders[i]

    def recording(encode: Callable[..., torch.Tensor | None]) -> Callable[..., object]:
        def recorded(update: None, iteration: int, *args: int, **kw: bool) -> object:
            delta = sync.global_params[i].double() - sync.params[i].detach().double()
            message = encode(update, iteration, *args, **kw)
            log.append((delta.reshape(-1), None if message is None else message.clone()))
            return message

        return recorded

    enc.encode = recording(enc.encode)  # type: ignore[method-assign]
    enc.encode_whole = recording(enc.encode_whole)  # type: ignore[method-assign]


def _decoded(message: torch.Tensor | None, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float64)
    if message is not None:
        out += codec.decode_(message, torch.zeros(numel))
    return out


# ---------------------------------------------------------------------- ranks


def _rank_laws(rank: int, world: int) -> dict:
    """Encoded syncs with β = 1 and β = 0.9 (in DL4J's messages and in compact ones), and
    dense syncs, on one world."""
    out: dict = {}
    batches = toy_batches(6 * world, seed=1)[rank::world]
    for key, decay, compact in (
        (1.0, 1.0, False),
        (0.9, 0.9, False),
        ("wide", 0.9, False),
        ("compact", 0.9, True),
    ):
        # rank 0's model must win; a wider one has pieces long enough to compact
        model = (
            mlp(10, 3, hidden=96, seed=rank) if key in ("wide", "compact") else toy_model(seed=rank)
        )
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = LocalSteps(model, inner, sync_every=2, decay=decay, compact=compact)
        logs: list[list] = [[] for _ in sync.encoders]
        for i, log in enumerate(logs):
            _record(sync, i, log)
        hashes, residuals = [], []
        for step, batch in enumerate(batches):
            _train(model, inner, [batch])
            if (step + 1) % 2 == 0:
                hashes.append(flat(model))
                residuals.append([e.residual.double().clone() for e in sync.encoders])  # type: ignore[union-attr]
                g = torch.cat([t.reshape(-1) for t in sync.global_params])
                assert torch.equal(g, flat(model))
        assert sync.syncs == 3 and sync.dense_bytes == 3 * 4 * sync.numel
        out[key] = {
            "hashes": hashes,
            "logs": logs,
            "residuals": residuals,
            "bytes": sync.bytes_sent,
            "seconds": (sync.sync_seconds, sync.wait_seconds),
        }
        sync.close()
    # dense, outer SGD lr 1: every sync leaves every replica at the mean of the replicas
    model = toy_model(seed=rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    locals_: list = []
    inner.register_step_post_hook(lambda *_: locals_.append(flat(model)))  # runs first
    sync = LocalSteps(
        model, inner, sync_every=3, dense=True, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0)
    )
    after = []
    for step, batch in enumerate(batches):
        _train(model, inner, [batch])
        if (step + 1) % 3 == 0:
            after.append(flat(model))
    assert sync.bytes_sent == 2 * 4 * sync.numel
    out["dense"] = {"locals": locals_[2::3], "after": after}
    sync.close()
    for name, make in (
        ("AdamW", lambda p: torch.optim.AdamW(p, lr=1e-2)),
        ("SGD", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ):
        model = toy_model(seed=0)
        with LocalSteps(model, make(model.parameters()), sync_every=2) as sync:
            out[f"outer {name}"] = (type(sync.outer).__name__, sync.outer.param_groups[0])
    step_sum, calls = codec.step_sum_, []

    def counted(*args: object, **kwargs: object) -> int:
        calls.append(1)
        return step_sum(*args, **kwargs)  # type: ignore[arg-type]

    codec.step_sum_ = counted  # type: ignore[assignment]
    for how in ("plain", "own"):  # plain SGD's step on the named elements, or SGD's own
        model = mlp(10, 3, hidden=96, seed=rank)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = LocalSteps(model, inner, sync_every=2)
        if how == "own":  # a hook leaves the step to the optimizer
            sync.outer.register_step_pre_hook(lambda *_: None)
        _train(model, inner, batches)
        out[f"outer step {how}"] = (
            flat(model),
            [g.clone() for g in sync.global_params],
            len(calls),
        )
        calls.clear()
        sync.close()
    codec.step_sum_ = step_sum  # type: ignore[assignment]
    return out


@pytest.fixture(scope="module")
def laws() -> list[dict]:
    return [r.get() for r in pooled(_rank_laws, 3)]


class TestSyncLaws:
    """The exact semantics of a sync, world size 3 (uneven message sizes)."""

    @pytest.fixture
    def results(self, laws: list[dict]) -> list[dict]:
        return laws

    def test_replicas_are_bit_identical_after_every_sync(self, results: list[dict]) -> None:
        for decay in (1.0, 0.9):
            for k in range(3):
                first = results[0][decay]["hashes"][k]
                assert all(torch.equal(r[decay]["hashes"][k], first) for r in results)

    def test_conservation_per_parameter(self, results: list[dict]) -> None:
        """β = 1: Σ of the Δ that went into a residual = decoded own messages + residual."""
        for r in results:
            run = r[1.0]
            for i, log in enumerate(run["logs"]):
                numel = log[0][0].numel()
                sent = sum(u.double() for u, _ in log)
                got = sum(_decoded(m, numel) for _, m in log) + run["residuals"][-1][i]
                torch.testing.assert_close(got, sent, rtol=0, atol=1e-6)

    def test_residual_decay_law(self, results: list[dict]) -> None:
        """β < 1: residual_k = β·residual_(k-1) + Δ_k - decoded own message_k."""
        for r in results:
            run = r[0.9]
            for i, log in enumerate(run["logs"]):
                prev = torch.zeros_like(run["residuals"][0][i])
                for k, (u, m) in enumerate(log):
                    want = 0.9 * prev + u.double() - _decoded(m, u.numel())
                    torch.testing.assert_close(run["residuals"][k][i], want, rtol=0, atol=1e-6)
                    prev = run["residuals"][k][i]

    def test_bytes_sent_are_the_message_words(self, results: list[dict]) -> None:
        for r in results:
            for key in (1.0, 0.9, "compact"):
                logs = r[key]["logs"]
                form = codec.compact_message if key == "compact" else lambda m: m
                want = 0
                for k in range(3):
                    pieces = [log[k][1] for log in logs]
                    if any(m is not None for m in pieces):
                        want += 4 * sum(4 if m is None else form(m).numel() for m in pieces)
                assert r[key]["bytes"] == want > 0

    def test_compact_messages_change_the_bytes_alone(self, results: list[dict]) -> None:
        """compact=True: the same messages, residuals and replicas as DL4J's format, bit for
        bit, in fewer bytes (every piece here crosses into its compact form)."""
        for r in results:
            small, dl4j = r["compact"], r["wide"]
            assert all(
                torch.equal(a, b) for a, b in zip(small["hashes"], dl4j["hashes"], strict=True)
            )
            for got, want in zip(small["logs"], dl4j["logs"], strict=True):
                assert all(
                    torch.equal(a[1], b[1])
                    for a, b in zip(got, want, strict=True)
                    if a[1] is not None or b[1] is not None
                )
            assert small["bytes"] < 0.6 * dl4j["bytes"]

    def test_default_outer_optimizer_follows_the_inner_one(self, results: list[dict]) -> None:
        """Plain SGD without momentum: lr 2.8 after AdamW, 1.4 after momentum SGD."""
        for r in results:
            for name, lr in (("AdamW", DEFAULT_OUTER_LR), ("SGD", DEFAULT_OUTER_LR_SGD)):
                kind, group = r[f"outer {name}"]
                assert (kind, group["lr"], group["momentum"]) == ("SGD", lr, 0), name
        assert (DEFAULT_OUTER_LR, DEFAULT_OUTER_LR_SGD) == (2.8, 1.4)

    def test_plain_sgd_steps_as_its_own_step(self, results: list[dict]) -> None:
        """Plain SGD's outer step taken on the elements the messages name alone (its mean is
        +0.0 elsewhere) gives the bits of SGD's own step over the decoded mean, with three
        ranks' messages summed and divided by 3."""
        for r in results:
            (plain, kept, steps), (own, want, none) = r["outer step plain"], r["outer step own"]
            assert steps == 3 * len(kept) and none == 0
            assert torch.equal(plain, own)
            assert all(torch.equal(a, b) for a, b in zip(kept, want, strict=True))

    def test_dense_sync_is_the_mean_of_the_replicas(self, results: list[dict]) -> None:
        for k in range(2):
            mean = sum(r["dense"]["locals"][k] for r in results) / len(results)
            for r in results:
                torch.testing.assert_close(r["dense"]["after"][k], mean)


def _recorder(model: nn.Module, into: list) -> Callable[..., None]:
    """A step post-hook that appends the model's parameters to ``into``."""
    return lambda *_: into.append(flat(model))


def _rank_overlap(rank: int, world: int) -> dict:
    """overlap: dense with outer SGD lr 1 (exact arithmetic) at τ = H = 2 (``True``) and τ = 1,
    then encoded with every default, both τ. Per step: the model after the step's hooks, and
    the global copy."""
    batches = toy_batches(9 * world, seed=3)[rank::world]
    out: dict = {}
    for tau in (2, 1):
        for dense in (True, False):
            model = toy_model(seed=rank)
            if dense:
                inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            else:
                inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
            locals_: list = []
            inner.register_step_post_hook(_recorder(model, locals_))  # runs first
            kwargs: dict = {}
            if dense:
                kwargs = {"dense": True, "outer_optimizer": lambda p: torch.optim.SGD(p, lr=1.0)}
            sync = LocalSteps(
                model, inner, sync_every=2, overlap=True if tau == 2 else tau, **kwargs
            )
            start, after, copies, counted, seconds = flat(model), [], [], [], []
            for batch in batches:
                _train(model, inner, [batch])
                after.append(flat(model))
                copies.append(torch.cat([g.reshape(-1) for g in sync.global_params]))
                counted.append((sync.bytes_sent, sync.dense_bytes))
                seconds.append((sync.sync_seconds, sync.wait_seconds))
            sync.close()  # after step 9
            out[(tau, dense)] = {
                "start": start,
                "locals": locals_,
                "after": after,
                "copies": copies,
                "closed": flat(model),
                "counted": counted,
                "numel": sync.numel,
                "syncs": sync.syncs,
                "seconds": seconds,
            }
    return out


@pytest.fixture(scope="module")
def overlapped() -> list[dict]:
    return [r.get() for r in pooled(_rank_overlap, 2)]


def _replay(runs: list[dict], tau: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """LocalSteps(sync_every=2, overlap=tau, dense, outer SGD lr 1) replayed in float32 in the
    same order from the ranks' recorded local steps: the model after each of the 9 steps (the
    same on both ranks at a merge, each rank's own otherwise) and after close(), per rank."""
    g, pending = runs[0]["start"], None
    base = [torch.zeros_like(g) for _ in runs]  # the carry (offset from g), or the sent-from
    after: list = [[] for _ in runs]
    for step in range(1, 10):
        local = [run["locals"][step - 1] for run in runs]
        model = list(local)
        if tau == 1 and step % 2 == 1 and pending is not None:  # the merge, 1 step after a sync
            base = [b - x for b, x in zip(base, local, strict=True)]  # the carry
            g, pending = g - pending, None
            model = [g, g]
        if step % 2 == 0:  # a sync
            if pending is None:
                deltas = [(g + b) - x for b, x in zip(base, local, strict=True)]
                base = list(local)
            else:  # τ = 2: Δ from the sent-from, then the merge with its lead
                deltas = [b - x for b, x in zip(base, local, strict=True)]
                old, g = g, g - pending
                lead = g - old
                model = [g + lead, g + lead]
                base = list(model)
            pending = (deltas[0] + deltas[1]) / 2
        for r in range(len(runs)):
            after[r].append(model[r])
    closed = []
    for r, run in enumerate(runs):
        if pending is not None:  # close(): the round in flight, with the moves since its send
            closed.append((g - pending) + (run["locals"][-1] - base[r]))
        else:  # nothing in flight: the carry back into the model
            closed.append(after[r][-1] - base[r])
    return after, torch.stack(closed)


def _rank_logged(rank: int, world: int) -> list[tuple[str, str]]:
    """What an overlapping LocalSteps logs, DEBUG included: syncs at steps 2 and 4, the
    first merged at step 3, the second at the close."""
    model = toy_model(seed=rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with logged() as said:
        sync = LocalSteps(model, inner, sync_every=2, overlap=1)
        _train(model, inner, toy_batches(4, seed=rank))
        sync.close()
    return said


def test_logs_its_configuration_and_each_round_at_debug() -> None:
    """One INFO line when built, and with overlap a DEBUG line as each round arrives."""
    for said in (r.get() for r in pooled(_rank_logged, 2)):
        ours = [(level, m) for level, m in said if m.startswith("LocalSteps")]
        assert [level for level, _ in ours] == ["INFO", "DEBUG", "DEBUG"], said
        assert "overlap=1" in ours[0][1] and "world 2" in ours[0][1], said
        assert ours[1][1].startswith("LocalSteps: a round of "), said


class TestOverlap:
    """overlap=τ: each sync's exchange runs during the next τ steps, then its mean is merged
    and the model takes the global copy (with τ = sync_every a lead: that merge's step
    again); what a replica moved meanwhile is its carry, sent with the next sync. Closing
    merges what is in flight and gives the carry back. World size 2, sync_every 2."""

    @pytest.mark.parametrize("tau", [2, 1])
    def test_dense_is_the_recurrence(self, overlapped: list[dict], tau: int) -> None:
        """Replayed here in float32 in the same order, every step's model and the closed one
        must match bit for bit."""
        runs = [r[(tau, True)] for r in overlapped]
        after, closed = _replay(runs, tau)
        for r, run in enumerate(runs):
            for step in range(9):
                assert torch.equal(run["after"][step], after[r][step]), (r, step + 1)
            assert torch.equal(run["closed"], closed[r])
        # the merges: step 4, 6, 8 (τ 2) or 3, 5, 7, 9 (τ 1) leave the replicas alike
        merges = [4, 6, 8] if tau == 2 else [3, 5, 7, 9]
        for step in merges:
            assert torch.equal(runs[0]["after"][step - 1], runs[1]["after"][step - 1]), step
        assert not torch.equal(runs[0]["after"][1], runs[1]["after"][1])  # sync 1 merges none
        if tau == 2:  # the lead is real: the model is ahead of the copy at every merge
            assert not torch.equal(runs[0]["after"][3], runs[0]["copies"][3])
        else:
            for step in merges:
                assert torch.equal(runs[0]["after"][step - 1], runs[0]["copies"][step - 1])
        # a round is counted when its exchange completes
        numel = runs[0]["numel"]
        done = [sum(1 for m in merges if m <= step) for step in range(1, 10)]
        assert runs[0]["counted"] == [(4 * numel * k, 4 * numel * k) for k in done]
        assert runs[0]["syncs"] == 4

    def test_seconds_in_syncs_and_waits(self, overlapped: list[dict], laws: list[dict]) -> None:
        """``sync_seconds`` grows at the steps that sync or merge alone; ``wait_seconds`` at
        every merge, only at such steps, and never without overlap."""
        for r in overlapped:
            for tau in (2, 1):
                seconds = r[(tau, False)]["seconds"]  # [k]: after step k + 1
                syncing = [1, 3, 5, 7] if tau == 2 else [1, 2, 3, 4, 5, 6, 7, 8]
                merges = [3, 5, 7] if tau == 2 else [2, 4, 6, 8]
                for k in range(1, len(seconds)):
                    grew, waited = (seconds[k][i] > seconds[k - 1][i] for i in (0, 1))
                    assert grew == (k in syncing), (tau, k)
                    assert waited <= grew and waited >= (k in merges), (tau, k)
        for r in laws:
            sync_s, wait_s = r[0.9]["seconds"]
            assert sync_s > 0 and wait_s == 0

    @pytest.mark.parametrize("tau", [2, 1])
    def test_encoded_replicas_are_bit_identical_at_every_merge(
        self, overlapped: list[dict], tau: int
    ) -> None:
        runs = [r[(tau, False)] for r in overlapped]
        merges = [4, 6, 8] if tau == 2 else [3, 5, 7, 9]
        for step in merges:
            assert torch.equal(runs[0]["after"][step - 1], runs[1]["after"][step - 1]), step
            copy = runs[0]["copies"][step - 1]
            if tau == 1:
                assert torch.equal(runs[0]["after"][step - 1], copy)
            else:  # one outer step ahead of the copy: the step just taken, again
                old = runs[0]["copies"][step - 3]
                assert torch.equal(runs[0]["after"][step - 1], copy + (copy - old))
        for step in (1, 2):  # no merge yet: each replica its own
            assert not torch.equal(runs[0]["after"][step - 1], runs[1]["after"][step - 1])
        for run in runs:  # bytes counted at the merges only
            sent = [c[0] for c in run["counted"]]
            assert run["syncs"] == 4 and sent[merges[0] - 2] == 0 < sent[merges[0] - 1] < sent[-1]


def _rank_fragments(rank: int, world: int) -> dict:
    """2 fragments at sync_every 2, dense with outer SGD lr 1 (exact arithmetic), without
    overlap and with τ 1: per step, the model after the step's hooks."""
    batches = toy_batches(9 * world, seed=4)[rank::world]
    out: dict = {}
    for tau in (0, 1):
        model = toy_model(seed=rank)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        locals_: list = []
        inner.register_step_post_hook(_recorder(model, locals_))  # runs first
        sync = LocalSteps(
            model,
            inner,
            sync_every=2,
            dense=True,
            overlap=tau,
            fragments=2,
            outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        )
        start, after = flat(model), []
        for batch in batches:
            _train(model, inner, [batch])
            after.append(flat(model))
        sync.close()
        out[tau] = {
            "start": start,
            "locals": locals_,
            "after": after,
            "closed": flat(model),
            "parts": [(f.start, f.stop, f.offset) for f in sync._schedule.spans],
            "syncs": sync.syncs,
            "sent": sync.bytes_sent,
            "numel": sync.numel,
        }
    return out


@pytest.mark.parametrize("tau", [0, 1])
def test_fragments_are_the_streaming_recurrence(tau: int) -> None:
    """fragments=2: the first fragment syncs at even steps, the second at odd ones, each
    alone (τ 1: merged one step later, just before the other's sync). Replayed here in
    float32 in the same order, every step's model must match bit for bit; a fragment is alike
    on both ranks right after its sync (or merge)."""
    runs = [r.get()[tau] for r in pooled(_rank_fragments, 2)]
    parts = runs[0]["parts"]
    assert len(parts) == 2 and parts[0][0] == 0 < parts[0][1] == parts[1][0]
    assert parts[1][1] == runs[0]["numel"] and [p[2] for p in parts] == [0, 1]
    g, pending, flight = runs[0]["start"].clone(), None, None
    base = [torch.zeros_like(g) for _ in runs]
    for step in range(1, 10):
        model = [run["locals"][step - 1].clone() for run in runs]
        done = None
        if flight is not None and (step - tau) % 2 == parts[flight][2]:  # the merge
            a, b = parts[flight][:2]
            for r in range(2):
                base[r][a:b] = base[r][a:b] - model[r][a:b]
            g[a:b] = g[a:b] - pending
            for r in range(2):
                model[r][a:b] = g[a:b]
            done, flight = (a, b), None
        f = step % 2  # the fragment whose sync this step ends with
        a, b = parts[f][:2]
        deltas = [
            (g[a:b] + base[r][a:b]) - model[r][a:b] if tau else g[a:b] - model[r][a:b]
            for r in range(2)
        ]
        mean = (deltas[0] + deltas[1]) / 2
        if tau:
            for r in range(2):
                base[r][a:b] = model[r][a:b]
            pending, flight = mean, f
        else:
            g[a:b] = g[a:b] - mean
            for r in range(2):
                model[r][a:b] = g[a:b]
            done = (a, b)
        for r, run in enumerate(runs):
            assert torch.equal(run["after"][step - 1], model[r]), (r, step)
        assert (done is None) == (tau == 1 and step == 1)  # from then on each step has one
        if done is not None:
            assert torch.equal(
                runs[0]["after"][step - 1][done[0] : done[1]],
                runs[1]["after"][step - 1][done[0] : done[1]],
            )
    for r, run in enumerate(runs):  # close(): the round in flight, then the carry back
        closed = model[r].clone()
        if flight is not None:
            a, b = parts[flight][:2]
            moved = closed[a:b] - base[r][a:b]
            closed[a:b] = (g[a:b] - pending) + moved
            base[r][a:b] = 0
        assert torch.equal(run["closed"], closed - base[r] if tau else closed)
    sizes = [b - a for a, b, _ in parts]  # 4 syncs of the first, 5 of the second, all counted
    assert runs[0]["syncs"] == 9 and runs[0]["sent"] == 4 * (4 * sizes[0] + 5 * sizes[1])


def _poison(
    inner: torch.optim.Optimizer, param: torch.Tensor, index: tuple[int, ...], here: bool
) -> list:
    """On this rank (``here``): once the returned list is not empty, ``param[index]`` turns
    NaN after each inner step, before LocalSteps' hook (registered before it) sees it."""
    armed: list = []

    def poison(*_: object) -> None:
        if armed:
            with torch.no_grad():
                param[index] = float("nan")

    if here:
        inner.register_step_post_hook(poison)
    return armed


def _rank_refusals(rank: int, world: int) -> dict:
    """Settings and round mismatches, a NaN on one rank, a skipped GradScaler step."""
    out: dict = {}
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        LocalSteps(model, inner, sync_every=2, decay=0.9 if rank == 1 else 0.95)
    except ValueError as e:
        out["settings"] = str(e)
    try:
        LocalSteps(model, inner, sync_every=2, overlap=rank == 0)
    except ValueError as e:
        out["overlap"] = str(e)
    out["hooks_left"] = len(inner._optimizer_step_post_hooks)
    batches = toy_batches(8 * world)[rank::world]
    # a NaN in rank 1's parameters at the second sync, put there after its inner step
    poisoned = _poison(inner, model[2].weight, (0, 0), rank == 1)  # type: ignore[index]
    sync = LocalSteps(model, inner, sync_every=2, timeout=20)
    _train(model, inner, batches[:2])
    before = [g.clone() for g in sync.global_params]
    residuals = [e.residual.clone() for e in sync.encoders]  # type: ignore[union-attr]
    _train(model, inner, batches[2:3])
    poisoned.append(True)
    try:
        _train(model, inner, batches[3:4])  # ← the sync
    except ValueError as e:
        out["nan"] = str(e)
    out["unchanged"] = (
        all(torch.equal(a, b) for a, b in zip(before, sync.global_params, strict=True))
        and all(torch.equal(r, e.residual) for r, e in zip(residuals, sync.encoders, strict=True))
        and sync.syncs == 1
    )
    sync.close()
    # rounds that differ (as after resuming from different checkpoints)
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = LocalSteps(model, inner, sync_every=2, timeout=20)
    _train(model, inner, batches[:2])
    if rank == 1:
        state = sync.state_dict()
        state["steps"], state["syncs"] = 10, 5  # another run's checkpoint, ahead
        sync.load_state_dict(state)
    try:
        _train(model, inner, batches[2:4])
    except ValueError as e:
        out["rounds"] = str(e)
    sync.close()
    return out


def _rank_grad_scaler(rank: int, world: int) -> dict:
    """Rank 1's gradient overflows at iteration 3: GradScaler skips its inner step there."""
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    stepped: list[int] = []
    inner.register_step_post_hook(lambda *_: stepped.append(1))
    sync = LocalSteps(model, inner, sync_every=2, grad_scaler=scaler, timeout=20)
    hashes = []
    for i, (x, y) in enumerate(toy_batches(6 * world)[rank::world]):
        inner.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if rank == 1 and i == 2:
            model[0].weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.step(inner)
        scaler.update()
        if i % 2 == 1:
            hashes.append(flat(model))
    sync.close()
    assert "update" not in scaler.__dict__  # close() gave the scaler its own update back
    return {"hashes": hashes, "syncs": sync.syncs, "stepped": len(stepped), "steps": sync.steps}


def _rank_float64(rank: int, world: int) -> dict:
    """A float64 model (Δ then goes through float32, off the one-pass kernel): a dense sync
    with outer SGD lr 1, then a NaN on rank 1 at the next sync."""
    model = toy_model(seed=rank).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    locals_: list = []
    inner.register_step_post_hook(_recorder(model, locals_))  # runs before LocalSteps' hook
    armed = _poison(inner, model[0].bias, (1,), rank == 1)  # type: ignore[index]
    sync = LocalSteps(
        model,
        inner,
        sync_every=2,
        dense=True,
        timeout=20,
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
    )
    batches = [(x.double(), y) for x, y in toy_batches(4 * world, seed=5)[rank::world]]
    _train(model, inner, batches[:2])  # the second step ends with the sync
    out: dict = {"local": locals_[1], "after": flat(model)}
    _train(model, inner, batches[2:3])
    armed.append(True)  # rank 1's bias turns NaN after its 4th step, at the sync
    try:
        _train(model, inner, batches[3:4])
    except ValueError as e:
        out["nan"] = str(e)
    sync.close()
    # encoded: Δ in float32 into each residual; a NaN at the next sync puts them back
    model = toy_model(seed=rank).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    armed = _poison(inner, model[0].bias, (1,), rank == 1)  # type: ignore[index]
    sync = LocalSteps(model, inner, sync_every=2, timeout=20)
    _train(model, inner, batches[:2])  # the second step ends with the sync
    out["encoded"] = flat(model)
    residuals = [e.residual.clone() for e in sync.encoders]  # type: ignore[union-attr]
    _train(model, inner, batches[2:3])
    armed.append(True)
    with contextlib.suppress(ValueError):
        _train(model, inner, batches[3:4])
    out["residuals kept"] = all(
        torch.equal(r, e.residual) for r, e in zip(residuals, sync.encoders, strict=True)
    )
    sync.close()
    return out


class _Small(nn.Module):
    """A scalar, a 2-element bias, a LayerNorm of 16 and a 16→2 layer (32 weights): at the
    default 4 % each aimed at round(0.04 N) < 2 entries, and DL4J's rule sends no message
    with fewer than 2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(10, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 2)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x)).relu()) * self.scale


def _moved(
    model: nn.Module, step: Callable[[torch.Tensor, torch.Tensor], None], rank: int, world: int
) -> dict[str, bool]:
    """40 steps of ``step(x, y)`` on this rank's batches: which parameters moved between
    step 20 and step 40."""
    batches = [(x, y % 2) for x, y in toy_batches(40 * world, seed=7)[rank::world]]
    seen = []
    for i, (x, y) in enumerate(batches):
        step(x, y)
        if i + 1 in (20, 40):
            seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {n: not torch.equal(seen[0][n], seen[1][n]) for n in seen[0]}


def _rank_small_tensors(rank: int, world: int) -> dict:
    """Every parameter of :class:`_Small` under LocalSteps' defaults and under the DDP hook's."""
    from gradshare import register_threshold_hook

    model = _Small()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with LocalSteps(model, inner, sync_every=10) as sync:
        out = {"local": _moved(model, lambda x, y: _train(model, inner, [(x, y)]), rank, world)}
        out["local metrics"] = sync.metrics()
    model = _Small()
    ddp = DistributedDataParallel(model)
    state = register_threshold_hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out["hook"] = _moved(model, lambda x, y: _train(ddp, opt, [(x, y)]), rank, world)
    out["hook metrics"] = state.metrics()
    return out


def _bn_model() -> nn.Module:
    """An MLP with a BatchNorm (its running statistics are buffers) and a constant buffer."""
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model.register_buffer("mask", torch.ones(100))  # alike on every rank: never sent
    return model


def _rank_buffers(rank: int, world: int) -> dict:
    """BatchNorm's statistics after a LocalSteps sync and a SharedOptimizer step, on
    different data per rank, with the defaults and with ``broadcast_buffers=False``."""
    from gradshare import SharedOptimizer

    batches = toy_batches(4 * world, seed=8)[rank::world]
    probe = toy_batches(1, seed=9)[0][0]
    out: dict = {}
    for key, on in (("local", True), ("local off", False)):
        model = _bn_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        with LocalSteps(model, inner, sync_every=2, broadcast_buffers=on) as sync:
            _train(model, inner, batches[:2])  # the second step ends with the sync
        out[key] = {
            "buffers": dict(model.named_buffers()),
            "sent": sync._protocol.buffers.sent,
            "eval": model.eval()(probe),
        }
    model = _bn_model()
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _train(model, opt, batches[:1])
    out["shared"] = dict(model.named_buffers())
    return out


def _refused(load: Callable[[], object]) -> str:
    """The ValueError ``load()`` raised ("" when it raised none)."""
    try:
        load()
    except ValueError as e:
        return str(e)
    return ""


def _rank_outer_at_load(rank: int, world: int) -> dict:
    """A state saved with the default outer optimizer (plain SGD, lr 1.4 after SGD) loaded
    into LocalSteps built with another, and outer states with junk in them."""
    batches = toy_batches(2 * world, seed=10)[rank::world]
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    momentum = lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)
    with LocalSteps(model, inner, sync_every=2, outer_optimizer=momentum) as sync:
        _train(model, inner, batches)
        saved = sync.state_dict()
        before = copy.deepcopy(sync.state_dict())
        outer = saved["outer"]
        groups, buf = outer["param_groups"], outer["state"][0]["momentum_buffer"]
        junk = {
            "lr -5": {**outer, "param_groups": [{**groups[0], "lr": -5.0}]},
            "lr nan": {**outer, "param_groups": [{**groups[0], "lr": float("nan")}]},
            "lr 'x'": {**outer, "param_groups": [{**groups[0], "lr": "x"}]},
            "buffer shape": {**outer, "state": {0: {"momentum_buffer": buf[:1]}}},
            "buffer nan": {**outer, "state": {0: {"momentum_buffer": buf * float("nan")}}},
            "empty": {},
        }
        out = {
            k: _refused(lambda o=o: sync.load_state_dict({**saved, "outer": o}))
            for k, o in junk.items()
        }
        after = sync.state_dict()
        pairs = zip(before["global"], after["global"], strict=True)
        same_outer = repr(before["outer"]) == repr(after["outer"])
        out["unchanged"] = all(torch.equal(a, b) for a, b in pairs) and same_outer
    for name, make in (
        ("sgd 1.0", lambda p: torch.optim.SGD(p, lr=1.0)),
        ("adam", lambda p: torch.optim.Adam(p, lr=0.1)),
    ):
        with LocalSteps(model, inner, sync_every=2, outer_optimizer=make) as other:
            out[name] = _refused(lambda o=other: o.load_state_dict(saved))
            settings = {k: v for k, v in saved["settings"].items() if k != "outer_optimizer"}
            old = {**saved, "settings": settings}  # saved before the setting was recorded
            out[f"{name} unrecorded"] = _refused(lambda o=other, s=old: o.load_state_dict(s))
    return out


def _rank_guards(rank: int, world: int) -> dict:
    """An outer step that overflows, a GradScaler not passed, a second LocalSteps on one
    optimizer and other arguments refused, junk counters and global copies at load, a
    bfloat16 model's global copy, and a tensor that never crosses its threshold."""
    from gradshare.distributed import metrics

    batches = toy_batches(4 * world, seed=11)[rank::world]
    out: dict = {}
    for lr in (1e38, 1e42):  # inf in float32 (the moves are ~100); an lr float32 cannot hold
        model = toy_model()
        inner = torch.optim.SGD(model.parameters(), lr=1e3)
        sync = LocalSteps(
            model, inner, sync_every=2, outer_optimizer=lambda p, lr=lr: torch.optim.SGD(p, lr=lr)
        )
        _train(model, inner, batches[:1])
        local = flat(model)
        out[f"overflow {lr:g}"] = _refused(lambda m=model, i=inner: _train(m, i, batches[1:2]))
        moved = not torch.equal(flat(model), local)
        out[f"kept {lr:g}"] = bool(flat(model).isfinite().all()) and moved
        with pytest.raises(RuntimeError, match="outer step"):  # and at every later step
            _train(model, inner, batches[2:3])
        sync.close()
    # a GradScaler that LocalSteps was not given
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with LocalSteps(model, inner, sync_every=2) as sync:
        scaler.scale(F.cross_entropy(model(batches[0][0]), batches[0][1])).backward()
        with pytest.raises(RuntimeError, match="grad_scaler=scaler") as caught:
            scaler.step(inner)
        out["scaler"] = str(caught.value)
        # a second LocalSteps on the same optimizer, one that does not step the model
        out["twice"] = _refused(lambda: LocalSteps(model, inner, sync_every=2))
        other = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
        out["foreign"] = _refused(lambda: LocalSteps(toy_model(), other, sync_every=2))
    complex_model = nn.Linear(2, 2).to(torch.complex64)
    try:
        LocalSteps(complex_model, torch.optim.SGD(complex_model.parameters(), lr=0.1), sync_every=2)
    except TypeError as e:
        out["complex"] = str(e)
    # junk at load
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSteps(model, inner, sync_every=2, overlap=1) as sync:
        _train(model, inner, batches[:2])  # the sync at step 2: its round waits for its merge
        saved = sync.state_dict()
        glob = saved["global"]
        junk = {
            "int global": {**saved, "global": [g.long() for g in glob]},
            "bool global": {**saved, "global": [g > 0 for g in glob]},
            "float64 global": {**saved, "global": [g.double() * 1e39 for g in glob]},
            "steps 2**62": {**saved, "steps": 2**62},
            "syncs ahead": {**saved, "syncs": 2},
            "pending without base": {**saved, "base": None},
        }
        out.update({k: _refused(lambda j=j: sync.load_state_dict(j)) for k, j in junk.items()})
        out["pending"] = saved["pending"] is not None
    # a bfloat16 model keeps a float32 global copy
    model = toy_model().to(torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with LocalSteps(model, inner, sync_every=2) as sync:
        _train(model, inner, [(x.bfloat16(), y) for x, y in batches[:2]])
        out["bf16 global"] = {g.dtype for g in sync.global_params}
    # a threshold no residual crosses: the tensors sent by threshold stall, and say so
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics.STALLED_AFTER, metrics._warned = 3, set()
    with LocalSteps(model, inner, sync_every=1, threshold=FixedThreshold(1e3)) as sync:
        _train(model, inner, batches[:2])
        out["stalled 2"] = sync.metrics()["stalled"]
        _train(model, inner, batches[2:3])
        out["stalled 3"] = sync.metrics()["stalled"]
    out["warned"] = sorted(k for k in metrics._warned if k.startswith("stalled"))
    return out


def _rank_two(rank: int, world: int, tmp: str) -> dict:
    """What needs 2 healthy ranks, in one world (each spawned process costs seconds of
    imports): the refusals, the grad scaler, and the first half of the resume test."""
    return {
        **_rank_refusals(rank, world),
        "scaler": _rank_grad_scaler(rank, world),
        "float64": _rank_float64(rank, world),
        "small": _rank_small_tensors(rank, world),
        "buffers": _rank_buffers(rank, world),
        "outer": _rank_outer_at_load(rank, world),
        "guards": _rank_guards(rank, world),
        **{
            f"whole {tau} {parts} {dense}": _rank_resume(
                rank, world, tmp, "whole", tau, parts, dense
            )
            for tau, parts, dense in RESUMES
        },
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("two")
    return [r.get() for r in pooled(_rank_two, 2, str(tmp))], tmp


@pytest.fixture(scope="module")
def refusals(two: tuple[list[dict], Path]) -> list[dict]:
    return two[0]


class TestNothingLost:
    """Every parameter trains, however small."""

    def test_small_tensors_train_under_local_steps_and_the_hook(self, refusals: list[dict]) -> None:
        """A scalar, a 2-element bias, a LayerNorm of 16 and the 32 weights of a 16→2 layer
        sent nothing under LocalSteps' defaults (and the scalar under the hook): the DL4J
        rule sends no message with fewer than 2 entries, so each sync reset them to their
        start. Now every tensor sends 2 entries a sync at least (the scalar whole), and every
        parameter moves between step 20 and step 40."""
        for r in refusals:
            for mode in ("local", "hook"):
                moved = r["small"][mode]
                assert len(moved) == 7 and all(moved.values()), (mode, moved)
                assert r["small"][f"{mode} metrics"]["stalled"] == 0

    def test_buffers_are_rank_0s_after_every_sync(self, refusals: list[dict]) -> None:
        """BatchNorm's running statistics drifted apart (each replica's own forward passes
        write them) while the parameters were alike; now they are rank 0's after a
        LocalSteps sync and a SharedOptimizer step (with ``model=``), and so the eval outputs
        agree. Only what differs is sent: BatchNorm's mean and variance (2 x 16 float32),
        not the constant mask nor the step counter."""
        a, b = (r["buffers"] for r in refusals)
        for key in ("local", "shared"):
            x, y = (r["buffers"] if key == "local" else r for r in (a[key], b[key]))
            assert x.keys() == y.keys() and len(x) == 4, x.keys()  # mask, BatchNorm's 3
            assert all(torch.equal(x[n], y[n]) for n in x), key
        assert torch.equal(a["local"]["eval"], b["local"]["eval"])
        assert a["local"]["sent"] == b["local"]["sent"] == 2 * 16 * 4
        off = (r["local off"]["buffers"]["1.running_mean"] for r in (a, b))
        assert not torch.equal(*off)
        assert a["local off"]["sent"] == 0


class TestStateAtLoad:
    """A state that does not fit is refused at load, naming what differs; nothing changes."""

    def test_another_outer_optimizer_is_refused_naming_it(self, refusals: list[dict]) -> None:
        """Built with outer SGD lr 1.0, a load ran the saved Nesterov 0.7/0.9 with no word;
        an Adam built over an SGD state failed at the next sync (``KeyError: 'betas'``),
        after the exchange."""
        for r in refusals:
            out = r["outer"]
            assert "`outer_optimizer` " in out["sgd 1.0"] and "lr', 1.0" in out["sgd 1.0"]
            assert "`outer_optimizer` " in out["adam"]
            assert "'betas'" in out["adam unrecorded"], out["adam unrecorded"]
            # the same class, other hyperparameters, in a state that predates the record:
            # torch's own rule, the saved hyperparameters (and an outer schedule) resume
            assert out["sgd 1.0 unrecorded"] == ""

    def test_junk_outer_states_are_refused_and_nothing_changes(self, refusals: list[dict]) -> None:
        for r in refusals:
            out = r["outer"]
            assert "Invalid learning rate" in out["lr -5"], out["lr -5"]
            assert "`lr` nan" in out["lr nan"] and "`lr` 'x'" in out["lr 'x'"]
            assert "of shape (1, 10), for a parameter of shape (16, 10)" in out["buffer shape"]
            assert "non-finite" in out["buffer nan"]
            assert "`state` to be a dict, got NoneType" in out["empty"]
            assert out["unchanged"]

    def test_junk_counters_and_global_copies_are_refused(self, refusals: list[dict]) -> None:
        """An int, bool or float64 global copy was cast (a float64 1e39 became inf after
        the finiteness check), inconsistent counters and a waiting round without its send
        point were taken."""
        for r in refusals:
            out = r["guards"]
            assert out["pending"]
            for key in ("int global", "bool global", "float64 global"):
                assert "dtype" in out[key], (key, out[key])
            assert "`steps` 4611686018427387904 and `syncs` 1" in out["steps 2**62"]
            assert "2 inner steps hold at most 1 syncs" in out["syncs ahead"]
            assert "`base` is None" in out["pending without base"]

    def test_a_bfloat16_model_keeps_a_float32_global_copy(self, refusals: list[dict]) -> None:
        """Outer steps smaller than bfloat16's spacing were rounded away in a bf16 copy."""
        assert all(r["guards"]["bf16 global"] == {torch.float32} for r in refusals)


class TestGuards:
    """What would lose training or desync the replicas with no word now raises."""

    def test_an_outer_step_that_overflows_is_named(self, refusals: list[dict]) -> None:
        """An outer step that turned the global copy inf went on with no error (the next
        sync blamed the local parameters); outer lr 1e42 raised a raw RuntimeError after the
        exchange. Both now name
        the outer step on every rank; the model keeps its replica, and every later step
        raises the same."""
        for lr in ("1e+38", "1e+42"):
            said = {r["guards"][f"overflow {lr}"] for r in refusals}
            assert len(said) == 1 and "the outer step" in said.pop()
            assert all(r["guards"][f"kept {lr}"] for r in refusals)

    def test_a_grad_scaler_not_passed_is_refused(self, refusals: list[dict]) -> None:
        """A rank whose step the scaler skipped synced one step late in every round."""
        assert all("Pass `grad_scaler=scaler`" in r["guards"]["scaler"] for r in refusals)

    def test_arguments_that_lose_training_are_refused(self, refusals: list[dict]) -> None:
        """A second LocalSteps on one optimizer (two hooks, two global copies), an optimizer
        that steps none of the model's parameters, and a complex parameter (its imaginary
        moves dropped) were accepted."""
        out = refusals[0]["guards"]
        assert "another one syncs this optimizer already" in out["twice"]
        assert "holds none of them" in out["foreign"]
        assert "complex '0.weight'" in out["complex"] or "complex 'weight'" in out["complex"]

    def test_a_stalled_tensor_is_counted_and_named(self, refusals: list[dict]) -> None:
        """A threshold that a tensor never reaches kept its update in the residual with no
        word; after STALLED_AFTER syncs it is in ``metrics()["stalled"]`` and a warning."""
        for r in refusals:
            out = r["guards"]
            assert (out["stalled 2"], out["stalled 3"]) == (0, 3)  # out.bias (3) goes whole
            assert out["warned"] == [
                f"stalled LocalSteps {n}" for n in ("0.bias", "0.weight", "2.weight")
            ]


class TestRefusals:
    """Whatever one rank gets wrong, every rank raises the same error, and nothing changes."""

    @pytest.fixture
    def results(self, refusals: list[dict]) -> list[dict]:
        return refusals

    def test_mismatched_settings_refused_alike_on_every_rank(self, results: list[dict]) -> None:
        msg = results[0]["settings"]
        assert msg == results[1]["settings"]
        assert "`decay` 0.95 on rank 0, 0.9 on rank 1" in msg
        assert all(r["hooks_left"] == 0 for r in results)  # nothing registered

    def test_overlap_on_one_rank_only_is_refused_on_both(self, results: list[dict]) -> None:
        """The ranks would issue their collectives in different orders."""
        msg = results[0]["overlap"]
        assert msg == results[1]["overlap"]
        assert "`overlap` 2 on rank 0, 0 on rank 1" in msg  # True: merged at the next sync

    def test_nan_on_one_rank_changes_nothing_anywhere(self, results: list[dict]) -> None:
        msg = results[0]["nan"]
        assert msg == results[1]["nan"]
        assert "rank 1 in parameter '2.weight'" in msg
        assert all(r["unchanged"] for r in results)

    def test_mismatched_rounds_refused_alike_on_every_rank(self, results: list[dict]) -> None:
        msg = results[0]["rounds"]
        assert msg == results[1]["rounds"]
        assert "`round` 1 on rank 0, 5 on rank 1" in msg


def test_a_float64_model_syncs_and_its_nan_is_named(refusals: list[dict]) -> None:
    """The Δ of a parameter that is not float32 is computed in float32 (the one-pass
    kernels on float32 copies): the dense sync still lands on the mean of the replicas (to
    float32's rounding), a NaN names its parameter on both ranks, and encoded syncs leave
    the replicas alike and, at a NaN, every residual as it was."""
    runs = [r["float64"] for r in refusals]
    mean = sum(r["local"] for r in runs) / len(runs)
    for r in runs:
        assert r["after"].dtype == torch.float64
        torch.testing.assert_close(r["after"], mean, rtol=1e-6, atol=1e-6)
    assert torch.equal(runs[0]["after"], runs[1]["after"])
    assert runs[0]["nan"] == runs[1]["nan"]
    assert "rank 1 in parameter '0.bias'" in runs[0]["nan"], runs[0]["nan"]
    # encoded syncs too: the replicas alike after a sync, the residuals as they were
    # after a NaN at the next
    assert runs[0]["encoded"].dtype == torch.float64
    assert torch.equal(runs[0]["encoded"], runs[1]["encoded"])
    assert all(r["residuals kept"] for r in runs)


def test_grad_scaler_skipped_step_still_syncs_in_step(refusals: list[dict]) -> None:
    """A rank whose step GradScaler skipped must sync with the others, not one step later
    (the others would wait for it until the timeout)."""
    results = [r["scaler"] for r in refusals]
    assert [r["stepped"] for r in results] == [6, 5]
    assert all(r["syncs"] == 3 and r["steps"] == 6 for r in results)
    for a, b in zip(results[0]["hashes"], results[1]["hashes"], strict=True):
        assert torch.equal(a, b)


def _rank_fault(
    rank: int, world: int, kind: str, overlap: int, fragments: int = 1
) -> tuple[float, str]:
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    LocalSteps(model, inner, sync_every=2, timeout=3, overlap=overlap, fragments=fragments)
    start = time.monotonic()
    try:
        for step, batch in enumerate(toy_batches(8 * world)[rank::world]):
            if rank == 1 and step == 3:
                if kind == "raise":
                    raise ZeroDivisionError("rank's own bug")
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.monotonic()
            _train(model, inner, [batch])
    except ExchangeError as e:
        return time.monotonic() - start, str(e)
    raise AssertionError("the sync did not fail")


@pytest.mark.parametrize(
    ("kind", "overlap", "fragments"),
    [("raise", False, 1), ("kill", False, 1), ("raise", True, 1), ("raise", 1, 2)],
)
def test_lost_peer_raises_within_the_timeout(kind: str, overlap: int, fragments: int) -> None:
    """A rank that raises (or is killed) between syncs: the other raises a clear error at
    its next sync within the timeout, instead of waiting forever (with overlap, whether the
    round in flight or the next sync's header finds the peer gone; with 2 fragments and τ 1,
    after merging the last round, at the other fragment's sync)."""
    survivor, lost = spawn(_rank_fault, 2, kind, overlap, fragments, timeout=40)
    waited, msg = survivor.get()
    assert waited < 15, waited  # the 3 s timeout, with room for a loaded machine; not 60 s
    assert "timeout 3 s" in msg and ("sync header" in msg or overlap)
    assert lost.error == ("ZeroDivisionError" if kind == "raise" else "Killed")


RESUMES = (
    (0, 1, False),
    (True, 1, False),
    (3, 1, False),
    (1, 1, False),
    (1, 2, False),
    (0, 1, True),
    (3, 1, True),
)
"""(overlap, fragments, dense): the resume is checked without overlap, with τ 4 (``True``), 3
and 1 at sync_every 4, with τ 1 over 2 fragments, and dense (DiLoCo) without and with τ 3."""


def _rank_resume(
    rank: int,
    world: int,
    tmp: str,
    part: str,
    overlap: int = 0,
    fragments: int = 1,
    dense: bool = False,
) -> torch.Tensor:
    """``whole``: 20 steps, saving at 10. ``resumed``: new processes load step 10, do 10.
    With overlap τ 4 or 3, round 2 (of the sync at step 8) is in flight at step 10; with τ 1
    it was merged at step 9, and the carry of step 9 waits. With 2 fragments (syncs at steps
    2, 4, 6, ...: the second fragment at 2, 6, 10, ...), the second's round is in flight."""
    batches = toy_batches(20 * world, seed=2)[rank::world]
    model = toy_model(seed=5)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # saved with compact messages (the default), the 2-fragment run resumes with DL4J's
    compact = part == "whole" or fragments != 2
    sync = LocalSteps(
        model,
        inner,
        sync_every=4,
        decay=0.9,
        timeout=30,
        overlap=overlap,
        fragments=fragments,
        dense=dense,
        compact=compact,
    )
    path = Path(tmp) / f"rank{rank}-overlap{overlap}-{fragments}-{dense}.pt"
    if part == "whole":
        _train(model, inner, batches[:10])
        torch.save(
            {"model": model.state_dict(), "inner": inner.state_dict(), "sync": sync.state_dict()},
            path,
        )
    else:
        state = torch.load(path, weights_only=True)
        saved = state["sync"]
        wrong = {**saved, "world_size": 3}
        with pytest.raises(
            ValueError, match=f"saved by rank {rank} of 3, this is rank {rank} of 2"
        ):
            sync.load_state_dict(wrong)
        wrong = {**saved, "global": 7}  # junk where a list belongs: a ValueError, not len()'s
        with pytest.raises(ValueError, match="`encoders` and `global` must be lists"):
            sync.load_state_dict(wrong)
        tau = sync.overlap
        wrong = {**saved, "settings": {**saved["settings"], "overlap": 2}}
        with pytest.raises(ValueError, match=f"`overlap` 2 saved, {tau} here"):
            sync.load_state_dict(wrong)
        wrong = {**saved, "base": torch.zeros(3)}
        with pytest.raises(ValueError, match=r"`base` .* must be None"):
            sync.load_state_dict(wrong)
        in_flight = tau in (3, 4) or fragments == 2
        assert sync.syncs == 0 and (saved["pending"] is not None) == in_flight
        assert saved["fragment"] == (None if not in_flight else fragments - 1)
        if in_flight:
            wrong = {**saved, "fragment": 2}
            with pytest.raises(ValueError, match=r"`fragment` must be the index"):
                sync.load_state_dict(wrong)
        # with overlap: where the round in flight was sent from, or (τ 1) the carry
        assert (saved["base"] is not None and bool(saved["base"].abs().sum() > 0)) == bool(tau)
        if not overlap:  # a state of format 1 (before overlap) loads as one saved without it
            settings = {
                k: v for k, v in saved["settings"].items() if k not in ("overlap", "fragments")
            }
            old = {k: v for k, v in saved.items() if k not in ("pending", "base", "fragment")}
            sync.load_state_dict({**old, "format": 1, "settings": settings})
        if overlap is True:  # format 3: `lead`, relative to the copy, and overlap a bool
            glob = torch.cat([g.reshape(-1) for g in saved["global"]])
            old = {k: v for k, v in saved.items() if k not in ("base", "fragment")}
            settings = {k: v for k, v in saved["settings"].items() if k != "fragments"}
            lead, settings = saved["base"] - glob, {**settings, "overlap": True}
            sync.load_state_dict({**old, "format": 3, "lead": lead, "settings": settings})
            assert sync._flat.base is not None
            torch.testing.assert_close(sync._flat.base, saved["base"])
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        sync.load_state_dict(saved)
        assert sync.steps == 10 and sync.syncs == 2 * fragments + (fragments - 1)
    _train(model, inner, batches[10:])
    assert sync.syncs == 5 * fragments
    sync.close()  # with overlap: merges round 4
    return flat(model)


@pytest.mark.parametrize(("overlap", "fragments", "dense"), RESUMES)
def test_resumed_run_is_bit_identical(
    two: tuple[list[dict], Path], overlap: int, fragments: int, dense: bool
) -> None:
    """20 steps straight vs 10, save, new processes, load, 10: the same bits (with overlap,
    saved with a round in flight, or a carry; with 2 fragments, saved with compact messages
    and resumed with DL4J's). A dense LocalSteps (no encoders) could load no checkpoint at
    all: ``zip() argument 3 is longer than arguments 1-2``."""
    whole = [r[f"whole {overlap} {fragments} {dense}"] for r in two[0]]
    resumed = [
        r.get() for r in pooled(_rank_resume, 2, str(two[1]), "resumed", overlap, fragments, dense)
    ]
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b)
    # step 20 ends with a sync of the whole model (of the first fragment: the second moved)
    assert torch.equal(whole[0], whole[1]) == (fragments == 1)


# ---------------------------------------------------------------------- in this process


def test_default_outer_lr_looks_through_wrappers() -> None:
    """Adaptive optimizers (their subclasses, any "Adam" by name) get 2.8, others 1.4; a
    wrapper holding the optimizer in ``.optimizer`` (accelerate's) is looked through."""
    params = [nn.Parameter(torch.zeros(2))]

    class FusedAdam(torch.optim.SGD):  # a foreign Adam: by name
        pass

    class Wrapped:  # as accelerate's AcceleratedOptimizer holds it
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    adaptive = [torch.optim.Adam(params), torch.optim.RMSprop(params), FusedAdam(params, lr=1)]
    other = [torch.optim.SGD(params, lr=1, momentum=0.9), torch.optim.LBFGS(params)]
    assert [default_outer_lr(o) for o in adaptive] == [2.8] * 3
    assert [default_outer_lr(o) for o in other] == [1.4] * 2
    assert default_outer_lr(Wrapped(torch.optim.AdamW(params))) == 2.8  # type: ignore[arg-type]
    assert default_outer_lr(Wrapped(other[0])) == 1.4  # type: ignore[arg-type]


def test_bad_arguments_are_refused_naming_the_fix() -> None:
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        ({"sync_every": 0}, ValueError, "`sync_every`"),
        ({"sync_every": 2.0}, ValueError, "`sync_every`"),
        ({"density": 0.0}, ValueError, r"`density` in \(0, 1\]"),
        ({"density": 1.5}, ValueError, r"`density` in \(0, 1\]"),
        ({"density": 0.5}, ValueError, "density=1.0"),
        ({"decay": 1.1}, ValueError, r"`decay` in \[0, 1\]"),
        ({"decay": -0.1}, ValueError, r"`decay` in \[0, 1\]"),
        ({"overlap": "yes"}, TypeError, "`overlap` to be a bool or an int in"),
        ({"overlap": 3}, ValueError, r"`overlap` to be a bool or an int in \[0, sync_every=2\]"),
        ({"compact": 1}, TypeError, "`compact` True or False"),
        ({"fragments": 0}, ValueError, "`fragments` to be an int from 1 to 2"),
        ({"fragments": 3}, ValueError, "`fragments` to be an int from 1 to 2"),
        (
            {"sync_every": 4, "fragments": 2, "overlap": 3},
            ValueError,
            "`overlap` of at most 2 steps with fragments=2",
        ),
    ]
    for kwargs, error, match in cases:
        args = {"sync_every": 2, **kwargs}
        with pytest.raises(error, match=match):
            LocalSteps(model, inner, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model with parameters"):
        LocalSteps(nn.ReLU(), inner, sync_every=2)
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # no group needed
    with pytest.raises(TypeError, match=r"model\.module"):
        LocalSteps(ddp, inner, sync_every=2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        LocalSteps(model, inner, sync_every=2)
    assert not inner._optimizer_step_post_hooks  # nothing left registered


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_with_offload(overlap: bool) -> None:
    """On CUDA, offload keeps the global copy and residuals on the CPU; replicas still agree
    (with overlap, exchanged from the background thread's own stream)."""
    results = [r.get() for r in spawn(_rank_cuda, 2, overlap)]
    assert torch.equal(results[0], results[1])


def _rank_cuda(rank: int, world: int, overlap: bool) -> torch.Tensor:
    model = toy_model().cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = LocalSteps(model, inner, sync_every=2, offload=True, overlap=overlap)
    assert all(g.device.type == "cpu" for g in sync.global_params)
    for x, y in toy_batches(4 * world)[rank::world]:
        inner.zero_grad()
        F.cross_entropy(model(x.cuda()), y.cuda()).backward()
        inner.step()
    assert all(e.residual is not None and e.residual.device.type == "cpu" for e in sync.encoders)
    sync.close()  # with overlap: merges the last round
    return flat(model).cpu()


def _rank_failed_exchange(rank: int, world: int, overlap: bool | int) -> bool:
    """The exchange fails after this rank encoded (a peer lost mid-sync): every encoder is as
    it was before the sync (residual after the decay and the encoded Δ, threshold state), and
    the replica keeps its local move for the sync that follows. With overlap the exchange
    fails in the background, and the next flush (or sync) raises and puts the encoders back;
    the next Δ, from the global copy plus the carry, is round 1's again (with τ = 1 the carry
    itself is as it was, bit for bit: the Δ pass noted the send point elsewhere)."""
    import gradshare.distributed.exchange as module

    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = toy_batches(6)
    exchange = module.exchange_messages

    def lost(*args, round: int, **kwargs):  # type: ignore[no-untyped-def]
        if round >= 1:
            raise ExchangeError("a peer was lost")
        return exchange(*args, round=round, **kwargs)

    module.exchange_messages = lost  # type: ignore[assignment]
    try:
        locals_: list = []
        inner.register_step_post_hook(_recorder(model, locals_))  # before the sync's hook
        sync = LocalSteps(model, inner, sync_every=2, decay=0.9, timeout=10, overlap=overlap)
        _train(model, inner, batches[:3])  # round 0 goes through: the residuals hold something
        before = [e.state_dict() for e in sync.encoders]
        carry = sync._flat.base.clone() if overlap else None  # τ = 1: merged at step 3
        _train(model, inner, batches[3:4])  # round 1
        sync.flush()
    except ExchangeError:
        pass
    else:
        return False
    finally:
        module.exchange_messages = exchange
    after = [e.state_dict() for e in sync.encoders]
    same = all(
        torch.equal(a["residual"], b["residual"])
        and a["algorithm"] == b["algorithm"]
        and a["last"] == b["last"]
        for a, b in zip(before, after, strict=True)
    )
    kept = True
    if overlap is True:  # round 1 was sent from step 2's replica (sync 1 merged nothing) at step 4
        start = torch.cat([g.reshape(-1) for g in sync.global_params]) + sync._flat.base
        kept = torch.allclose(start - flat(model), locals_[1] - locals_[3], atol=1e-6)
    elif overlap:
        kept = torch.equal(sync._flat.base, carry)  # type: ignore[arg-type]
    return same and sync.syncs == 1 and kept


@pytest.mark.parametrize("overlap", [False, True, 1])
def test_a_failed_exchange_leaves_every_encoder_as_it_was(overlap: bool) -> None:
    assert spawn(_rank_failed_exchange, 1, overlap)[0].get()


# ---------------------------------------------------------------------- resize at a restart


def _rank_resize(rank: int, world: int, tmp: str, saved: int, overlap: int) -> dict:
    """Load every rank's state of the world of ``saved`` (none: a fresh start) resized, train
    to the next sync, then save this world's states. With ``overlap`` 1, each save holds the
    carry of a merged round (5 steps at sync_every 2, τ 1: merged at step 5); with 2 (τ =
    sync_every), a round waiting for its merge, with its lead (merged at the load)."""
    model = toy_model(seed=rank)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = LocalSteps(model, inner, sync_every=2, overlap=overlap, timeout=30)
    folder = Path(tmp) / f"overlap{overlap}"
    out: dict = {}
    if saved:
        states = {f"w{saved}-rank{r}.pt": torch.load(folder / f"w{saved}-rank{r}.pt",
                                                      weights_only=True)
                  for r in range(saved)}  # fmt: skip
        with pytest.raises(ValueError, match=f"saved by rank {rank % saved} of {saved}"):
            sync.load_state_dict(states[f"w{saved}-rank{rank % saved}.pt"])  # not silently
        if rank == 0:  # refusals, before anything changes
            one = dict(list(states.items())[:-1])
            with pytest.raises(ValueError, match=r"rank\(s\) \[\d\] missing"):
                sync.load_state_dict(one, resize=True)
            other = {**states, f"w{saved}-rank0.pt": {**states[f"w{saved}-rank0.pt"],
                                                      "syncs": 1}}  # fmt: skip
            with pytest.raises(ValueError, match="differ in `syncs`"):
                sync.load_state_dict(other, resize=True)
        sync.load_state_dict(states, resize=True)
        out["residuals"] = [
            torch.zeros(p.numel(), dtype=torch.float64) if e.residual is None  # a new rank's
            else e.residual.double().clone()
            for e, p in zip(sync.encoders, sync.params, strict=True)
        ]  # fmt: skip
        out["base"] = None if sync._flat.base is None else sync._flat.base.double().clone()
    steps = 5 if overlap == 1 else 4
    batches = toy_batches(20 * world, seed=30 + world)[rank::world]
    start = sync.steps
    _train(model, inner, batches[: steps - start % 2 if saved else steps])
    if saved:
        every = [torch.empty_like(flat(model)) for _ in range(world)]
        dist.all_gather(every, flat(model))
        out["identical"] = all(torch.equal(every[0], f) for f in every)
    torch.save(sync.state_dict(), folder / f"w{world}-rank{rank}.pt")
    sync.close()
    return out


def _owed(states: list[dict], sizes: list[int]) -> list[torch.Tensor]:
    """Per parameter: (1/M) Σ over the M ranks of residual + carry (the base where no round
    waits; where one does, the base is its send point, not a carry), in float64."""
    out = []
    offset = 0
    for k, n in enumerate(sizes):
        total = torch.zeros(n, dtype=torch.float64)
        for s in states:
            r = s["encoders"][k]["residual"]
            total += 0 if r is None else r.double()
            if s["base"] is not None and s.get("pending") is None:
                total += s["base"][offset : offset + n].double()
        out.append(total / len(states))
        offset += n
    return out


@pytest.mark.parametrize("overlap", [0, 1, 2])
def test_resize_three_two_three_conserves_what_is_owed(tmp_path: Path, overlap: int) -> None:
    """3 ranks save; 2 load every file resized, sync, save; 3 load those, sync. Each time,
    per parameter, what the global copy is still owed, (1/M)·Σ (residual + carry), is what
    it was (float64, to float32's rounding), and the replicas are identical after the first
    sync (with τ = sync_every, the round saved in flight is merged at the load)."""
    (tmp_path / f"overlap{overlap}").mkdir()
    sizes = [p.numel() for p in toy_model().parameters()]
    for world, saved in ((3, 0), (2, 3), (3, 2)):
        results = [r.get() for r in pooled(_rank_resize, world, str(tmp_path), saved, overlap)]
        if not saved:
            continue
        folder = tmp_path / f"overlap{overlap}"
        before = _owed([torch.load(folder / f"w{saved}-rank{r}.pt", weights_only=True)
                        for r in range(saved)], sizes)  # fmt: skip
        loaded = [{"encoders": [{"residual": t} for t in r["residuals"]], "base": r["base"],
                   "pending": None} for r in results]  # fmt: skip
        if overlap == 2:  # merged at the load: the carry is what the replica moved since
            loaded = [{**r, "base": None} for r in loaded]
        for k, (want, got) in enumerate(zip(before, _owed(loaded, sizes), strict=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"parameter {k}")
        assert all(r["identical"] for r in results), world
