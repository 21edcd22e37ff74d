"""SharedOptimizer(hierarchical=...): dense inside a node, encoded across nodes.

World 4 as 2 nodes x 2 ranks (spawned gloo ranks on one host; the node size comes from
``LOCAL_WORLD_SIZE`` as torchrun sets it, or is given). The contract: replicas stay
bit-identical, every rank of a node holds the same node residual, the result is the arithmetic
of "sum the node's updates, encode with error feedback, sum the node messages" exactly, the
books balance per node (Σ node updates = Σ node messages decoded + node residual), and a bad
message or a failing rank stops every rank.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from torch.nn import functional as F

from gradshare import AdaptiveThreshold, FixedThreshold, SharedOptimizer
from gradshare.app.datasets import mlp

from toys import flat, toy_batches
from world import pooled, spawn

T = 17 / 64
"""A threshold no dyadic sum of the exact test can tie with (a multiple of 1/64, odd)."""


def _torchrun_env(rank: int, node_size: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(node_size), LOCAL_RANK=str(rank % node_size))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _rank_train(rank: int, world: int, hierarchical: bool | int, steps: int) -> dict:
    if hierarchical is True:
        _torchrun_env(rank, 2)
    model = mlp(10, 3, hidden=16, seed=rank)  # rank 0's parameters must win
    opt = SharedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        threshold=AdaptiveThreshold(1e-3),
        hierarchical=hierarchical,
    )
    hashes, residuals = [_digest(flat(model))], []
    for x, y in toy_batches(steps * world)[rank::world]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        hashes.append(_digest(flat(model)))
        residuals.append(_digest(opt.encoder.residual))  # type: ignore[union-attr,arg-type]
    return {
        "hashes": hashes,
        "residuals": residuals,
        "bytes": opt.bytes_sent,
        "mode": opt.state_dict()["gradshare"]["hierarchical"],
    }


def _grads(numel: int, steps: int, world: int, sparse: bool) -> torch.Tensor:
    """[step, rank, element] gradients k/32, |k| <= 12: every sum below is exact in float32."""
    g = torch.Generator().manual_seed(7)
    k = torch.randint(-12, 13, (steps, world, numel), generator=g).float()
    if sparse:
        k *= torch.rand(steps, world, numel, generator=g) < 0.02
    return k / 32


def _encode(x: torch.Tensor, t: float) -> torch.Tensor:
    """What one message takes out of residual ``x`` (DL4J's rules, float64, exact here)."""
    crossed = x.abs() >= t
    count = int(crossed.sum())
    if count < 2:
        return torch.zeros_like(x)
    sent = torch.where(crossed, t * x.sign(), torch.zeros_like(x))
    if count + 4 >= x.numel() // 16:  # a bitmap: also -t/2 for x in (-t, -t/2]
        sent = torch.where(~crossed & (x <= -t / 2), torch.full_like(x, -t / 2), sent)
    return sent


def _rank_exact(rank: int, world: int, numel: int, sparse: bool, reduction: str) -> dict:
    steps, node_size = 3, 2
    grads = _grads(numel, steps, world, sparse)
    p = torch.nn.Parameter(torch.zeros(numel))
    opt = SharedOptimizer(
        torch.optim.SGD([p], lr=1.0),
        threshold=FixedThreshold(T),
        hierarchical=node_size,
        reduction=reduction,  # type: ignore[arg-type]
    )
    nodes = world // node_size
    residual = torch.zeros(nodes, numel, dtype=torch.float64)
    expected = torch.zeros(numel, dtype=torch.float64)
    totals = torch.zeros(nodes, numel, dtype=torch.float64)  # Σ of each node's updates
    decoded = torch.zeros(nodes, numel, dtype=torch.float64)  # Σ of each node's messages
    for s in range(steps):
        p.grad = grads[s, rank].clone()
        opt.step()
        for n in range(nodes):
            update = grads[s, n * node_size : (n + 1) * node_size].double().sum(0)
            totals[n] += update
            sent = _encode(residual[n] + update, T)
            residual[n] += update - sent
            decoded[n] += sent
        expected = -decoded.sum(0) / (world if reduction == "mean" else 1)
    node = rank // node_size
    mine = opt.encoder.residual.double()  # type: ignore[union-attr]
    return {
        "params": torch.equal(p.detach().double(), expected),
        "residual": torch.equal(mine, residual[node]),
        "conserved": torch.equal(totals[node], decoded[node] + mine),
        "moved": int((p.detach() != 0).sum()),
        "format": opt.last_stats.format,  # type: ignore[union-attr]
    }


def _rank_corrupt(rank: int, world: int) -> str:
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), threshold=FixedThreshold(1e-4), hierarchical=2
    )
    before = flat(model)
    residual = None
    if rank == 2:  # node 1's leader sends a bad message
        encode = opt.encoder.encode  # type: ignore[union-attr]

        def corrupt(update: torch.Tensor, iteration: int, *a: int, **kw: bool) -> torch.Tensor:
            nonlocal residual
            message = encode(update, iteration, *a, **kw)
            assert message is not None
            residual = opt.encoder.residual.clone()  # type: ignore[union-attr]
            message[-1] = message.numel() * 1000  # an index far past N
            return message

        opt.encoder.encode = corrupt  # type: ignore[union-attr,method-assign]
    x, y = toy_batches(4)[rank]
    F.cross_entropy(model(x), y).backward()
    try:
        opt.step()
    except Exception as e:
        assert torch.equal(flat(model), before)  # nothing was applied
        if residual is not None:  # a corrupted message is not taken back
            assert torch.equal(opt.encoder.residual, residual)  # type: ignore[union-attr]
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rank_failure(rank: int, world: int) -> str:
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hierarchical=2, timeout=10)
    x, y = toy_batches(4)[rank]
    if rank == 3:
        x = x * float("nan")
    F.cross_entropy(model(x), y).backward()
    try:
        opt.step()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rank_exact_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    return [_rank_exact(rank, world, *case) for case in cases]


def _rank_train_modes(rank: int, world: int, modes: list, steps: int) -> list[dict]:
    return [_rank_train(rank, world, mode, steps) for mode in modes]


def _rank_refusals(rank: int, world: int, cases: list[str]) -> list[str]:
    return [_refusal(rank, case) for case in cases]


def _refusal(rank: int, case: str) -> str:
    model = mlp(10, 3, hidden=16, seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    try:
        if case == "uneven":
            SharedOptimizer(sgd, hierarchical=2)
        elif case == "not consecutive":
            os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank // 2))
            SharedOptimizer(sgd, hierarchical=True)
        elif case == "disagrees":
            os.environ.update(LOCAL_WORLD_SIZE="4", LOCAL_RANK=str(rank))
            SharedOptimizer(sgd, hierarchical=2)
        elif case == "no env":
            SharedOptimizer(sgd, hierarchical=True)
        elif case == "checkpoint":
            saved = SharedOptimizer(sgd, hierarchical=2).state_dict()
            SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).load_state_dict(saved)
    except ValueError as e:
        return str(e)
    return "no error"


class TestHierarchical:
    def test_replicas_and_node_residuals_bit_identical(self) -> None:
        """Node sizes from LOCAL_WORLD_SIZE (``True``) and given (``2``), one after the other."""
        by_rank = [r.get() for r in pooled(_rank_train_modes, 4, [True, 2], 8)]
        for results in zip(*by_rank, strict=True):
            self._check_train(list(results))

    @staticmethod
    def _check_train(results: list[dict]) -> None:
        for r in results[1:]:
            assert r["hashes"] == results[0]["hashes"]
        assert len(set(results[0]["hashes"])) == 9  # it trained, every step
        for node in (results[:2], results[2:]):
            assert node[0]["residuals"] == node[1]["residuals"]
        assert results[0]["residuals"] != results[2]["residuals"]  # two books
        assert results[0]["bytes"] > 0 and results[2]["bytes"] > 0  # leaders sent
        assert results[1]["bytes"] == results[3]["bytes"] == 0
        assert {r["mode"] for r in results} == {2}

    def test_equals_the_arithmetic_and_conserves_per_node(self) -> None:
        """Exact dyadic updates and a fixed threshold: the parameters are -Σ over nodes of
        each node's messages (/ 4 with "mean"), each node's residual is its own books; in
        bitmaps (dense updates) and sparse messages."""
        cases = [(64, False, "sum"), (4096, True, "sum"), (64, False, "mean")]
        formats = ["bitmap", "sparse", "bitmap"]
        for r in pooled(_rank_exact_cases, 4, cases):
            for out, fmt in zip(r.get(), formats, strict=True):
                assert out["params"] and out["residual"] and out["conserved"], out
                assert out["moved"] > 0 and out["format"] == fmt

    def test_bad_message_fails_on_every_rank(self) -> None:
        for r in spawn(_rank_corrupt, 4):
            assert r.get().startswith("MessageError: Message from node 1 is invalid"), r.get()

    def test_failing_rank_stops_every_rank(self) -> None:
        """Rank 3's update is not finite: its node peer, the other node and its leader raise,
        naming global ranks (not the rank within the node or the leaders' group)."""
        out = [r.get() for r in spawn(_rank_failure, 4)]
        assert out[3].startswith("NonFiniteUpdate") and "non-finite" in out[3]  # a ValueError
        assert out[2].startswith("ExchangeError") and "rank(s) [3] failed" in out[2]
        assert out[0].startswith("ExchangeError") and "rank(s) [2] failed" in out[0]
        assert out[1].startswith("ExchangeError") and "leader (rank 0)" in out[1]

    @pytest.mark.parametrize(
        ("world", "cases", "says"),
        [
            (3, ["uneven"], ["whole number of equal nodes"]),
            (
                4,
                ["not consecutive", "no env", "checkpoint", "disagrees"],
                [
                    "consecutive",
                    "LOCAL_WORLD_SIZE",
                    "hierarchical=2",
                    "`hierarchical=2` disagrees with LOCAL_WORLD_SIZE=4",
                ],
            ),
        ],
    )
    def test_refusals(self, world: int, cases: list[str], says: list[str]) -> None:
        """Every rank refuses alike (none is left waiting for the others)."""
        for r in pooled(_rank_refusals, world, cases):
            for got, want in zip(r.get(), says, strict=True):
                assert want in got, got
