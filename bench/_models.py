"""The models and data the benchmarks train: a character-level GPT on real English text.

The GPT is of the usual shape (token and position embeddings, pre-LayerNorm blocks of
``nn.MultiheadAttention`` and a 4x MLP, a final LayerNorm and a linear head); the text is the
Python documentation that CPython ships in ``pydoc_data.topics`` (about 465k characters),
available offline on every machine with Python.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


GPT_SIZES = {
    "gpt-0.45m": {"width": 128, "depth": 2, "heads": 4},
    "gpt-25m": {"width": 512, "depth": 8, "heads": 8},
}
"""The small GPT of the quality workloads and its ~25M-parameter scale-up for speed."""


def gpt(size: str, vocab: int, context: int = 64, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab, context, **GPT_SIZES[size])


def text() -> torch.Tensor:
    """CPython's documentation topics as a tensor of character ids (vocabulary: its chars)."""
    from pydoc_data.topics import topics

    chars = "".join(topics[k] for k in sorted(topics))
    vocab = sorted(set(chars))
    lookup = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([lookup[c] for c in chars], dtype=torch.long)


def vocab_size(ids: torch.Tensor) -> int:
    return int(ids.max()) + 1


def text_batch(
    ids: torch.Tensor, batch: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``context`` characters and the next character of each."""
    starts = torch.randint(0, ids.numel() - context - 1, (batch,), generator=generator)
    x = torch.stack([ids[s : s + context] for s in starts.tolist()])
    y = torch.stack([ids[s + 1 : s + context + 1] for s in starts.tolist()])
    return x, y


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW as GPTs are trained: lr 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices only."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))


def powersgd_bytes(model: nn.Module, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes PowerSGD all-reduces per step: P and Q for matrices, other tensors uncompressed.

    A matrix is compressed only when its P and Q are ``min_compression_rate`` times smaller
    than it (PowerSGD's ``_should_compress``, default 2); the others travel whole.
    """
    total = 0
    for p in model.parameters():
        if p.dim() >= 2:
            n, k = p.shape[0], p[0].numel()
            r = min(rank, n, k)
            if (n + k) * r * min_compression_rate < n * k:
                total += 4 * (n + k) * r
                continue
        total += 4 * p.numel()
    return total
