"""Seven runs of ``examples/accelerate_ddp.py`` from one parent process: each run's
``notebook_launcher`` forks 2 new processes, so every run, resumes included, starts in new
processes, while torch, accelerate and gradshare are imported once (~2.5 s of CPU a launch,
a third of what a run of the example takes). In order, each for 26 steps:

1. ``--share gradients`` straight through, saving at step 25 into ``TMP/gradients/ckpt``,
   then resumed from that save; the same for ``--share local --sync-every 4`` (saved between
   two syncs) into ``TMP/local/ckpt``.
2. A copy of ``TMP/gradients/ckpt`` in ``TMP/cut/ckpt``, resumed and saved into again at
   step 26 with the main process killed once every rank's pre-hook has run, before
   accelerate writes its own files; then resumed from (refused: the rank files are of step
   26, accelerate's files of step 25).
3. ``TMP/gradients/ckpt`` with rank 1's file left from the save before (refused).

    python tests/accelerate_runs.py TMP

Everything the runs print goes to this process's stdout, each run after a line
``=== NAME`` (a refused run: its error after it).
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import accelerate.accelerator
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import accelerate_ddp

from gradshare.integrations import accelerate_rank_file
from test_integrations import make_stale

STEPS = ["--steps", "26"]  # 21 batches per rank per epoch: saved 4 into the second
LOCAL = ["--share", "local", "--sync-every", "4"]


def run(name: str, *args: str | Path) -> None:
    print(f"=== {name}", flush=True)
    try:
        accelerate_ddp.main([*map(str, args)])
    except Exception:  # a refusal: the run's error, then the next run goes on
        traceback.print_exc(file=sys.stdout)
    sys.stdout.flush()


def killed_main(*args: Any, **kwargs: Any) -> None:
    """accelerate's writing of its files, where the main process dies once every rank's
    pre-hook has written its rank file."""
    dist.barrier()
    if dist.get_rank() == 0:
        os._exit(1)
    accelerate.checkpointing.save_accelerator_state(*args, **kwargs)


def main() -> None:
    tmp = Path(sys.argv[1])
    for name, share in (("gradients", []), ("local", LOCAL)):
        (tmp / name).mkdir(parents=True, exist_ok=True)
        ckpt = tmp / name / "ckpt"
        saving = ["--save-at", "25", "--checkpoint-dir", ckpt]
        run(f"{name}-straight", *share, *STEPS, *saving, "--out", tmp / name / "straight.pt")
        run(f"{name}-resumed", *share, *STEPS, "--resume", ckpt, "--out", tmp / name / "resumed.pt")
    cut = tmp / "cut" / "ckpt"
    shutil.copytree(tmp / "gradients" / "ckpt", cut)
    with mock.patch.object(accelerate.accelerator, "save_accelerator_state", killed_main):
        run("cut", *STEPS, "--resume", cut, "--save-at", "26", "--checkpoint-dir", cut)
    run("cut-resumed", *STEPS, "--resume", cut)
    make_stale(accelerate_rank_file(tmp / "gradients" / "ckpt", 1))
    run("stale", *STEPS, "--resume", tmp / "gradients" / "ckpt")


if __name__ == "__main__":
    main()
