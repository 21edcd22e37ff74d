"""The hook's per-parameter books: an encoder (residual + threshold state) and, with DGC's
momentum correction, a velocity for every parameter, named by its place in DDP's buckets."""

from __future__ import annotations

from typing import Any

import torch

from gradshare.distributed.checkpoint import check_encoder_state
from gradshare.encoding.encoder import Encoder
from gradshare.encoding.options import EncodingOptions

__all__ = ["Param", "ParameterEncoders", "Place"]

Place = tuple[int, int]
"""A parameter's name: its place in DDP's first-iteration buckets (bucket index, position in
it), the same in every process and in every DDP built on the same model."""

Param = tuple[Place, int]
"""A parameter of a bucket: its place and its number of elements."""


class ParameterEncoders:
    """Per parameter place: its :class:`~gradshare.Encoder` (made on first use from the
    options) and its float32 velocity (only with ``momentum > 0``).

    Every kept residual and velocity is checked against its parameter's size before anything
    changes: a mismatch means the state was restored from another model.
    """

    __slots__ = ("encoders", "momentum", "options", "velocities")

    def __init__(self, options: EncodingOptions, momentum: float) -> None:
        self.options = options
        self.momentum = momentum
        self.encoders: dict[Place, Encoder] = {}
        """Per parameter place: its residual and threshold algorithm."""
        self.velocities: dict[Place, torch.Tensor] = {}
        """Per parameter place: its float32 velocity (only with ``momentum > 0``)."""

    def for_params(self, params: list[Param], device: torch.device) -> list[Encoder]:
        """The encoders of ``params`` (made on first use), their state on ``device``."""
        for place, n in params:
            enc = self.encoders.get(place)
            kept = {"residual": None if enc is None else enc.residual}
            kept["velocity"] = self.velocities.get(place)
            for what, t in kept.items():
                if t is not None and t.numel() != n:
                    raise ValueError(
                        f"The {what} kept for parameter {place} has {t.numel()} elements, the "
                        f"parameter has {n}: the hook state is of another model."
                    )
        out = []
        for place, _ in params:
            enc = self.encoders.get(place)
            if enc is None:
                enc = self.encoders[place] = self.options.encoder()
            if enc.residual is not None and enc.residual.device != device:
                enc.residual = enc.residual.to(device)  # restored from a checkpoint
            velocity = self.velocities.get(place)
            if velocity is not None and velocity.device != device:
                self.velocities[place] = velocity.to(device)
            out.append(enc)
        return out

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Residuals, threshold states and velocities, keyed ``"bucket,position"``."""
        return {
            "encoders": {_key(p): e.state_dict() for p, e in self.encoders.items()},
            "velocities": {_key(p): u.detach().clone() for p, u in self.velocities.items()},
        }

    def parse(
        self, state: dict[str, Any], sizes: dict[Place, int], saved_momentum: Any
    ) -> tuple[dict[Place, Encoder], dict[Place, torch.Tensor]]:
        """The encoders and velocities of a :meth:`state_dict`, every one checked (finite,
        1-D, as long as its parameter where ``sizes`` knows it); changes nothing."""
        for what in ("encoders", "velocities"):
            if not isinstance(state.get(what), dict):
                raise ValueError(
                    f"Hook state's `{what}` is a {type(state.get(what)).__name__}, not a dict "
                    "keyed 'bucket,position': the checkpoint is corrupted."
                )
        encoders = {}
        for key, saved in state["encoders"].items():
            place = _place(key)
            check_encoder_state(saved, sizes.get(place), f"Hook state's parameter {place}")
            enc = self.options.encoder()
            enc.load_state_dict(saved)  # refuses a non-finite residual
            if enc.residual is not None:
                _check_size(enc.residual, sizes.get(place), "residual", place)
            encoders[place] = enc
        velocities = {}
        for key, u in state["velocities"].items():
            place = _place(key)
            if not isinstance(u, torch.Tensor) or u.dim() != 1 or not u.is_floating_point():
                raise ValueError(
                    f"Hook state's velocity of parameter {place} is not a 1-D "
                    "floating tensor: the checkpoint is corrupted."
                )
            if not bool(u.isfinite().all()):
                raise ValueError(
                    f"Hook state's velocity of parameter {place} has non-finite values: the "
                    "checkpoint is corrupted; resume from another."
                )
            residual = encoders[place].residual if place in encoders else None
            size = sizes.get(place, None if residual is None else residual.numel())
            _check_size(u, size, "velocity", place)
            velocities[place] = u.detach().to(torch.float32).clone()
        if velocities and not self.momentum:
            raise ValueError(
                f"Hook state holds velocities (saved with momentum {saved_momentum}), but this "
                "state has `momentum=0`: they would be dropped. Pass the momentum it was "
                "saved with."
            )
        return encoders, velocities


def _key(place: Place) -> str:
    return f"{place[0]},{place[1]}"


def _place(key: Any) -> Place:
    try:
        b, j = (int(v) for v in str(key).split(","))
    except ValueError:
        raise ValueError(
            f"Hook state names a parameter {key!r}; expect 'bucket,position' (two ints): "
            "the checkpoint is corrupted or of an older hook format."
        ) from None
    return b, j


def _check_size(t: torch.Tensor, size: int | None, what: str, place: Place) -> None:
    if size is not None and t.numel() != size:
        raise ValueError(
            f"Hook state's {what} of parameter {place} has {t.numel()} elements, the parameter "
            f"has {size}: the checkpoint is of another model."
        )
