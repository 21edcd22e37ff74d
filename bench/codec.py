"""Codec throughput: fused numba kernels vs the vectorised torch path, against copy bandwidth.

Run:  .venv/bin/python bench/codec.py            (N = 1M, 25M, 100M; ~2 minutes on 2 cores)
      .venv/bin/python bench/codec.py --sizes 1000000 --repeats 3   (quick)

For each N (float32) and each case (sparse at ~3% and ~0.1% density, and a bitmap-sized case at
~25%), one run measures:

* ``copy``: ``residual += update``, the floor of any encode (12 bytes per element: read
  residual, read update, write residual), done two ways: torch's ``r.add_(u)`` and a plain numba
  loop split into the same parallel chunks as gradshare's kernels. The floor is the *faster*
  of the two, and it is re-measured after every case and the best time kept, so that a slow
  moment of the machine cannot flatter the encode ratios (the floor only gets harder);
* ``encode``: ``residual += update`` and encode, in the format the case calls for;
* ``decode``: adding the message into a float32 target.

for gradshare's fused kernels and for the same algorithm as plain vectorised torch ops (the path
gradshare uses on CUDA). Encode rates count 12 bytes per element; ``vs copy`` is the ratio of
the copy time to the encode time (1.0 = as fast as the floor). Every figure (copy included) is
the best of ``--repeats`` runs, each started from the same residual (restored by a copy, so for
N = 1M all data sit in the L3 cache for copy and encode alike); small N get
proportionally more repeats (up to 50) because their runs are short and noisier. Timings on a
shared 2-core machine vary by up to ±30% from run to run. Results go to
bench/results/codec.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numba
import numpy as np
import torch

from gradshare import codec
from gradshare.codec import _kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {"sparse-3%": 0.03, "sparse-0.1%": 0.001, "bitmap-25%": 0.25}


@dataclass
class Row:
    numel: int
    case: str
    density: float
    impl: str
    op: str
    seconds: float
    elements_per_s: float
    gb_per_s: float
    vs_copy: float
    vs_torch: float


def torch_ops() -> contextlib.AbstractContextManager[None]:
    """The codec on vectorised torch ops (its CUDA path), on CPU."""
    return codec.use_kernels(False)


@numba.njit(parallel=True, nogil=True)
def numba_add(r: np.ndarray, u: np.ndarray) -> None:  # pragma: no cover - compiled
    """``r += u`` in gradshare's parallel chunks: the copy floor as numba sees it."""
    n = r.size
    for c in numba.prange((n + _kernels.CHUNK - 1) // _kernels.CHUNK):
        lo = c * _kernels.CHUNK
        hi = min(lo + _kernels.CHUNK, n)
        rs = r[lo:hi]
        us = u[lo:hi]
        for j in range(hi - lo):
            rs[j] += us[j]


def best_of(fn: Callable[[], object], reset: Callable[[], object], repeats: int) -> float:
    reset()
    fn()  # warm-up (compiles the kernels on the first call)
    times = []
    for _ in range(repeats):
        reset()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def threshold_for(x: torch.Tensor, density: float) -> float:
    """The float32 threshold that about ``density`` of ``|x|`` reaches (from a sample)."""
    sample = x[:: max(1, x.numel() // 1_000_000)].abs().double()
    return codec.float32_threshold(float(torch.quantile(sample, 1 - density)))


def encode_step(ws: codec.Workspace, r: torch.Tensor, u: torch.Tensor, t: float, bitmap: bool):
    """What an Encoder does after its checks: add, count, then the format the count calls for."""
    if bitmap:
        return ws.bitmap_(r, t, u)[0]
    ws.scan_(r, u, t)
    return ws.emit_(r)


def run(sizes: list[int], repeats: int) -> list[Row]:
    rows: list[Row] = []
    for n in sizes:
        rows += measure(n, repeats)
    return rows


def measure(n: int, repeats: int) -> list[Row]:
    """All cases for one N, in one process and one run, so that ratios compare like with like."""
    g = torch.Generator().manual_seed(n)
    r0 = torch.randn(n, generator=g) * 1e-3
    u = torch.randn(n, generator=g) * 1e-3
    r = r0.clone()
    target = torch.zeros(n)
    repeats = max(repeats, min(50, repeats * 25_000_000 // n))

    def reset() -> None:
        r.copy_(r0)

    rn, un = r.numpy(), u.numpy()
    floors: dict[str, list[float]] = {"torch": [], "numba": []}

    def measure_copy() -> None:
        floors["torch"].append(best_of(lambda: r.add_(u), reset, repeats))
        floors["numba"].append(best_of(lambda: numba_add(rn, un), reset, repeats))

    measure_copy()
    cases: list[tuple[str, dict[str, tuple[float, float, torch.Tensor]], int, bool]] = []
    for case, density in CASES.items():
        t = threshold_for(r0 + u, density)
        bitmap = case.startswith("bitmap")
        ws = codec.Workspace()
        timings: dict[str, tuple[float, float, torch.Tensor]] = {}
        for impl in ("torch", "gradshare"):
            with torch_ops() if impl == "torch" else contextlib.nullcontext():
                step = functools.partial(encode_step, ws, r, u, t, bitmap)
                enc = best_of(step, reset, repeats)
                reset()
                msg = encode_step(ws, r, u, t, bitmap)
                dec = best_of(lambda: codec.decode_(msg, target), lambda: None, repeats)  # noqa: B023
            timings[impl] = (enc, dec, msg)
        entries = codec.message_info(timings["gradshare"][2]).num_entries
        cases.append((case, timings, entries, bitmap))
        measure_copy()
    copy_s = min(min(v) for v in floors.values())
    rows = [
        Row(
            n,
            "copy",
            1.0,
            impl,
            "r += u",
            min(v),
            n / min(v),
            12 * n / min(v) / 1e9,
            copy_s / min(v),
            1,
        )
        for impl, v in floors.items()
    ]
    for case, timings, entries, bitmap in cases:
        t_enc, t_dec, _ = timings["torch"]
        per = n if bitmap else entries
        dec_bytes = 4 * n if bitmap else 8 * entries
        for impl, (enc, dec, _) in timings.items():
            rows.append(
                Row(
                    n,
                    case,
                    entries / n,
                    impl,
                    "encode",
                    enc,
                    n / enc,
                    12 * n / enc / 1e9,
                    copy_s / enc,
                    t_enc / enc,
                )
            )
            rows.append(
                Row(
                    n,
                    case,
                    entries / n,
                    impl,
                    "decode",
                    dec,
                    per / dec,
                    dec_bytes / dec / 1e9,
                    copy_s / dec,
                    t_dec / dec,
                )
            )
    return rows


def table(rows: list[Row]) -> str:
    head = (
        f"{'N':>11} {'case':<12} {'density':>8} {'impl':<9} {'op':<7} {'ms':>9} "
        f"{'Melem/s':>9} {'GB/s':>7} {'vs copy':>8} {'vs torch':>9}"
    )
    lines = [head, "-" * len(head)]
    for x in rows:
        unit = "entries" if (x.op == "decode" and x.case.startswith("sparse")) else ""
        lines.append(
            f"{x.numel:>11,} {x.case:<12} {x.density:>8.4f} {x.impl:<9} {x.op:<7} "
            f"{x.seconds * 1e3:>9.3f} {x.elements_per_s / 1e6:>9.1f} {x.gb_per_s:>7.1f} "
            f"{x.vs_copy:>8.2f} {x.vs_torch:>8.1f}x{' ' + unit if unit else ''}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Encode time vs the copy floor (1.0 = as fast as ``residual += update``), per case and N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    enc = [r for r in rows if r.op == "encode" and r.impl == "gradshare"]
    sizes = sorted({r.numel for r in enc})
    cases = list(CASES)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(cases)
    for k, case in enumerate(cases):
        ys = [next((r.vs_copy for r in enc if r.numel == n and r.case == case), 0) for n in sizes]
        ax.bar([i + k * width for i in range(len(sizes))], ys, width, label=case)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
    ax.set_xticklabels([f"N = {n:,}" for n in sizes])
    ax.set(ylabel="copy time / encode time", title="gradshare encode vs the copy floor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000, 100_000_000]
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    args = parser.parse_args(argv)
    rows = run(args.sizes, args.repeats)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"environment": environment(), "rows": [asdict(x) for x in rows]}, indent=1)
    )
    plot(rows, args.out.with_suffix(".png"))
    print(f"\nsaved {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
