"""Train a tiny GPT-2 with the Hugging Face Trainer, gradshare sharing between 2 CPU processes.

    python examples/hf_trainer.py --share gradients   # starts its own 2 processes (torchrun)
    python examples/hf_trainer.py --share updates     # SharedOptimizer around Trainer's AdamW
    python examples/hf_trainer.py --share local --steps 40 --save-steps 20 --output-dir out
    python examples/hf_trainer.py --share local --steps 40 --resume out/checkpoint-20
    python examples/hf_trainer.py --share local --overlap 2   # each exchange behind 2 steps

An ordinary Trainer script; the one added line is ``GradshareCallback(share=...).attach(
trainer)``. The model is GPT-2 built from ``GPT2Config`` (2 layers, 64 wide: nothing is
downloaded), on characters of CPython's own ``pydoc_data.topics`` text. Run as a plain script
it starts itself again under ``torchrun --nproc_per_node=2`` (gloo on 127.0.0.1).

``--check-resume K`` trains straight through (saving at K), then, in the same processes, a
fresh model and Trainer resume from ``checkpoint-K`` and must end at the very same parameters
(``--resume`` does the same in new processes). Every run ends by checking that the replicas
are bit-identical.
"""

from __future__ import annotations

import argparse
import os
import pydoc_data.topics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradshare.integrations import GradshareCallback

SEQ = 32


def char_data(num: int = 512) -> tuple[list[dict[str, torch.Tensor]], int]:
    """``num`` sequences of SEQ characters of pydoc's topics, and the vocabulary's size."""
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    text = text[: num * SEQ]
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([vocab[c] for c in text]).view(num, SEQ)
    return [{"input_ids": row, "labels": row} for row in ids], len(vocab)


def build(args: argparse.Namespace, output_dir: Path) -> Trainer:
    data, vocab_size = char_data()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=SEQ, n_layer=2, n_embd=64, n_head=2)
    training = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=args.lr,
        optim="sgd" if args.share == "gradients" else "adamw_torch",
        save_steps=args.save_steps or args.steps + 1,
        save_strategy="steps" if args.save_steps else "no",
        logging_steps=5,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, train_dataset=data)
    local = {
        "sync_every": args.sync_every,
        "overlap": args.overlap or False,
        "fragments": args.fragments,
        "compact": args.compact,
    }
    GradshareCallback(share=args.share, timeout=args.timeout, **local).attach(trainer)  # the line
    return trainer


def flat(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def check_replicas(params: torch.Tensor) -> None:
    """Every rank's parameters equal rank 0's, bit for bit."""
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    if not all(torch.equal(gathered[0], p) for p in gathered):
        raise SystemExit("the replicas differ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", choices=["gradients", "updates", "local"], default="gradients")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sync-every", type=int, default=5, help="--share local: H")
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
    parser.add_argument("--lr", type=float, help="default: 0.3 (SGD, gradients), 3e-3 (AdamW)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a rank waits for a hung one"
    )
    parser.add_argument("--save-steps", type=int, help="save a checkpoint every this many steps")
    parser.add_argument("--output-dir", type=Path, default=Path("hf_trainer_out"))
    parser.add_argument("--resume", type=Path, help="a checkpoint-N folder to resume from")
    parser.add_argument(
        "--check-resume",
        type=int,
        metavar="K",
        help="then resume from checkpoint-K in these processes: the same end",
    )
    parser.add_argument("--out", type=Path, help="write the final flat parameters here")
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = 0.3 if args.share == "gradients" else 3e-3
    if args.check_resume:
        args.save_steps = args.check_resume
    return args


def run(args: argparse.Namespace) -> None:
    """Train (and ``--check-resume``) in this process, one of torchrun's; the process group
    stays up for what runs next."""
    torch.set_num_threads(1)
    trainer = build(args, args.output_dir)
    trainer.train(resume_from_checkpoint=None if args.resume is None else str(args.resume))
    params = flat(trainer)
    check_replicas(params)
    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, GradshareCallback)
    )
    assert callback.shared is not None
    metrics = callback.shared.metrics()
    if args.check_resume:
        again = build(args, args.output_dir)
        again.train(resume_from_checkpoint=str(args.output_dir / f"checkpoint-{args.check_resume}"))
        check_replicas(flat(again))
        if not torch.equal(flat(again), params):
            raise SystemExit(f"resumed from step {args.check_resume}: other parameters")
        if trainer.is_world_process_zero():
            print(f"resumed from step {args.check_resume}: the same parameters, bit for bit")
    if trainer.is_world_process_zero():
        keys = ("bytes_sent", "compression", "density", "threshold")
        logged = [k for k in keys if any(k in h for h in trainer.state.log_history)]
        print(f"logged: {', '.join(logged)}")
        sent, dense = int(metrics["bytes_sent"]), int(metrics["dense_bytes"])
        print(
            f"step {trainer.state.global_step}: rank 0 sent {sent:,} B vs {dense:,} B dense "
            f"({dense / max(sent, 1):.0f}x less)"
        )
        if args.out is not None:
            torch.save(params, args.out)


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # a plain run: start again on 2 processes
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
        ]
        os.execv(sys.executable, [*torchrun, __file__, *sys.argv[1:]])
    run(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
