"""Five runs of ``examples/accelerate_ddp.py`` from one parent process: each run's
``notebook_launcher`` forks 2 new processes, so every run, resumes included, starts in new
processes, while torch, accelerate and gradshare are imported once (~2.5 s of CPU a launch,
a third of what a run of the example takes). In order, each for 26 steps:

1. ``--share gradients`` straight through, saving at step 25 into ``TMP/ckpt``, then resumed
   from that save; the same for ``--share local --sync-every 4`` (saved between two syncs)
   into ``TMP/local/ckpt``.
2. ``TMP/ckpt`` with rank 1's file left from the save before (refused).

    python tests/accelerate_runs.py TMP

Everything the runs print goes to this process's stdout, each run after a line
``=== NAME`` (a refused run: its error after it).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

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


def main() -> None:
    tmp = Path(sys.argv[1])
    for name, share in (("gradients", []), ("local", LOCAL)):
        (tmp / name).mkdir(parents=True, exist_ok=True)
        ckpt = tmp / name / "ckpt"
        run(f"{name}-straight", *share, *STEPS, "--save-at", "25", "--checkpoint-dir", ckpt,
            "--out", tmp / name / "straight.pt")  # fmt: skip
        run(f"{name}-resumed", *share, *STEPS, "--resume", ckpt, "--out", tmp / name / "resumed.pt")
    make_stale(accelerate_rank_file(tmp / "gradients" / "ckpt", 1))
    run("stale", *STEPS, "--resume", tmp / "gradients" / "ckpt")


if __name__ == "__main__":
    main()
