"""A LocalSteps state saved at another world size, loaded when the caller asks for it.

A restart with more or fewer ranks (torchrun's elastic ``--nnodes=MIN:MAX``, another
``--nproc_per_node``) hands every new rank the files of every old rank:
``sync.load_state_dict({name: state, ...}, resize=True)``. Never silently: a plain
``load_state_dict`` refuses a state of another world size.

What every rank shares must agree across the files read, or the load is refused naming the
two files and what differs: the settings, the counters, the global copy, the outer
optimizer's state and a round waiting for its merge. What is each rank's own is
mass-conserving. Per parameter, with M ranks before and M' after, r a rank's residual and c
its carry (what an overlapped round's replica moved after its send, not yet sent), the update
the global copy is still owed stays the same::

    (1/M) · Σ_i (r_i + c_i)  =  (1/M') · Σ_j (r'_j + c'_j)

(with ``reduction="sum"`` the factors 1/M and 1/M' are 1). Old rank i goes to new rank i mod
M'; a new rank keeps its own residual and carry scaled by M'/M, and adds, scaled the same,
those of the old ranks that are gone and go to it (on shrink the update they still owed is
sent later rather than dropped). A new rank beyond the old world (on grow) starts from the
global copy with an empty residual; its inner optimizer state is the caller's to take from a
peer. A replica's own moves since its last sync leave with a rank that is gone (save at a
sync to lose none), and a round waiting for its merge is merged at the load, on every rank
alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradshare.distributed.local_steps.state import LOADED, current, load_state_dict

__all__ = ["load_resized"]

LocalSteps = Any
"""The :class:`~gradshare.LocalSteps` to load into (not imported: :mod:`.core` imports this
module)."""


def load_resized(ls: LocalSteps, states: Any) -> None:
    """Load the states every rank of another world size saved, ``{file name: state}``, into
    this rank (see the module's docstring); everything is checked before anything changes."""
    olds, names = _every_rank(states)
    _check_shared(olds, names)
    load_state_dict(ls, _fold(ls, olds))
    if ls._protocol.rank >= len(olds):  # a new rank: its replica starts from the global copy
        for p, g in zip(ls.params, ls.global_params, strict=True):
            p.detach().copy_(g)
    if ls._overlap is not None and ls._overlap.received:  # merged now, on every rank alike
        fragment = ls._fragments[ls._overlap.flight]
        if ls._protocol.rank >= len(olds):  # sent from where it starts: no moves of its own since
            fragment.note_send_point()
        ls._overlap.merge()


def _every_rank(states: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Every old rank's state (brought to this format) and file name, in rank order."""
    if not isinstance(states, Mapping) or not states:
        raise TypeError(
            "Expect `state` to be a dict of file name -> LocalSteps state of every rank of the "
            f"world that saved them with resize=True, got {type(states).__name__}: read each "
            "rank's file of the step (torch.load(..., weights_only=True))."
        )
    by_rank: dict[int, tuple[str, dict[str, Any]]] = {}
    for name, raw in states.items():
        state = current(raw, f"LocalSteps state {name}")
        rank, world = state.get("rank"), state.get("world_size")
        if not (_count(rank) and _count(world)):
            raise ValueError(
                f"LocalSteps state {name} records no rank and world size: it was saved "
                "before gradshare recorded them; it cannot be resized."
            )
        assert isinstance(rank, int)
        if rank in by_rank:
            raise ValueError(
                f"LocalSteps states {by_rank[rank][0]} and {name} were both saved by rank "
                f"{rank}: pass each rank's file of one step once."
            )
        by_rank[rank] = (name, state)
    worlds = {s["world_size"]: n for n, s in by_rank.values()}
    if len(worlds) > 1:
        raise ValueError(
            "LocalSteps states of worlds of different sizes: "
            + ", ".join(f"{n} of {w}" for w, n in worlds.items())
            + ": pass every rank's file of one step of one run."
        )
    world = next(iter(worlds))
    missing = sorted(set(range(world)) - set(by_rank))
    if missing or len(by_rank) != world:
        raise ValueError(
            f"Resizing needs every rank's state of the world of {world} that saved them: "
            f"rank(s) {missing} missing (given {sorted(n for n, _ in by_rank.values())})."
        )
    return [by_rank[r][1] for r in range(world)], [by_rank[r][0] for r in range(world)]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_SHARED = ("steps", "syncs", "global", "outer", "pending", "fragment")
"""What every rank saved alike (with the settings of :data:`~.state.LOADED`)."""


def _check_shared(olds: list[dict[str, Any]], names: list[str]) -> None:
    """Refuse states whose shared parts differ, naming the two files and the part."""
    first = olds[0]
    for state, name in zip(olds[1:], names[1:], strict=True):
        settings = [k for k in LOADED if state["settings"].get(k) != first["settings"].get(k)]
        differ = [f"`settings` {k}" for k in settings]
        differ += [f"`{k}`" for k in _SHARED if not _equal(state[k], first[k])]
        if differ:
            raise ValueError(
                f"LocalSteps states {names[0]} and {name} differ in {', '.join(differ)}, which "
                "every rank saves alike: they are of different steps or runs; pass every "
                "rank's file of one step."
            )


def _equal(a: Any, b: Any) -> bool:
    """Equal to the bit, through dicts, lists and tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _fold(ls: LocalSteps, olds: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's state in the new world: the shared parts, and its own folded by the law
    of the module's docstring."""
    old, new, j = len(olds), ls._protocol.world, ls._protocol.rank
    scale = new / old if ls._protocol.divisor != 1 else 1.0
    mine = [i for i in range(old) if i % new == j]
    first = olds[0]
    sizes = [p.numel() for p in ls.params]
    flight = first["fragment"] if first["pending"] is not None else None
    held = None if flight is None else ls._schedule.spans[flight]

    def carry(i: int) -> torch.Tensor | None:
        """Old rank i's carries (its base less the send point of the round in flight)."""
        base = olds[i]["base"]
        if not isinstance(base, torch.Tensor):
            return None
        out = base.to(torch.float64, copy=True)
        if held is not None:
            out[held.start : held.stop] = 0
        return out

    gone = [i for i in mine if i != j]
    encoders = []
    for k, n in enumerate(sizes):
        own = olds[j if j < old else j % old]["encoders"][k]
        total = torch.zeros(n, dtype=torch.float64)
        held_any = False
        for i in mine:
            r = olds[i]["encoders"][k].get("residual")
            if isinstance(r, torch.Tensor) and r.numel() == n:
                total += r.to(torch.float64)
                held_any = True
        if held_any:
            own = {**own, "residual": (total * scale).to(torch.float32)}
        elif j >= old:
            own = {**own, "residual": None}
        encoders.append(own)
    return {
        **first,
        "rank": j,
        "world_size": new,
        "encoders": encoders,
        "base": _folded_base(olds, j, gone, carry, scale, held, sizes),
        "bytes_sent": olds[j]["bytes_sent"] if j < old else 0,
        "dense_bytes": olds[j]["dense_bytes"] if j < old else 0,
    }


def _folded_base(
    olds: list[dict[str, Any]],
    j: int,
    gone: list[int],
    carry: Any,
    scale: float,
    held: Any,
    sizes: list[int],
) -> torch.Tensor | None:
    """This rank's base: its carries and those of the ranks gone to it, scaled; the send
    point of the round in flight as it saved it (a new rank: set at the merge)."""
    if not isinstance(olds[0]["base"], torch.Tensor):
        return None
    own = carry(j) if j < len(olds) else torch.zeros(sum(sizes), dtype=torch.float64)
    for i in gone:
        c = carry(i)
        if c is not None:
            own += c
    own *= scale
    if held is not None and j < len(olds):  # the send point, not a carry: unscaled
        own[held.start : held.stop] = olds[j]["base"][held.start : held.stop].to(torch.float64)
    return own.to(torch.float32)
