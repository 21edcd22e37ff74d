"""The Hugging Face Trainer example on each path in the same 2 processes, under torchrun: each
process spends seconds of CPU importing transformers, more than a run of the example takes,
so ``tests/test_hf_trainer.py`` runs the four paths in one launch rather than four.

For ``--share`` hook, updates, local, and local with ``--overlap 2 --compact`` in turn: 10
steps straight through, saving at step 5, then resumed from ``checkpoint-5`` with a fresh
model and Trainer (``--check-resume 5``), into ``TMP/{path}/out``, the parameters into
``TMP/{path}/straight.pt``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_fits.py TMP

Rank 0 writes ``TMP/said.json``: what each path printed.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer

PATHS = {
    "hook": ["--share", "hook"],
    "updates": ["--share", "updates"],
    "local": ["--share", "local"],
    "local-overlap": ["--share", "local", "--overlap", "2", "--compact"],
}
"""Each path's options, by name (local with overlap: checkpoint-5 holds a round in flight;
every fragment at once, so the replicas are bit-identical at the end, as the example checks)."""


def main() -> None:
    tmp = Path(sys.argv[1])
    said: dict[str, str] = {}
    for name, chosen in PATHS.items():
        args = hf_trainer.parse_args(
            [*chosen, "--steps", "10", "--check-resume", "5",
             "--output-dir", str(tmp / name / "out"), "--out", str(tmp / name / "straight.pt")]
        )  # fmt: skip
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            hf_trainer.run(args)
        said[name] = out.getvalue()
    if dist.get_rank() == 0:
        (tmp / "said.json").write_text(json.dumps(said))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
