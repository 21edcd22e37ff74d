"""Train an MLP on digits with DDP whose gradient all-reduce is replaced by gradshare's hook.

    torchrun --standalone --nproc_per_node=2 examples/ddp_hook.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_hook.py --plain   # DDP as usual

An ordinary DDP training loop plus one line, ``register_threshold_hook(ddp_model)``: each
bucket's gradient is threshold-encoded with error feedback, exchanged, and the mean of the
decoded gradients goes to the optimizer. The hook state (a residual and a threshold per
parameter) checkpoints per rank with ``state.state_dict()``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradshare import AdaptiveThreshold, register_threshold_hook
from gradshare.app.datasets import digits, minibatches, mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--threshold", type=float, default=1e-3, help="adaptive, initial value")
    parser.add_argument("--plain", action="store_true", help="no hook: DDP's all-reduce")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = digits(seed=0)
    model = DDP(mlp(split.num_features, split.num_classes, hidden=256, seed=0))
    state = None
    if not args.plain:
        state = register_threshold_hook(model, threshold=AdaptiveThreshold(args.threshold))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        batches = minibatches(split.x_train, split.y_train, args.batch_size, seed=epoch)
        for x, y in batches[: len(batches) // world * world][rank::world]:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch}  loss {loss.item():.4f}")
    with torch.no_grad():
        accuracy = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
    if rank == 0:
        line = f"test accuracy {accuracy:.4f}"
        if state is not None:
            ratio = state.dense_bytes / max(state.bytes_sent, 1)
            line += f"; sent {state.bytes_sent:,} B vs {state.dense_bytes:,} B dense"
            line += f" ({ratio:.0f}x less)"
        print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
