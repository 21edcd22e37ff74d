"""What every gradshare state records about who saved it, and the one check of it on load.

Each rank saves its own state (its residuals differ from every other rank's), so each state
records the rank and world size that saved it and the format it is written in; a load checks
both before anything changes. The other checks here let a load refuse junk with an error naming
the field (a counter that is not a count, a residual of another dtype or length, a threshold
state that is not a positive finite float) before anything changes, never half-way through.
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


def saved_by(group: Any = None) -> dict[str, int]:
    """``{"rank": r, "world_size": w}`` of this process in ``group`` (empty without a process
    group)."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    return {"rank": dist.get_rank(group), "world_size": dist.get_world_size(group)}


def check_saved_by(saved: dict[str, Any], group: Any, what: str) -> None:
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
    the encoder itself checks the rest (finite residual, the same algorithm and settings)."""
    saved = check_mapping(saved, f"{what}'s encoder state")
    residual = saved.get("residual")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dim() != 1:
            raise ValueError(f"{what}'s `residual` is not a 1-D tensor: the checkpoint is "
                             "corrupted.")  # fmt: skip
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
    for name, low, high in (("last_threshold", 0.0, _LARGEST_THRESHOLD),
                            ("last_density", 0.0, 1.0)):  # fmt: skip
        value = algorithm.get(name)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and low <= value <= high):
            raise ValueError(
                f"{what}'s threshold state has `{name}` {value!r}: expect None or a float in "
                f"[{low:g}, {high:g}]; the checkpoint is corrupted."
            )


def check_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: Any, params: list[torch.Tensor], what: str
) -> None:
    """Refuse a ``torch.optim`` state dict that does not fit ``optimizer`` (over ``params``),
    before anything changes: ``state`` and ``param_groups`` present; as many groups, with the
    same keys (another optimizer class has others: Adam's ``betas``) and as many parameters;
    every hyperparameter of the type this optimizer holds, finite, and one its class accepts
    (its constructor checks them: a negative learning rate); every state tensor finite, a
    scalar or shaped like its parameter. ``torch``'s own ``load_state_dict`` checks only the
    group sizes, and the rest fails at the next step (a ``KeyError``), or never."""
    saved = check_mapping(saved, what)
    if set(saved) != {"state", "param_groups"}:
        raise ValueError(
            f"Expect {what} to hold `state` and `param_groups` (an optimizer's state_dict), "
            f"got keys {sorted(saved)}: the checkpoint is corrupted."
        )
    groups, ours = saved["param_groups"], optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(ours):
        raise ValueError(
            f"{what} has {len(groups) if isinstance(groups, list) else repr(groups)} parameter "
            f"group(s), this {type(optimizer).__name__} {len(ours)}: it is of another optimizer."
        )
    for k, (group, mine) in enumerate(zip(groups, ours, strict=True)):
        group = check_mapping(group, f"{what}'s parameter group {k}")
        differ = sorted(set(group) ^ set(mine))
        if differ:
            raise ValueError(
                f"{what}'s parameter group {k} differs in its settings {differ} from this "
                f"{type(optimizer).__name__}'s: it was saved by another optimizer; build the "
                "one that saved it."
            )
        if not isinstance(group["params"], list) or len(group["params"]) != len(mine["params"]):
            raise ValueError(f"{what}'s parameter group {k} holds other parameters than this "
                             "optimizer's: it is of another model.")  # fmt: skip
        for name, value in group.items():
            if name != "params":
                _check_setting(value, mine[name], f"{what}'s `{name}` (group {k})")
        known = {n: group[n] for n in optimizer.defaults if n in group}
        try:
            type(optimizer)([torch.zeros(1)], **known)  # its own checks (lr >= 0, betas, ...)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{what}'s parameter group {k} is refused by "
                             f"{type(optimizer).__name__}: {e}") from None  # fmt: skip
    state = check_mapping(saved["state"], f"{what}'s `state`")
    for key, entry in state.items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(params):
            raise ValueError(f"{what}'s `state` names parameter {key!r}, expect 0 to "
                             f"{len(params) - 1}: the checkpoint is corrupted.")  # fmt: skip
        entry = check_mapping(entry, f"{what}'s state of parameter {key}")
        for name, value in entry.items():
            where = f"{what}'s `{name}` of parameter {key}"
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 and value.shape != params[key].shape:
                    raise ValueError(
                        f"{where} has shape {tuple(value.shape)}, the parameter "
                        f"{tuple(params[key].shape)}: the checkpoint is of another model."
                    )
                if value.is_floating_point() and not bool(value.isfinite().all()):
                    raise ValueError(f"{where} holds non-finite values: the checkpoint is "
                                     "corrupted; resume from another.")  # fmt: skip
            else:
                _check_setting(value, value, where)


def _check_setting(value: Any, like: Any, where: str) -> None:
    """Refuse ``value`` unless it is of ``like``'s kind (a bool, a number, a tuple of
    numbers, None or a string, a tensor), finite where it is a number."""
    if like is None:  # a switch left to torch (foreach, fused): None or a bool
        ok = value is None or isinstance(value, bool)
    elif isinstance(like, (bool, str)):
        ok = type(value) is type(like)
    elif isinstance(like, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    elif isinstance(like, (tuple, list)):
        ok = isinstance(value, (tuple, list)) and len(value) == len(like)
        ok = ok and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value
        )
    elif isinstance(like, torch.Tensor):
        ok = isinstance(value, torch.Tensor) and bool(value.isfinite().all())
    else:
        ok = True
    if not ok:
        raise ValueError(
            f"{where} is {value!r}, expect {type(like).__name__} like {like!r} (finite): the "
            "checkpoint is corrupted or of another optimizer."
        )
