"""Host memory of ``LocalSteps`` per parameter, on the 25.4M GPT of ``bench/exchange.py``.

Run (PYTHONPATH=src, or an installed checkout):

  python bench/local_steps_memory.py --out bench/results/local_steps_memory.json

One process (gloo, world 1) builds the model and plain SGD as the inner optimizer, then for
each setting in turn: the resident memory before ``LocalSteps(model, sgd, sync_every=2,
...)``, right after it, and after 6 inner steps (3 syncs) and ``close()``, as bytes per
parameter. Each setting runs in a fresh process, so one's freed memory cannot hide the next
one's. What is counted is what the process holds, the allocator's cache of freed blocks
included: what a user sees in ``top``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _env import environment, free_port

SETTINGS = {
    "default": {},
    "overlap 2": {"overlap": 2},
    "dense": {"dense": True},
}


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(setting: str) -> dict[str, float]:
    """In this process: the memory of one setting, in bytes per parameter."""
    import torch
    import torch.distributed as dist

    import gradshare
    from _models import gpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    net = gpt("gpt-25m", 100)
    n = sum(p.numel() for p in net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    before = _rss()
    sync = gradshare.LocalSteps(net, opt, sync_every=2, **SETTINGS[setting])
    built = _rss()
    for _ in range(6):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p), alpha=1e-4)
        opt.step()  # no gradients: SGD leaves the parameters, the sync hook runs
    sync.close()
    after = _rss()
    dist.destroy_process_group()
    return {"params": n, "built": (built - before) / n, "after_syncs": (after - before) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the rows as JSON here")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one setting, printed as JSON
        print(json.dumps(measure(args.one)))
        return
    rows = []
    print(f"{'setting':10s} {'built B/param':>14s} {'after syncs B/param':>20s}")
    for setting in SETTINGS:
        out = subprocess.run(
            [sys.executable, __file__, "--one", setting],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
        row = {"setting": setting, **json.loads(out.strip().splitlines()[-1])}
        rows.append(row)
        print(f"{setting:10s} {row['built']:14.1f} {row['after_syncs']:20.1f}")
    if args.out:
        args.out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
