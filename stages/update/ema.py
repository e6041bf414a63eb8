"""The exponential moving average of the trained weights (`update --ema`, flow_grpo's), which the
trainer (trainer.py) steps and the policy directory (checkpoint.py) saves with the trainer state.
"""

from __future__ import annotations

import torch


class EMA:
    """Exponential moving average of the trained weights; decay min((1+k)/(10+k), 0.9) (flow_grpo)."""

    def __init__(self, params: dict[str, torch.Tensor], updates: int = 0):
        self.shadow = {k: v.detach().clone().float() for k, v in params.items()}
        self.updates = updates

    def update(self, params: dict[str, torch.Tensor]) -> None:
        decay = min((1 + self.updates) / (10 + self.updates), 0.9)
        for k, v in params.items():
            self.shadow[k].mul_(decay).add_(v.detach().float(), alpha=1 - decay)
        self.updates += 1
