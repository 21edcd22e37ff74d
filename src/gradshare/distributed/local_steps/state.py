"""LocalSteps' checkpoint: what :meth:`~gradshare.LocalSteps.state_dict` saves, and the load
that checks all of it before anything changes.

A state goes through :mod:`gradshare.distributed.checkpoint` as the hook's and
SharedOptimizer's do: the format check, then the "saved by" check (this rank, a world of the
same size). States of earlier formats are brought up to this one by :data:`MIGRATIONS`, one
function per version, each a pure function of the state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from gradshare.distributed.checkpoint import (
    check_counter,
    check_encoder_state,
    check_format,
    check_mapping,
    check_optimizer_state,
    check_saved_by,
    saved_by,
)
from gradshare.encoding.encoder import Encoder

LocalSteps = Any
"""The :class:`~gradshare.LocalSteps` whose state this is (not imported: :mod:`.core` imports
this module)."""

__all__ = ["FORMAT", "LOADED", "MIGRATIONS", "current", "load_state_dict", "state_dict"]

FORMAT = 5
"""The version of :meth:`~gradshare.LocalSteps.state_dict`'s layout: 2 added ``pending`` and
the ``overlap`` setting, 3 ``lead``, 4 ``base`` in its place, ``overlap`` in steps and the
``fragments`` setting, with the ``fragment`` of a pending round; 5 the rank and world size
beside the settings, as every gradshare state records them, and the outer optimizer among the
settings."""

LOADED = (
    "sync_every",
    "density",
    "decay",
    "dense",
    "overlap",
    "fragments",
    "threshold",
    "names",
    "shapes",
    "outer_optimizer",
)
"""The settings a state must have been saved with to load (``compact`` and the buffers do
not matter to the state: a state saved with either setting loads into the other)."""

_KEYS = {
    "format",
    "settings",
    "steps",
    "syncs",
    "bytes_sent",
    "dense_bytes",
    "global",
    "encoders",
    "outer",
    "pending",
    "base",
    "fragment",
}


# ---------------------------------------------------------------------- migrations


def _from_1(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 (before overlap): saved without overlap, nothing pending."""
    settings = {"overlap": False, **check_mapping(state.get("settings"), "`settings`")}
    return {**state, "format": 2, "pending": None, "settings": settings}


def _from_2(state: dict[str, Any]) -> dict[str, Any]:
    """Format 2 (before the lead): its rounds in flight started from the global copy."""
    return {**state, "format": 3, "lead": None}


def _from_3(state: dict[str, Any]) -> dict[str, Any]:
    """Format 3: ``overlap`` a bool (True: the merge at the next sync) and ``lead`` relative
    to the global copy where format 4 has ``base``; one fragment."""
    settings = dict(check_mapping(state.get("settings"), "`settings`"))
    settings["overlap"] = settings.get("sync_every") if settings.get("overlap") is True else 0
    pending, base, glob = state.get("pending"), state.get("lead"), state.get("global")
    whole = isinstance(glob, list) and all(isinstance(t, torch.Tensor) for t in glob)
    if pending is not None and whole and glob:  # its round was sent from the start then
        start = torch.cat([t.reshape(-1).to(torch.float32) for t in glob])
        base = start if not isinstance(base, torch.Tensor) else base.to(start) + start
    out = {k: v for k, v in state.items() if k != "lead"}
    fragment = 0 if pending is not None else None
    return {**out, "format": 4, "base": base, "fragment": fragment, "settings": settings}


def _from_4(state: dict[str, Any]) -> dict[str, Any]:
    """Format 4: the rank and world size among the settings; the outer optimizer not
    recorded (None: not compared; its state is still checked whole)."""
    settings = {"fragments": 1, **check_mapping(state.get("settings"), "`settings`")}
    out = {**state, "format": 5}
    for key in ("rank", "world_size"):
        if key in settings:
            out[key] = settings.pop(key)
    return {**out, "settings": {"outer_optimizer": None, **settings}}


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _from_1,
    2: _from_2,
    3: _from_3,
    4: _from_4,
}
"""Per format: the function that brings a state of it to the next format."""


# ---------------------------------------------------------------------- save


def state_dict(ls: LocalSteps) -> dict[str, Any]:
    """:meth:`~gradshare.LocalSteps.state_dict`."""
    pending = None
    if ls._overlap is not None:
        ls._receive()
        if ls._overlap.received:
            assert ls._overlap.flight is not None  # a round received is a fragment's
            ls._fragments[ls._overlap.flight].settle_mean()
            pending = ls._flat.mean.clone()
    base = None if ls._overlap is None else ls._overlap.base_state()
    return {
        "format": FORMAT,
        **saved_by(ls.group),
        "settings": ls.settings(),
        "steps": ls.steps,
        "syncs": ls.syncs,
        "bytes_sent": ls.bytes_sent,
        "dense_bytes": ls.dense_bytes,
        "global": [g.detach().clone() for g in ls.global_params],
        "encoders": [e.state_dict() for e in ls.encoders],
        "outer": ls.outer.state_dict(),
        "pending": pending,
        "fragment": None if pending is None or ls._overlap is None else ls._overlap.flight,
        "base": base,
    }


# ---------------------------------------------------------------------- load


def current(state: Any, what: str = "LocalSteps state") -> dict[str, Any]:
    """``state`` brought to this :data:`FORMAT` (:data:`MIGRATIONS`), every key there."""
    state = check_mapping(state, f"a {what}" if what == "LocalSteps state" else what)
    version = check_format(state, what, FORMAT)
    for v in range(version, FORMAT):
        state = MIGRATIONS[v](state)
    missing = _KEYS - set(state)
    if missing:
        raise ValueError(f"{what} is missing {sorted(missing)}: is it one?")
    return state


def load_state_dict(ls: LocalSteps, state: Any) -> None:
    """:meth:`~gradshare.LocalSteps.load_state_dict`: check everything, then change."""
    state = current(state)
    check_saved_by(state, ls.group, "LocalSteps state")
    _check_settings(ls, check_mapping(state["settings"], "`settings`"))
    counters = {
        k: check_counter(state, k, "LocalSteps state")
        for k in ("steps", "syncs", "bytes_sent", "dense_bytes")
    }
    _check_counters(ls, counters["steps"], counters["syncs"])
    if not isinstance(state["encoders"], list) or not isinstance(state["global"], list):
        raise ValueError(
            "LocalSteps state's `encoders` and `global` must be lists: the checkpoint is corrupted."
        )
    glob = state["global"]
    _check_global(ls, glob)
    probes = _probe_encoders(ls, state["encoders"])
    pending, base, fragment = state["pending"], state["base"], state["fragment"]
    if pending is not None and (
        isinstance(fragment, bool)
        or not isinstance(fragment, int)
        or not 0 <= fragment < len(ls._fragments)
    ):
        raise ValueError(
            f"LocalSteps state's `fragment` must be the index of the fragment whose round "
            f"waits (0 to {len(ls._fragments) - 1}), got {fragment!r}: the checkpoint is "
            "corrupted."
        )
    _check_vector(ls, pending, "`pending` (the mean of a round waiting for its merge)")
    _check_vector(ls, base, "`base` (where the round in flight was sent from, or the carry)")
    if pending is not None and base is None:
        raise ValueError(
            "LocalSteps state has a round waiting for its merge (`pending`) but not where "
            "it was sent from (`base` is None): the state mixes two runs or is corrupted."
        )
    check_optimizer_state(ls.outer, state["outer"], "LocalSteps state's `outer`")
    copy.deepcopy(ls.outer).load_state_dict(state["outer"])  # refuses another's state
    # everything checked: change
    if ls._overlap is not None:
        if pending is not None:
            ls._flat.mean.copy_(pending)
        ls._overlap.restore(pending is not None, fragment, base)
    ls.outer.load_state_dict(state["outer"])
    for g, t in zip(ls.global_params, glob, strict=True):
        g.copy_(t)
    ls._set_encoders(probes)
    ls.steps, ls.syncs = counters["steps"], counters["syncs"]
    ls.bytes_sent, ls.dense_bytes = counters["bytes_sent"], counters["dense_bytes"]


def _check_settings(ls: LocalSteps, saved: dict[str, Any]) -> None:
    here = ls.settings()
    differ = [
        k
        for k in LOADED
        if saved.get(k) != here[k] and not (k == "outer_optimizer" and saved.get(k) is None)
    ]
    if differ:
        raise ValueError(
            "LocalSteps state was saved with other settings: "
            + "; ".join(f"`{k}` {saved.get(k)!r} saved, {here[k]!r} here" for k in differ)
            + ": each rank loads the state its own rank saved, with the same arguments, "
            "model and world size."
        )


def _check_counters(ls: LocalSteps, steps: int, syncs: int) -> None:
    """Refuse counters that no run reaches: more syncs than ``steps`` inner steps hold
    (fewer is a run whose failed syncs were caught), or ``steps`` past 2**53."""
    due = ls._schedule.syncs_by(steps)
    if steps >= 2**53 or syncs > due:
        raise ValueError(
            f"LocalSteps state's counters disagree: `steps` {steps} and `syncs` {syncs}, "
            f"where {steps} inner steps hold at most {min(due, 2**53)} syncs at "
            f"sync_every={ls.sync_every}: the checkpoint is corrupted."
        )


def _check_global(ls: LocalSteps, glob: list[Any]) -> None:
    if len(glob) != len(ls.params) or any(
        not isinstance(t, torch.Tensor)
        or t.shape != g.shape
        or t.dtype not in (g.dtype, p.dtype)
        or not bool(t.isfinite().all())
        for t, g, p in zip(glob, ls.global_params, ls.params, strict=False)
    ):
        raise ValueError(
            "LocalSteps state's global copy does not match the model's parameters (count, "
            "shape, dtype: the global copy's, or the parameter's in states saved before "
            "float16 and bfloat16 models kept a float32 copy) or is not finite: the "
            "checkpoint is of another model or corrupted."
        )


def _probe_encoders(ls: LocalSteps, saved: list[Any]) -> list[Encoder]:
    """An encoder loaded from each saved state (on LocalSteps' home), each checked."""
    if len(saved) != len(ls.encoders):
        raise ValueError(
            f"LocalSteps state holds {len(saved)} encoder states, this one has "
            f"{len(ls.encoders)}: the checkpoint is of another model or mode."
        )
    probes = []
    for saved_enc, p in zip(saved, ls.params[: len(ls.encoders)], strict=True):
        check_encoder_state(saved_enc, p.numel(), "LocalSteps state")
        probe = ls._new_encoder()
        probe.load_state_dict(saved_enc)  # refuses a bad residual or another algorithm
        if probe.residual is not None and probe.residual.numel() != p.numel():
            raise ValueError(
                f"LocalSteps state's residual has {probe.residual.numel()} elements, the "
                f"parameter {p.numel()}: the checkpoint is of another model."
            )
        if probe.residual is not None:
            probe.residual = probe.residual.to(ls.home)
        probes.append(probe)
    return probes


def _check_vector(ls: LocalSteps, value: Any, what: str) -> None:
    """A saved overlap vector: None, or (with overlap) a finite float32 vector."""
    overlapping = ls._overlap is not None
    if value is None or (
        overlapping
        and isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.shape == ls._flat.mean.shape
        and bool(value.isfinite().all())
    ):
        return
    want = "None"
    if overlapping:
        want = f"None or a finite float32 vector of {ls.numel} elements"
    got = (
        f"{value.dtype} of shape {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else type(value).__name__
    )
    raise ValueError(
        f"LocalSteps state's {what} must be {want}, got {got}: the checkpoint is of "
        "another model or corrupted."
    )
