"""CPU time of ``LocalSteps``' sync work per round, by phase, on the 25.4M GPT of
``bench/exchange.py``: what each rank spends besides its own steps.

Run (PYTHONPATH=src, or an installed checkout):

  python bench/local_steps_sync.py --out bench/results/local_steps_sync.json

One process per setting (gloo, world 1, one torch and kernel thread, as torchrun gives each of
several ranks on a host) builds the model, plain SGD as the inner optimizer and
``LocalSteps(model, sgd, sync_every=10, ...)``. Each round moves every parameter by a little
noise, then takes 10 inner steps (no gradients: SGD leaves the parameters, the sync hook
runs). After one untimed round, ``--rounds`` rounds are timed; each phase is a method of
``LocalSteps`` (private, so this bench follows its names), timed around its calls and given
in ms per round of 10 steps:

* ``delta``: Δ = global copy (+ carry) - replica, with its finiteness count;
* ``encode``: the residuals' backup and decay, and each parameter's encode (and, with
  ``compact``, its compact form);
* ``exchange+decode``: the exchange (here with itself) and the decode of every message into
  the mean (on the exchange's thread with overlap; with ``compact``, each piece expanded);
* ``outer``, ``take``: the outer step on the global copy, the replica taking it;
* ``merge``: with overlap, the merge τ steps after each sync (its wait for the exchange's
  thread, the carry, the outer step and the take);
* ``sync``: the whole of each sync call (with overlap: up to the launch of the exchange).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _env import environment, free_port

SETTINGS = {
    "default": {},
    "fragments 5": {"fragments": 5},
    "fragments 5, overlap 2": {"fragments": 5, "overlap": 2},
    "default, compact": {"compact": True},
    "fragments 5, overlap 2, compact": {"fragments": 5, "overlap": 2, "compact": True},
}
PHASES = {
    "delta": "_compute_delta", "encode": "_encode", "exchange+decode": "_encoded_mean",
    "outer": "_outer_step", "take": "_take_global", "merge": "_merge_due", "sync": "_sync",
}  # fmt: skip


def measure(setting: str, rounds: int) -> dict[str, float]:
    """In this process: ms per round of each phase of one setting."""
    os.environ.update(OMP_NUM_THREADS="1", GRADSHARE_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import gradshare
    from _models import gpt
    from gradshare.distributed.local_steps import LocalSteps

    spent = dict.fromkeys(PHASES, 0.0)

    def timed(phase: str, method: str) -> None:
        inner = getattr(LocalSteps, method)

        def wrapper(self: LocalSteps, *args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return inner(self, *args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        setattr(LocalSteps, method, wrapper)

    for phase, method in PHASES.items():
        timed(phase, method)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    net = gpt("gpt-25m", 100)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    sync = gradshare.LocalSteps(net, opt, sync_every=10, **SETTINGS[setting])
    noise = torch.Generator().manual_seed(0)
    for r in range(rounds + 1):
        if r == 1:
            spent.update(dict.fromkeys(PHASES, 0.0))  # the first round is not timed
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=noise), alpha=1e-3)
        for _ in range(10):
            opt.step()
    sync.close()
    dist.destroy_process_group()
    return {phase: 1e3 * s / rounds for phase, s in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of 10 steps")
    parser.add_argument("--out", type=Path, default=None, help="save the rows as JSON here")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one setting, printed as JSON
        print(json.dumps(measure(args.one, args.rounds)))
        return
    rows = []
    print(f"ms per round of 10 steps, one thread, 25.4M GPT, {args.rounds} rounds")
    print(f"{'setting':24s}" + "".join(f"{p:>16s}" for p in PHASES))
    for setting in SETTINGS:
        out = subprocess.run(
            [sys.executable, __file__, "--one", setting, "--rounds", str(args.rounds)],
            check=True, capture_output=True, text=True, timeout=900,
        ).stdout  # fmt: skip
        row = {"setting": setting, **json.loads(out.strip().splitlines()[-1])}
        rows.append(row)
        print(f"{setting:24s}" + "".join(f"{row[p]:16.1f}" for p in PHASES))
    if args.out:
        args.out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
