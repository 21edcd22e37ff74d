"""The DDP communication hook: conservation against plain DDP, accuracy, per-rank checkpoints."""

from __future__ import annotations

import io
import math
import pickle
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare.distributed.ddp_hook.hook as hook_module
import gradshare.distributed.exchange as exchange_module
from gradshare import (
    AdaptiveThreshold,
    Encoder,
    FixedThreshold,
    ThresholdHookState,
    register_threshold_hook,
    threshold_hook,
)
from gradshare.app.datasets import digits, minibatches, mlp
from gradshare.codec import MessageError, decode_, multipart

from toys import logged, toy_batches
from world import pooled, spawn


def _rank_conservation(rank: int, world: int, steps: int) -> float:
    """Σ hook results = Σ true mean gradients - mean of the ranks' residuals, per parameter."""
    hooked, plain = DDP(mlp(10, 3, hidden=32, seed=0)), DDP(mlp(10, 3, hidden=32, seed=0))
    state = ThresholdHookState(threshold=AdaptiveThreshold(1e-2))
    hooked.register_comm_hook(state, threshold_hook)
    got = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in hooked.named_parameters()}
    true = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in plain.named_parameters()}
    for x, y in toy_batches(steps * world)[rank::world]:  # no optimizer: parameters stay put
        for model, total in ((hooked, got), (plain, true)):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for n, p in model.named_parameters():
                total[n] += p.grad.double()
    gap = 0.0
    for n, p in hooked.named_parameters():
        residual = state.encoders[state._runtime.keys[id(p)]].residual.double().clone()
        dist.all_reduce(residual)
        residual /= world
        gap = max(gap, float((got[n] - (true[n] - residual.view_as(p))).abs().max()))
    assert state.iteration == steps and any(
        float(e.residual.abs().max()) > 0 for e in state.encoders.values()
    )
    return gap


def _rank_digits(rank: int, world: int, epochs: int) -> dict:
    split = digits(seed=0)
    out = {}
    for mode in ("plain", "hook"):
        model = DDP(mlp(64, 10, hidden=256, seed=0))
        state = None
        if mode == "hook":
            state = ThresholdHookState(threshold=AdaptiveThreshold(1e-3))
            model.register_comm_hook(state, threshold_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(epochs):
            batches = minibatches(split.x_train, split.y_train, 32, seed=epoch)
            for x, y in batches[: len(batches) // world * world][rank::world]:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        with torch.no_grad():
            out[mode] = float((model(split.x_test).argmax(1) == split.y_test).float().mean())
        if state is not None:
            out["ratio"] = state.dense_bytes / state.bytes_sent
    return out


def _train(model: DDP, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _resumed(model, opt, state, make):  # type: ignore[no-untyped-def]
    """A fresh ``make()`` (model, optimizer, hook state) restored from a checkpoint of
    ``model``, ``opt`` and ``state`` saved through a buffer; returns its model and optimizer."""
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf
    )
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed, resumed_opt, resumed_state = make()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    resumed_state.load_state_dict(saved["hook"])
    return resumed, resumed_opt


def _rank_checkpoint(rank: int, world: int) -> bool:
    batches = toy_batches(12 * world)[rank::world]

    def make() -> tuple[DDP, torch.optim.Optimizer, ThresholdHookState]:
        model = DDP(mlp(10, 3, hidden=16, seed=0))
        state = ThresholdHookState(dist.new_group(list(range(world))))
        model.register_comm_hook(state, threshold_hook)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2), state

    whole, whole_opt, _ = make()
    _train(whole, whole_opt, batches)
    first, first_opt, first_state = make()
    _train(first, first_opt, batches[:6])
    unpickled = pickle.loads(pickle.dumps(first_state))  # the process group is left out
    assert unpickled.process_group is None and unpickled._runtime.group is None
    assert unpickled.iteration == first_state.iteration and unpickled._runtime.first_pass
    for i, enc in first_state.encoders.items():
        assert torch.equal(unpickled.encoders[i].residual, enc.residual)
    resumed, resumed_opt = _resumed(first, first_opt, first_state, make)
    _train(resumed, resumed_opt, batches[6:])
    return all(
        torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters(), strict=True)
    )


def _rank_logged(rank: int, world: int) -> list[tuple[str, str]]:
    """What the hook logs, DEBUG included, in two iterations (one exact, one encoded)."""
    with logged() as said:
        model = DDP(mlp(10, 3, hidden=8, seed=0))
        model.register_comm_hook(ThresholdHookState(momentum=0.5), threshold_hook)
        for x, y in toy_batches(2):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
    return said


class TestThresholdHook:
    def test_logs_its_configuration_and_each_exchange_at_debug(self) -> None:
        """The hook said its configuration at its first exchange, and nothing of the
        exchanges: one INFO line when its state is built, a DEBUG line a bucket."""
        for said in (r.get() for r in pooled(_rank_logged, 2)):
            hook = [(level, m) for level, m in said if m.startswith("threshold hook")]
            assert [level for level, _ in hook] == ["INFO", "DEBUG", "INFO", "DEBUG"], said
            assert "1 exact iteration(s), momentum 0.5, reduction mean" in hook[0][1], said
            assert hook[1][1].startswith("threshold hook: iteration 0, bucket 0 sent "), said

    def test_conserves_against_plain_ddp(self) -> None:
        for world in (2, 3):
            for r in pooled(_rank_conservation, world, 8):
                assert r.get() < 1e-5

    def test_digits_accuracy_within_1_5_points_of_plain_ddp(self) -> None:
        results = [r.get() for r in pooled(_rank_digits, 2, 10)]
        assert [r["hook"] for r in results] == [results[0]["hook"]] * 2  # replicas agree
        res = results[0]
        assert res["plain"] > 0.9
        assert res["hook"] >= res["plain"] - 0.015, res
        assert res["ratio"] > 10

    def test_per_rank_checkpoint_resumes_bit_for_bit(self) -> None:
        assert all(r.get() for r in pooled(_rank_checkpoint, 2))


def _several_buckets() -> DDP:
    """A model of 2.1 MB in buckets of 0.5 MB: several buckets in every pass."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    return DDP(net, bucket_cap_mb=0.5)


def _rank_overlap(rank: int, world: int) -> dict:
    model = _several_buckets()
    state = ThresholdHookState(timeout=30)
    done_at_return: list[bool] = []
    indices: set[int] = set()

    def hook(hook_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks names
        future = threshold_hook(hook_state, bucket)
        done_at_return.append(future.done())
        indices.add(bucket.index())
        return future

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(16, 256, generator=g)).square().mean()
        if rank == 1:
            time.sleep(1.0)  # rank 0's backward runs while rank 1 has not started its own
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"done": done_at_return, "buckets": len(indices), "params": flat}


def _rank_hook_fault(rank: int, world: int) -> str:
    model = _several_buckets()
    register_threshold_hook(model, start_iter=0, timeout=30)
    loss = model(torch.randn(16, 256)).square().mean()
    if rank == 1:
        loss = loss * float("nan")
    try:
        loss.backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class TestOverlap:
    def test_hook_returns_before_the_exchange_completes(self) -> None:
        """Bucket k is exchanged in the background while backward goes on: with its peer
        still asleep, none of rank 0's futures is complete when the hook returns, and the
        replicas still end bit-identical."""
        zero, one = (r.get() for r in pooled(_rank_overlap, 2))
        assert zero["buckets"] > 1
        assert zero["done"] and not any(zero["done"]), zero["done"]
        assert torch.equal(zero["params"], one["params"])

    def test_failed_encode_fails_backward_on_every_rank_naming_the_rank(self) -> None:
        zero, one = (r.get() for r in spawn(_rank_hook_fault, 2))
        assert "non-finite" in one, one
        assert "Rank 0" in zero and "rank(s) [1] failed" in zero, zero


def _rank_other_rank_state(rank: int, world: int) -> str:
    state = ThresholdHookState()
    saved = state.state_dict()
    assert (saved["world_size"], saved["rank"]) == (world, rank)
    saved["rank"] = 1 - rank
    try:
        ThresholdHookState().load_state_dict(saved)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_hook_state_of_another_rank_is_refused() -> None:
    for r in pooled(_rank_other_rank_state, 2):
        assert "saved by rank" in r.get()


def _net(seed: int = 0) -> nn.Module:
    """A model of about 9,500 parameters in 8 tensors: one bucket in a DDP's first iteration,
    three after DDP rebuilds them (``bucket_cap_mb=0.01``)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 4),
    )


def _batches(rank: int, world: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(count * world)
    ]
    return data[rank::world]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rank_resume_several_buckets(rank: int, world: int, steps: int) -> list[bool]:
    batches = _batches(rank, world, steps)
    same = []
    for momentum in (0.0, 0.9):

        def make(m: float = momentum) -> tuple[DDP, torch.optim.Optimizer, ThresholdHookState]:
            model = DDP(_net(), bucket_cap_mb=0.01)
            state = register_threshold_hook(model, threshold=AdaptiveThreshold(1e-2), momentum=m)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 - m)
            return model, opt, state

        whole, whole_opt, _ = make()
        _train(whole, whole_opt, batches)
        first, first_opt, first_state = make()
        _train(first, first_opt, batches[: steps // 2])
        resumed, resumed_opt = _resumed(first, first_opt, first_state, make)
        del first, first_opt, first_state
        _train(resumed, resumed_opt, batches[steps // 2 :])
        same.append(torch.equal(_flat(whole), _flat(resumed)))
    return same


def _rank_replicas(rank: int, world: int, steps: int) -> dict:
    batches = _batches(rank, world, steps)
    out: dict = {}
    for name, kwargs in [
        ("default", {}),
        ("zero", {"momentum": 0.0}),
        ("dgc", {"momentum": 0.9}),
        ("mean", {"magnitude": "mean"}),
    ]:
        model = DDP(_net(), bucket_cap_mb=0.01)
        buckets: set[int] = set()

        def hook(hook_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks names
            buckets.add(bucket.index())  # noqa: B023 - called within this iteration
            return threshold_hook(hook_state, bucket)

        state = ThresholdHookState(threshold=AdaptiveThreshold(1e-2), **kwargs)
        model.register_comm_hook(state, hook)
        _train(model, torch.optim.SGD(model.parameters(), lr=0.05), batches)
        out[name] = _flat(model)
        out["buckets"] = len(buckets)
    return out


class TestPerParameterState:
    """Every residual, threshold and velocity belongs to one parameter, whatever bucket it
    travels in; a bucket's message is its parameters' messages back to back."""

    def test_resume_with_several_buckets_is_bit_for_bit(self) -> None:
        """A fresh DDP's first iteration lays the buckets out otherwise than the rebuilt ones
        (here one bucket, then three): threshold state kept per bucket went to other
        parameters on resume and the runs parted. 20 steps straight equal 10 + checkpoint +
        10, bit for bit, with and without momentum correction."""
        for r in pooled(_rank_resume_several_buckets, 2, 20):
            assert r.get() == [True, True]

    def test_replicas_agree_with_several_buckets_and_momentum_0_is_the_default(self) -> None:
        """Also with momentum correction and with the mean magnitude in the headers."""
        for world in (2, 3):
            results = [r.get() for r in pooled(_rank_replicas, world, 6)]
            assert results[0]["buckets"] >= 3
            for name in ("default", "dgc", "mean"):
                assert all(torch.equal(r[name], results[0][name]) for r in results), name
            assert torch.equal(results[0]["zero"], results[0]["default"])
            assert not torch.equal(results[0]["dgc"], results[0]["default"])
            assert not torch.equal(results[0]["mean"], results[0]["default"])


def _rank_own_conservation(rank: int, world: int, steps: int) -> float:
    """Per parameter: Σ local gradients fed = Σ this rank's own decoded pieces + residual."""
    model, local = DDP(_net(), bucket_cap_mb=0.01), _net()  # no optimizer: both stay put
    state = register_threshold_hook(model, threshold=AdaptiveThreshold(1e-2), start_iter=0)
    own = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in local.named_parameters()}
    fed = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in local.named_parameters()}
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    split = exchange_module.multipart.split_message

    def spy(message, sizes, name, labels):  # type: ignore[no-untyped-def]
        pieces = split(message, sizes, name, labels)
        if name == f"rank {rank}":
            by_place = {place: key for key, place in state._runtime.keys.items()}
            for place, n, piece in zip(labels, sizes, pieces, strict=True):
                if piece is not None:
                    decoded = decode_(piece, torch.zeros(n, dtype=torch.float64))
                    own[names[by_place[place]]] += decoded
        return pieces

    exchange_module.multipart.split_message = spy  # type: ignore[assignment]
    for x, y in _batches(rank, world, steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        local.zero_grad()
        F.cross_entropy(local(x), y).backward()
        for n, p in local.named_parameters():
            fed[n] += p.grad.reshape(-1).double()
    exchange_module.multipart.split_message = split  # type: ignore[assignment]
    gap = 0.0
    for p in model.parameters():
        residual = state.encoders[state._runtime.keys[id(p)]].residual.double()  # type: ignore[union-attr]
        n = names[id(p)]
        assert float(own[n].abs().max()) > 0, n  # every parameter sent something
        gap = max(gap, float((own[n] + residual - fed[n]).abs().max()))
    return gap


def _rank_bad_concatenation(rank: int, world: int) -> dict:
    model, local = DDP(_net(), bucket_cap_mb=0.01), _net()
    state = register_threshold_hook(model, threshold=FixedThreshold(1e-3), start_iter=0, timeout=30)
    concatenate, decode_sum = hook_module._concatenate, hook_module.codec.decode_sum_
    decoded: list[int] = []

    def bad(*args):  # type: ignore[no-untyped-def]
        message = concatenate(*args)
        return torch.cat([message, message[-1:]])  # one word left over

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        decoded.append(1)
        return decode_sum(*args, **kwargs)

    if rank == 1:
        hook_module._concatenate = bad  # type: ignore[assignment]
    hook_module.codec.decode_sum_ = counting  # type: ignore[assignment]
    x, y = _batches(rank, world, 1)[0]
    error = "no error"
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    hook_module.codec.decode_sum_ = decode_sum  # type: ignore[assignment]
    hook_module._concatenate = concatenate  # type: ignore[assignment]
    F.cross_entropy(local(x), y).backward()
    # every rank's own message went back: each residual holds the whole local gradient
    params = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    gap = 0.0
    for n, p in local.named_parameters():
        residual = state.encoders[state._runtime.keys[id(params[n])]].residual
        assert residual is not None
        gap = max(gap, float((residual - p.grad.reshape(-1)).abs().max()))
    return {"error": error, "decoded": len(decoded), "gap": gap}


def _rank_two_scales(rank: int, world: int, steps: int) -> list[float]:
    class TwoScales(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Parameter(torch.zeros(64))
            self.small = nn.Parameter(torch.zeros(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.big * x).sum() + 1e-6 * (self.small * x).sum()

    model = DDP(TwoScales())
    state = register_threshold_hook(model, threshold=AdaptiveThreshold(1e-3), start_iter=0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model.zero_grad()
        model(torch.rand(64, generator=g)).backward()
    inner = model.module
    keys = state._runtime.keys
    return [state.last_stats[keys[id(p)]].threshold for p in (inner.big, inner.small)]


class _TwoLinear(nn.Module):
    """``(w * gw).sum() + (v * gv).sum() + (s * gs).sum()``: the gradients are the inputs,
    exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(24))  # a bitmap every step (24 // 16 words fit)
        self.v = nn.Parameter(torch.zeros(256))  # sparse: K + 4 < 256 // 16 for K <= 11
        self.s = nn.Parameter(torch.zeros(3))  # under 16 elements: sent whole

    def forward(self, gw: torch.Tensor, gv: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
        return (self.w * gw).sum() + (self.v * gv).sum() + (self.s * gs).sum()


def _rank_velocity(rank: int, world: int, steps: int) -> bool:
    """The velocity and residual after each step equal a hand computation of DGC; a
    parameter sent whole keeps its whole velocity (momentum SGD on the mean) and no
    residual."""
    m, t = 0.9, 1.0
    model = DDP(_TwoLinear())
    state = register_threshold_hook(model, threshold=FixedThreshold(t), start_iter=0, momentum=m)
    u = {"w": torch.zeros(24), "v": torch.zeros(256), "s": torch.zeros(3)}
    r = {"w": torch.zeros(24), "v": torch.zeros(256), "s": torch.zeros(3)}
    g = torch.Generator().manual_seed(rank)
    formats = set()
    for _ in range(steps):
        grads = {
            "w": torch.randint(0, 3, (24,), generator=g) * 0.25,
            "v": (torch.rand(256, generator=g) < 0.02) * 0.75,
            "s": torch.randn(3, generator=g),
        }
        model.zero_grad()
        model(grads["w"], grads["v"], grads["s"]).backward()
        for name in ("w", "v", "s"):
            u[name] = u[name] * m + grads[name]
            r[name] = r[name] + u[name]
            # gradients >= 0: no half-negative bitmap codes; "s" is sent whole
            sent = r[name].abs() >= t if name != "s" else torch.ones(3, dtype=torch.bool)
            r[name] = torch.where(sent, r[name] - (t if name != "s" else r[name]), r[name])
            u[name] = torch.where(sent, 0.0, u[name]) if name != "s" else u[name]
            place = state._runtime.keys[id(getattr(model.module, name))]
            formats.add(state.last_stats[place].format)
            residual = state.encoders[place].residual
            assert residual is not None
            if not (
                torch.equal(state.velocities[place], u[name]) and torch.equal(residual, r[name])
            ):
                return False
    assert formats >= {"bitmap", "sparse", "dense"}, formats
    return True


class TestMessagesAndMomentum:
    def test_every_rank_conserves_per_parameter(self) -> None:
        """Σ local gradients fed = Σ the rank's own decoded pieces + its residual, for every
        parameter of every bucket."""
        for r in pooled(_rank_own_conservation, 2, 8):
            assert r.get() < 1e-5

    def test_bad_concatenation_fails_every_rank_naming_it_and_writes_nothing(self) -> None:
        for r in spawn(_rank_bad_concatenation, 2):
            res = r.get()
            assert "Message from rank 1" in res["error"], res
            assert "left over" in res["error"], res
            assert res["decoded"] == 0 and res["gap"] < 1e-6, res

    def test_parameters_of_different_scales_get_their_own_thresholds(self) -> None:
        """One threshold per parameter tensor: the large gradients' threshold rises, the
        tiny ones' falls, within one bucket."""
        for r in pooled(_rank_two_scales, 2, 8):
            big, small = r.get()
            assert big > 1e-3 > small, (big, small)

    def test_velocity_is_momentum_corrected_and_masked(self) -> None:
        for r in pooled(_rank_velocity, 2, 6):
            assert r.get()


class TestSplit:
    """A rank's message is cut into its parameters' pieces by their headers; any fault is a
    MessageError naming the rank and the parameter, found before anything is decoded."""

    params: ClassVar = [((0, 0), 400), ((0, 1), 8), ((0, 2), 100)]

    @classmethod
    def message(cls) -> torch.Tensor:
        sparse = Encoder(FixedThreshold(1.0)).encode(
            torch.zeros(400).index_fill_(0, torch.tensor([3, 50, 399]), 2.0), 0
        )
        bitmap = Encoder(FixedThreshold(1.0)).encode(torch.full((8,), 2.0), 0)
        assert sparse is not None and bitmap is not None
        empty = multipart.empty_message(100, 1.0, torch.device("cpu"))
        return torch.cat([sparse, bitmap, empty])

    @classmethod
    def split(cls, message: torch.Tensor) -> list:
        sizes, places = [n for _, n in cls.params], [p for p, _ in cls.params]
        return multipart.split_message(message, sizes, "rank 1", places)

    def test_pieces_in_order_empty_one_as_none(self) -> None:
        pieces = self.split(self.message())
        assert pieces[0] is not None and pieces[0][3] == 0 and pieces[0].numel() == 4 + 3
        assert pieces[1] is not None and pieces[1][3] == 1 and pieces[2] is None

    @pytest.mark.parametrize(
        ("cut", "match"),
        [
            (lambda m: m[:-1], "ends at word"),
            (lambda m: m[:-5], "past the message's end"),
            (lambda m: torch.cat([m, m[:2]]), "left over"),
            (lambda m: torch.cat([m[:7], m[7:9] + 1, m[9:]]), "N = 9"),
        ],
    )
    def test_faults_name_the_rank_and_parameter(self, cut, match) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(MessageError, match=match) as info:
            self.split(cut(self.message()))
        assert "rank 1" in str(info.value)


def _fixed(momentum: float) -> ThresholdHookState:
    return ThresholdHookState(momentum=momentum, threshold=FixedThreshold(1.0))


class TestCheckpointChecks:
    """A hook state is checked whole before anything loads; a parameter whose size differs
    from its saved residual is refused when it arrives, before anything changes."""

    @staticmethod
    def _saved(momentum: float = 0.9) -> dict:
        state = _fixed(momentum)
        encoders = state.parameters.for_params([((0, 0), 2), ((1, 0), 3)], torch.device("cpu"))
        encoders[0].encode(torch.tensor([0.5, 2.5]), 0)
        encoders[1].encode(torch.tensor([1.5, 0.25, -3.0]), 0)
        if momentum:
            state.velocities[(0, 0)] = torch.tensor([0.5, 0.0])
        return state.state_dict()

    def test_round_trip(self) -> None:
        restored = _fixed(0.9)
        restored.load_state_dict(self._saved())
        assert restored.encoders[(1, 0)].residual.tolist() == [0.5, 0.25, -2.0]  # type: ignore[union-attr]
        assert restored.velocities[(0, 0)].tolist() == [0.5, 0.0]

    def test_parameter_of_another_size_is_refused_before_anything_changes(self) -> None:
        restored = _fixed(0.9)
        restored.load_state_dict(self._saved())
        with pytest.raises(ValueError, match="another model"):
            restored.parameters.for_params([((1, 0), 3), ((0, 0), 4)], torch.device("cpu"))
        assert set(restored.encoders) == {(0, 0), (1, 0)}

    @pytest.mark.parametrize(
        ("corrupt", "match"),
        [
            (
                lambda s: s["encoders"]["0,0"].update(residual=torch.tensor([1.0, math.nan])),
                "non-finite",
            ),
            (
                lambda s: s["velocities"].update({"1,0": torch.tensor([math.inf, 0.0, 0.0])}),
                "non-finite",
            ),
            (lambda s: s["velocities"].update({"0,0": torch.zeros(3)}), "has 3 elements"),
            (lambda s: s.update(layouts={}, loose={}), "older hook format"),
            (lambda s: s["encoders"].update({"zero": s["encoders"]["0,0"]}), "bucket,position"),
        ],
    )
    def test_corrupted_state_refused_whole(self, corrupt, match) -> None:  # type: ignore[no-untyped-def]
        saved = self._saved()
        corrupt(saved)
        restored = _fixed(0.9)
        with pytest.raises(ValueError, match=match):
            restored.load_state_dict(saved)
        assert restored.encoders == {} and restored.velocities == {} and not restored.iteration

    def test_velocities_into_a_state_without_momentum_are_refused(self) -> None:
        with pytest.raises(ValueError, match="momentum=0"):
            _fixed(0.0).load_state_dict(self._saved())
        _fixed(0.5).load_state_dict(self._saved(momentum=0.0))

    @pytest.mark.parametrize("momentum", [-0.1, 1.0, math.nan, True, "0.9"])
    def test_momentum_out_of_range_is_refused(self, momentum) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(ValueError, match="momentum"):
            ThresholdHookState(momentum=momentum)


def test_a_hook_state_pickled_by_gradshare_0_1_still_loads() -> None:
    """gradshare 0.1 pickled the state as ``gradshare.ddp_hook.ThresholdHookState`` (with its
    encoders as ``gradshare.encoder.Encoder``): the old module paths still resolve, to the same
    classes. The file was written by 0.1 after 3 steps of a 2-layer model, momentum 0.5."""
    with (Path(__file__).parent / "data" / "hook_state_0.1.pkl").open("rb") as f:
        with pytest.warns(DeprecationWarning, match="gradshare.ddp_hook"):
            state = pickle.load(f)
    assert type(state) is ThresholdHookState and state.iteration == 3 and state.momentum == 0.5
    assert state.process_group is None and state._runtime.group is None
    assert sorted(state.encoders) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    residual = state.encoders[(0, 3)].residual
    assert residual is not None
    assert residual.tolist() == [0.5564457178115845, 0.10945340245962143]
    assert state.state_dict()["encoders"]["0,3"]["algorithm"]["last_threshold"] == pytest.approx(
        0.0010352649730138227, rel=0, abs=0
    )
