"""Train an MLP on digits with Lightning, DDP's all-reduce replaced by gradshare's hook.

    python examples/lightning_ddp.py                       # starts its own 2 CPU processes
    python examples/lightning_ddp.py --epochs 2 --checkpoint-dir ckpt   # step=10, step=20
    python examples/lightning_ddp.py --epochs 4 --resume ckpt/step=20.ckpt

An ordinary LightningModule; the one change is ``strategy=GradshareDDPStrategy(...)``
(``--share updates``: ``SharedOptimizer`` shares the optimizer's updates instead;
``--share local``: no all-reduce at all, each rank steps its own replica and ``LocalSteps``
syncs the replicas every ``--sync-every`` steps with sparse messages; ``--overlap τ``
runs each sync's exchange behind the next τ steps, ``--fragments P`` syncs the model a P-th at
a time, ``--no-compact`` sends its sparse messages in DL4J's format). The learning rate
warms up over the first :data:`WARMUP_STEPS` steps, set in ``optimizer_step`` as Lightning's
docs show. Run as
a plain script, Lightning's ``ddp`` launcher starts the script again once per extra device
(``devices=2``), over gloo on 127.0.0.1 with a free port. Every checkpoint gets one
``<checkpoint>.gradshare-rank{r}.pt`` per rank (residuals, threshold state; with ``local``
also the rank's own replica and optimizer state), and a fit resumed
from it ends at the very parameters of the fit that was not interrupted.

Batches are Lightning's: its ``DistributedSampler`` (seed 0, reshuffled every epoch, rank r
takes every world-th sample), ``--steps-per-epoch`` batches per epoch. The run is counted in
epochs and checkpointed at epoch ends because Lightning does not restore a plain DataLoader's
place within an epoch: with ``max_steps`` instead, even a checkpoint at an epoch's end
resumed on other batches one step later. A plain-DDP loop with the same hook, sampler and
seed (``_plain_ddp`` in ``tests/test_integrations.py``) ends at the same parameters, bit for
bit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from gradshare import AdaptiveThreshold, SharedOptimizer
from gradshare.app.datasets import digits, mlp
from gradshare.integrations import GradshareDDPStrategy

WARMUP_STEPS = 10
"""Steps over which the learning rate rises linearly to ``--lr``."""


class DigitsMLP(L.LightningModule):
    def __init__(self, lr: float, batch_size: int) -> None:
        super().__init__()
        self.split = digits(seed=0)
        self.net = mlp(self.split.num_features, self.split.num_classes, seed=0)
        self.lr, self.batch_size = lr, batch_size

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(self.split.x_train, self.split.y_train)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, closure: Any = None
    ) -> None:
        """Lightning's learning-rate warm-up pattern: the rate set through the optimizer
        Lightning hands over (with ``--share updates``, the SharedOptimizer), also after a
        resume, before each step."""
        scale = min(1.0, (self.trainer.global_step + 1) / WARMUP_STEPS)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.lr
        optimizer.step(closure=closure)


def bytes_sent(strategy: GradshareDDPStrategy, model: L.LightningModule) -> tuple[int, int]:
    """What this rank sent, and what the same steps take dense in float32."""
    if strategy.hook_state is not None:
        return strategy.hook_state.bytes_sent, strategy.hook_state.dense_bytes
    if strategy.local_steps is not None:
        return strategy.local_steps.bytes_sent, strategy.local_steps.dense_bytes
    opt = strategy.optimizers[0]
    assert isinstance(opt, SharedOptimizer)
    numel = sum(p.numel() for p in model.parameters())
    return opt.bytes_sent, 4 * numel * opt.iteration


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps-per-epoch", type=int, default=10, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--threshold", type=float, default=1e-3, help="adaptive, initial value")
    parser.add_argument(
        "--share",
        choices=["gradients", "updates", "local"],
        default="gradients",
        help="the DDP hook, SharedOptimizer (the optimizer's updates), or LocalSteps",
    )
    parser.add_argument("--sync-every", type=int, default=10, help="--share local: H")
    parser.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="--share local: steps each sync's exchange runs behind (0: none)",
    )
    parser.add_argument(
        "--fragments", type=int, default=1, help="--share local: parts of the model synced in turn"
    )
    parser.add_argument(
        "--compact",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--share local: sparse messages in their compact form",
    )
    parser.add_argument("--checkpoint-dir", type=Path, help="save a checkpoint every epoch")
    parser.add_argument("--resume", type=Path, help="a checkpoint to resume the fit from")
    parser.add_argument("--out", type=Path, help="write the final flat parameters here")
    parser.add_argument(
        "--resume-without-rank-files",
        action="store_true",
        help="resume a checkpoint saved without gradshare (plain ddp): empty residuals",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.share == "local":  # LocalSteps' own threshold: a quantile of each sync's moves
        sharing: dict[str, Any] = {
            "sync_every": args.sync_every,
            "overlap": args.overlap or False,
            "fragments": args.fragments,
            "compact": args.compact,
        }
    else:
        sharing = {"threshold": AdaptiveThreshold(args.threshold)}
    strategy = GradshareDDPStrategy(
        share=args.share,
        **sharing,
        resume_without_rank_files=args.resume_without_rank_files,
        process_group_backend="gloo",
    )
    callbacks = []
    if args.checkpoint_dir is not None:
        callbacks.append(
            ModelCheckpoint(args.checkpoint_dir, filename="{step}", every_n_epochs=1, save_top_k=-1)
        )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=args.epochs,
        limit_train_batches=args.steps_per_epoch,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsMLP(args.lr, args.batch_size)
    trainer.fit(model, ckpt_path=args.resume)
    if trainer.is_global_zero:
        sent, dense = bytes_sent(strategy, model)
        print(
            f"step {trainer.global_step}: rank 0 sent {sent:,} B vs {dense:,} B dense "
            f"({dense / max(sent, 1):.0f}x less)"
        )
        if args.out is not None:
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            torch.save(flat, args.out)
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
