"""What every gradshare state records about who saved it, and the one check of it on load.

Each rank saves its own state (its residuals differ from every other rank's), so each state
records the rank and world size that saved it and the format it is written in; a load checks
both before anything changes. The other checks here let a load refuse junk with an error naming
the field (a counter that is not a count, a residual of another dtype or length, a threshold
state that is not a positive finite float, a wrapped optimizer's learning rate that is not a
number or a buffer of another shape) before anything changes, never half-way through.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "check_counter",
    "check_encoder_state",
    "check_format",
    "check_mapping",
    "check_optimizer_state",
    "check_saved_by",
    "saved_by",
]

_LARGEST_THRESHOLD = float(torch.finfo(torch.float32).max)
"""A threshold above float32's largest value could never be crossed by a float32 residual."""


def saved_by(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """``{"rank": r, "world_size": w}`` of this process in ``group`` (empty without a process
    group)."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    return {"rank": dist.get_rank(group), "world_size": dist.get_world_size(group)}


def check_saved_by(saved: dict[str, Any], group: dist.ProcessGroup | None, what: str) -> None:
    """Refuse ``saved`` unless this rank of a world of the same size saved it (a state that
    records neither passes: it predates the record)."""
    here = saved_by(group)
    there = {k: saved.get(k, v) for k, v in here.items()}
    if there != here:
        raise ValueError(
            f"{what} was saved by rank {there['rank']} of {there['world_size']}, this is rank "
            f"{here['rank']} of {here['world_size']}: each rank loads the state its own rank "
            "saved, in a world of the same size (another size would drop or invent residuals)."
        )


def check_format(saved: dict[str, Any], what: str, current: int) -> int:
    """The format version of ``saved`` (1 when it records none: gradshare 0.1), refusing a
    newer one than this gradshare reads."""
    version = saved.get("format", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= current:
        raise ValueError(
            f"{what} is in format {version!r}; this gradshare reads formats 1 to {current}: it "
            "was saved by a newer gradshare (upgrade), or the checkpoint is corrupted."
        )
    return version


def check_mapping(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a dict, else a ValueError naming ``what``."""
    if not isinstance(value, dict):
        raise ValueError(
            f"Expect {what} to be a dict, got {type(value).__name__}: the checkpoint is "
            "corrupted or of something else."
        )
    return value


def check_counter(saved: dict[str, Any], name: str, what: str) -> int:
    """``saved[name]`` if it is an int >= 0 (not a bool), else a ValueError naming it."""
    value = saved.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{what}'s `{name}` is {value!r}, not an int >= 0: the checkpoint is corrupted."
        )
    return value


def check_encoder_state(saved: Any, numel: int | None, what: str) -> None:
    """Refuse an :meth:`~gradshare.Encoder.state_dict` whose residual is not a 1-D float32
    tensor of ``numel`` elements (any length when None), or whose threshold state holds a
    last threshold that is not a finite float32 >= 0 (or a last density outside [0, 1]);
    the encoder itself checks the rest (finite residual, the same algorithm and settings).
    Also refuse a ``post_processor`` that is not a dict and a ``last`` (the feedback of the
    last message) that is not ``[threshold, was_dense, density]``, which the encoder would
    only trip over at its next step, or with an IndexError or TypeError."""
    saved = check_mapping(saved, f"{what}'s encoder state")
    if "post_processor" in saved:
        check_mapping(saved["post_processor"], f"{what}'s `post_processor`")
    if "last" in saved:
        _check_last(saved["last"], what)
    residual = saved.get("residual")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dim() != 1:
            raise ValueError(
                f"{what}'s `residual` is not a 1-D tensor: the checkpoint is corrupted."
            )
        if residual.dtype != torch.float32:
            raise ValueError(
                f"{what}'s `residual` is {residual.dtype}, not torch.float32: the checkpoint "
                "is corrupted (gradshare saves float32 residuals)."
            )
        if numel is not None and residual.numel() != numel:
            raise ValueError(
                f"{what}'s `residual` has {residual.numel()} elements, this one {numel}: the "
                "checkpoint is of another model."
            )
    algorithm = check_mapping(saved.get("algorithm"), f"{what}'s threshold state")
    for name, low, high in (
        ("last_threshold", 0.0, _LARGEST_THRESHOLD),
        ("last_density", 0.0, 1.0),
    ):
        value = algorithm.get(name)
        if not _none_or_real(value, low, high):
            raise ValueError(
                f"{what}'s threshold state has `{name}` {value!r}: expect None or a float in "
                f"[{low:g}, {high:g}]; the checkpoint is corrupted."
            )


def _none_or_real(value: Any, low: float, high: float) -> bool:
    """Whether ``value`` is None or a finite int or float (not a bool) in [low, high]."""
    if value is None:
        return True
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value) and low <= value <= high


def _check_last(last: Any, what: str) -> None:
    """Refuse an encoder's ``last`` unless it is ``[threshold, was_dense, density]``, each
    None or a threshold as above, a bool, a density in [0, 1]."""
    ok = isinstance(last, (list, tuple)) and len(last) == 3
    if ok:
        threshold, dense, density = last
        ok = (
            _none_or_real(threshold, 0.0, _LARGEST_THRESHOLD)
            and _none_or_real(density, 0, 1)
            and (dense is None or isinstance(dense, bool))
        )
    if not ok:
        raise ValueError(
            f"{what}'s `last` is {last!r}: expect [threshold, was_dense, density], each None "
            f"or a float in [0, {_LARGEST_THRESHOLD:g}], a bool and a float in [0, 1] (the "
            "last message's feedback); the checkpoint is corrupted."
        )


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, what: str) -> None:
    """Refuse a state dict of the wrapped ``optimizer`` that torch would take and then fail on
    at the next step, or half-load: ``state`` not a dict of dicts, a hyperparameter of
    another kind than this optimizer's (a learning rate ``"abc"`` or NaN, a ``betas`` of
    one value), or a state tensor of another shape than the one it holds for that parameter
    (or, for torch's own optimizers but LBFGS, one that does not broadcast to the parameter).

    Groups of another number or size are left to torch, which refuses them before any change.
    """
    saved = check_mapping(saved, f"{what}'s optimizer state")
    state = check_mapping(saved.get("state"), f"{what}'s optimizer `state`")
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict)
        and isinstance(g.get("params"), (list, tuple))
        and all(isinstance(k, int) for k in g["params"])
        for g in groups
    ):
        raise ValueError(
            f"Expect {what}'s optimizer `param_groups` to be a list of dicts, each with its "
            "`params` as a list of ints: the checkpoint is corrupted or of something else."
        )
    ours = optimizer.param_groups
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in ours]:
        return  # torch names it
    for i, (group, mine) in enumerate(zip(groups, ours, strict=True)):
        for name, like in mine.items():
            if name != "params" and name in group and not _same_kind(group[name], like):
                raise ValueError(
                    f"{what}'s optimizer param group {i} has `{name}` {group[name]!r}, this "
                    f"optimizer {like!r}: expect a value of the same kind (a finite number for "
                    "a number, as many items for a tuple); the checkpoint is corrupted."
                )
        _check_hyperparameters(optimizer, group, f"{what}'s optimizer param group {i}")
    saved_ids = [k for g in groups for k in g["params"]]
    params = dict(zip(saved_ids, (p for g in ours for p in g["params"]), strict=True))
    for key, entries in state.items():
        entries = check_mapping(entries, f"{what}'s optimizer state of parameter {key!r}")
        if key in params:
            _check_param_state(
                optimizer, params[key], entries, f"{what}'s optimizer state of parameter {key!r}"
            )


def _check_hyperparameters(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], where: str
) -> None:
    """Refuse a saved group that lacks a hyperparameter of this optimizer's class (a number
    or a tuple of its ``defaults``: Adam's ``betas`` in an SGD state, which its step would
    look up and not find; flags may be missing, torch fills them in), or, for torch's own
    optimizers, whose values its constructor refuses (a negative learning rate)."""
    kind = type(optimizer).__name__
    missing = [
        n
        for n, v in optimizer.defaults.items()
        if n not in group and isinstance(v, (int, float, tuple)) and not isinstance(v, bool)
    ]
    if missing:
        raise ValueError(
            f"{where} has no {missing}, which {kind} steps with: it was saved by another "
            f"optimizer class. Build the optimizer that saved it, or start {kind} afresh."
        )
    if not type(optimizer).__module__.startswith("torch.optim."):
        return
    known = {n: group[n] for n in optimizer.defaults if n in group}
    try:
        type(optimizer)([torch.zeros(1)], **known)  # its own checks (lr >= 0, betas, ...)
    except ValueError as e:
        raise ValueError(f"{where} is refused by {kind}: {e}") from None
    except TypeError:
        pass  # a setting its constructor does not take: nothing to check here


def _check_param_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, entries: dict[str, Any], where: str
) -> None:
    """Refuse a tensor of ``entries`` (the saved state of ``param``) of another shape than
    this optimizer holds under its name, or, where it holds none, for torch's own optimizers
    but LBFGS (whose every state tensor is like its parameter, a scalar or a factor of it:
    Adafactor's), one that does not broadcast to the parameter's shape."""
    held = optimizer.state.get(param, {})
    broadcasts = type(optimizer).__module__.startswith("torch.optim.") and not isinstance(
        optimizer, torch.optim.LBFGS
    )
    for name, value in entries.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_floating_point() and not bool(value.isfinite().all()):
            raise ValueError(
                f"{where} has `{name}` with non-finite values: the checkpoint is corrupted; "
                "resume from another."
            )
        like = held.get(name)
        if isinstance(like, torch.Tensor):
            want = f"the shape of this optimizer's `{name}`, {tuple(like.shape)}"
            fits = value.shape == like.shape
        else:
            want = "a shape that broadcasts to the parameter's"
            fits = not broadcasts or _broadcasts(value.shape, param.shape)
        if not fits:
            raise ValueError(
                f"{where} has `{name}` of shape {tuple(value.shape)}, for a parameter of shape "
                f"{tuple(param.shape)}: expect {want}; the checkpoint is of another model, or "
                "corrupted."
            )


def _same_kind(value: Any, like: Any) -> bool:
    """Whether the saved hyperparameter ``value`` is of the kind of this optimizer's ``like``:
    a bool for a bool, a finite number (or one-element tensor) for a number, a sequence of
    as many such items for a tuple, a str for a str; anything where ``like`` is None."""
    if like is None:
        return True
    if isinstance(like, bool):
        return isinstance(value, bool)
    if isinstance(like, (int, float, torch.Tensor)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok and math.isfinite(value)
    if isinstance(like, (tuple, list)):
        return (
            isinstance(value, (tuple, list))
            and len(value) == len(like)
            and all(_same_kind(v, w) for v, w in zip(value, like, strict=True))
        )
    if isinstance(like, str):
        return isinstance(value, str)
    return True


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` without changing it."""
    try:
        return torch.broadcast_shapes(shape, to) == to
    except RuntimeError:
        return False
