"""``load_state_dict`` is all or nothing, for SharedOptimizer, the DDP hook and LocalSteps.

The contract: a malformed state (each mutation of a valid one below) is refused with a
``ValueError`` naming the field, and nothing changes: every tensor of the wrapped optimizer's
state, every residual and velocity, the threshold states and the counters are as before.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradshare import FixedThreshold, LocalSteps, SharedOptimizer, register_threshold_hook

from toys import toy_batches, toy_model
from world import spawn

Mutation = Callable[[dict[str, Any]], Any]


def _set(path: tuple, value: Any) -> Mutation:
    def mutate(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value

    return mutate


def _residual(path: tuple, change: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def mutate(state: dict[str, Any]) -> None:
        for key in path:
            state = state[key]
        state["residual"] = change(state["residual"])

    return mutate


def _junk_thresholds(path: tuple) -> dict[str, Mutation]:
    return {
        f"last_threshold {v!r}": _set((*path, "algorithm", "last_threshold"), v)
        for v in ("abc", float("nan"), -1.0, 1e300)
    }


def _junk_residuals(path: tuple) -> dict[str, Mutation]:
    return {
        "residual too long": _residual(path, lambda r: torch.cat([r, r[:1]])),
        "int64 residual": _residual(path, lambda r: r.round().long()),
        "2-D residual": _residual(path, lambda r: r[None]),
    }


def _snapshot(tensors: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(tensors)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # nan


def _fuzz(
    valid: dict[str, Any],
    mutations: dict[str, Mutation],
    load: Callable[[dict[str, Any]], None],
    now: Callable[[], dict[str, Any]],
) -> dict[str, str]:
    """Each mutation of ``valid`` loaded: what each raised ("changed!" if anything moved)."""
    out = {}
    for name, mutate in mutations.items():
        state = copy.deepcopy(valid)
        mutate(state)
        before = _snapshot(now())
        try:
            load(state)
            out[name] = "accepted"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
        if not _same(before, now()):
            out[name] = f"changed! {out[name]}"
    return out


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _rank_shared(rank: int, world: int) -> dict[str, str]:
    model = toy_model()
    opt = SharedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), threshold=FixedThreshold(1e-3)
    )
    batches = toy_batches(5)
    _train(model, opt, batches[:3])
    valid = opt.state_dict()
    _train(model, opt, batches[3:])  # now the state differs from the valid one

    def now() -> dict[str, Any]:
        assert opt.encoder is not None
        return {
            "optim": opt.optim.state_dict(),
            "encoder": opt.encoder.state_dict(),
            "iteration": opt.iteration,
            "bytes_sent": opt.bytes_sent,
        }

    mutations: dict[str, Mutation] = {
        "gradshare None": _set(("gradshare",), None),
        "iteration -5": _set(("gradshare", "iteration"), -5),
        "iteration 2.7": _set(("gradshare", "iteration"), 2.7),
        "iteration 'abc'": _set(("gradshare", "iteration"), "abc"),
        "iteration missing": lambda s: s["gradshare"].pop("iteration"),
        "bytes_sent None": _set(("gradshare", "bytes_sent"), None),
        "encoder None": _set(("gradshare", "encoder"), None),
        "numel": _set(("gradshare", "numel"), 1),
        "param_groups doubled": lambda s: s.update(param_groups=s["param_groups"] * 2),
        "lr 'abc'": lambda s: s["param_groups"][0].update(lr="abc"),
        "lr nan": lambda s: s["param_groups"][0].update(lr=float("nan")),
        "betas (0.9,)": lambda s: s["param_groups"][0].update(betas=(0.9,)),
        "amsgrad 'yes'": lambda s: s["param_groups"][0].update(amsgrad="yes"),
        "exp_avg of 3 elements": lambda s: s["state"][0].update(exp_avg=torch.zeros(3)),
        "exp_avg transposed": lambda s: s["state"][0].update(exp_avg=s["state"][0]["exp_avg"].T),
        "state of param 0 None": lambda s: s["state"].update({0: None}),
        "state None": _set(("state",), None),
        "last [1e-3]": _set(("gradshare", "encoder", "last"), [1e-3]),
        "last None": _set(("gradshare", "encoder", "last"), None),
        "last 'x'": _set(("gradshare", "encoder", "last"), "x"),
        "last 'xyz'": _set(("gradshare", "encoder", "last"), "xyz"),
        "last ['x', False, 0.1]": _set(("gradshare", "encoder", "last"), ["x", False, 0.1]),
        "last [1e-3, 'no', 0.1]": _set(("gradshare", "encoder", "last"), [1e-3, "no", 0.1]),
        "last [1e-3, False, 2.0]": _set(("gradshare", "encoder", "last"), [1e-3, False, 2.0]),
        "post_processor 'junk'": _set(("gradshare", "encoder", "post_processor"), "junk"),
        "post_processor None": _set(("gradshare", "encoder", "post_processor"), None),
        **_junk_residuals(("gradshare", "encoder")),
        **_junk_thresholds(("gradshare", "encoder")),
    }
    out = _fuzz(valid, mutations, opt.load_state_dict, now)
    opt.load_state_dict(valid)  # the valid one still loads
    out["valid"] = "loaded" if opt.iteration == 3 else "wrong"
    fresh = SharedOptimizer(
        torch.optim.Adam(toy_model().parameters(), lr=1e-2), threshold=FixedThreshold(1e-3)
    )
    unstepped = {k: v for k, v in mutations.items() if k.startswith(("exp_avg", "lr"))}
    got = _fuzz(valid, unstepped, fresh.load_state_dict, fresh.state_dict)
    out.update({f"fresh: {name}": result for name, result in got.items()})
    fresh.load_state_dict(valid)
    out["fresh: valid"] = "loaded" if fresh.iteration == 3 else "wrong"
    return out


def test_shared_optimizer_refuses_junk_and_changes_nothing() -> None:
    """A mistyped `iteration` or `bytes_sent` was refused only after the optimizer state and
    the residual were replaced; 2.7, an int64 residual or a threshold "abc" were accepted.
    A short `last` raised IndexError, `last` None TypeError and a `post_processor` "junk"
    AttributeError; a `last` "xyz", a learning rate "abc" or an `exp_avg` of another shape
    were taken (into a fresh optimizer too) and failed at the next step; a `state` of None
    changed the optimizer before it raised."""
    got = spawn(_rank_shared, 1)[0].get()
    assert got.pop("valid") == got.pop("fresh: valid") == "loaded"
    for name, result in got.items():
        assert result.startswith("ValueError"), (name, result)
    names = {
        "iteration": "`iteration`",
        "bytes_sent": "`bytes_sent`",
        "residual": "`residual`",
        "last_threshold": "`last_threshold`",
        "last": "`last`",
        "post_processor": "`post_processor`",
        "lr": "`lr`",
        "betas": "`betas`",
        "amsgrad": "`amsgrad`",
        "exp_avg": "`exp_avg`",
    }
    for name, result in got.items():
        for key, field in names.items():
            if key in name.split():
                assert field in result, (name, result)
    assert "of shape (3,), for a parameter of shape (16, 10)" in got["fresh: exp_avg of 3 elements"]
    assert "is [0.001]: expect [threshold, was_dense, density]" in got["last [1e-3]"]


def _rank_hook(rank: int, world: int) -> dict[str, str]:
    model = DistributedDataParallel(toy_model())
    state = register_threshold_hook(
        model, start_iter=0, momentum=0.9, threshold=FixedThreshold(1e-3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = toy_batches(5)
    _train(model, opt, batches[:3])
    valid = state.state_dict()
    _train(model, opt, batches[3:])

    def now() -> dict[str, Any]:
        return state.state_dict()

    mutations: dict[str, Mutation] = {
        "encoders a list": _set(("encoders",), []),
        "iteration -5": _set(("iteration",), -5),
        "iteration 2.7": _set(("iteration",), 2.7),
        "bytes_sent None": _set(("bytes_sent",), None),
        **_junk_residuals(("encoders", "0,0")),
        **_junk_thresholds(("encoders", "0,0")),
    }
    return _fuzz(valid, mutations, state.load_state_dict, now)


def test_hook_state_refuses_junk_and_changes_nothing() -> None:
    got = spawn(_rank_hook, 1)[0].get()
    for name, result in got.items():
        assert result.startswith("ValueError"), (name, result)


def _rank_local_steps(rank: int, world: int) -> dict[str, str]:
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = LocalSteps(model, inner, sync_every=1, threshold=FixedThreshold(1e-3))
    batches = toy_batches(5)
    _train(model, inner, batches[:3])
    valid = sync.state_dict()
    _train(model, inner, batches[3:])

    def now() -> dict[str, Any]:
        return sync.state_dict()

    mutations: dict[str, Mutation] = {
        "state None": lambda s: s.clear(),
        "steps 'abc'": _set(("steps",), "abc"),
        "syncs -5": _set(("syncs",), -5),
        "syncs 2.7": _set(("syncs",), 2.7),
        "bytes_sent None": _set(("bytes_sent",), None),
        "encoders a dict": _set(("encoders",), {}),
        **_junk_residuals(("encoders", 0)),
        **_junk_thresholds(("encoders", 0)),
    }
    return _fuzz(valid, mutations, sync.load_state_dict, now)


def test_local_steps_refuses_junk_and_changes_nothing() -> None:
    got = spawn(_rank_local_steps, 1)[0].get()
    for name, result in got.items():
        assert result.startswith("ValueError"), (name, result)
