"""Supervised fine-tuning on (prompt, target) token pairs: loss on target tokens only."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pivotrl.model import Decoder

# draws one batch of (prompt_ids, target_ids) pairs; target ends with the stop token
BatchFn = Callable[[random.Random, int], list[tuple[list[int], list[int]]]]


def sft(
    model: Decoder,
    batch_fn: BatchFn,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: Callable[[int, float], None] | None = None,
) -> float:
    """Train ``model`` in place with AdamW, warmup then cosine decay. Returns the last loss."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        pairs = batch_fn(rng, batch_size)
        rows = [p + t for p, t in pairs]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        labels = torch.full_like(ids, -100)
        for i, (p, t) in enumerate(pairs):
            labels[i, len(p) - 1 : len(p) - 1 + len(t)] = torch.tensor(t)
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if progress is not None:
            progress(step, loss_value)
    model.eval()
    return loss_value
