"""The ``gradshare`` command: ``gradshare inspect`` shows what the encoder sends, step by step."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from gradshare.encoder import Encoder
from gradshare.residual import ResidualClipping, ResidualPostProcessor
from gradshare.threshold import (
    AdaptiveThreshold,
    FixedThreshold,
    TargetSparsityThreshold,
    ThresholdAlgorithm,
)

THRESHOLD_KINDS = {
    "adaptive": AdaptiveThreshold,
    "fixed": FixedThreshold,
    "target": TargetSparsityThreshold,
}


class UsageError(Exception):
    """A bad option value: reported as one line and exit code 2."""


def parse_threshold(spec: str) -> ThresholdAlgorithm:
    """``adaptive:1e-3`` -> AdaptiveThreshold(1e-3); also ``fixed:T`` and ``target:T``."""
    kind, _, value = spec.partition(":")
    if kind not in THRESHOLD_KINDS:
        raise UsageError(
            f"unknown threshold kind {kind!r} in --threshold {spec!r}; use "
            + ", ".join(f"{k}:VALUE" for k in THRESHOLD_KINDS)
        )
    try:
        t = float(value) if value else 1e-3
        if kind == "target":
            return TargetSparsityThreshold(initial=1e-3, target=t)
        return THRESHOLD_KINDS[kind](t)
    except ValueError as e:
        raise UsageError(f"bad --threshold {spec!r}: {e}") from None


def parse_clip(spec: str | None) -> ResidualPostProcessor | None:
    """``5:5`` -> ResidualClipping(5, 5); None -> no post-processing."""
    if spec is None:
        return None
    multiple, _, frequency = spec.partition(":")
    try:
        return ResidualClipping(float(multiple), int(frequency or 5))
    except ValueError as e:
        raise UsageError(
            f"bad --clip {spec!r} (expect MULTIPLE:FREQUENCY, e.g. 5:5): {e}"
        ) from None


def inspect(args: argparse.Namespace) -> None:
    """Encode a stream of normal(0, std) updates and print what each step sends."""
    if args.numel < 1 or args.steps < 1 or not args.std > 0:
        raise UsageError("--numel, --steps and --std must be positive")
    torch.manual_seed(args.seed)
    enc = Encoder(parse_threshold(args.threshold), parse_clip(args.clip))
    print(
        f"gradshare inspect: {args.numel:,} float32 elements, updates ~ normal(0, {args.std:g}), "
        f"threshold {args.threshold}, {args.steps} steps"
    )
    head = (
        f"{'step':>4} {'format':<7} {'threshold':>10} {'entries':>10} {'density':>8} "
        f"{'bytes':>11} {'dense bytes':>12} {'ratio':>8} {'residual L2':>12}"
    )
    print(head)
    print("-" * len(head))
    sent = 0
    for step in range(args.steps):
        enc.encode(torch.randn(args.numel) * args.std, step)
        s = enc.last_stats
        assert s is not None
        sent += s.message_bytes
        print(
            f"{step:>4} {s.format or '-':<7} {s.threshold:>10.3e} {s.entries:>10,} "
            f"{s.density:>8.4f} {s.message_bytes:>11,} {s.dense_bytes:>12,} "
            f"{s.compression_ratio:>7.1f}x {s.residual_norm:>12.4e}"
        )
    dense = args.numel * 4 * args.steps
    print(f"\ntotal sent {sent:,} bytes vs {dense:,} dense: {dense / max(sent, 1):.1f}x less")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradshare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="encode a synthetic update stream and print each message")
    p.add_argument("--numel", type=int, default=1_000_000, help="elements of the update")
    p.add_argument("--std", type=float, default=1e-3, help="std of the normal updates")
    p.add_argument("--threshold", default="adaptive:1e-3", help="adaptive:T, fixed:T or target:S")
    p.add_argument("--clip", default=None, help="residual clipping MULTIPLE:FREQUENCY, e.g. 5:5")
    p.add_argument("--steps", type=int, default=10, help="how many updates to encode")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(func=inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except UsageError as e:
        print(f"gradshare {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
