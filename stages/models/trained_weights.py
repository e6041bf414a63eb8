"""The trained weights of a `FlowPolicy` (diffusion.py), as the methods its class takes from here.

Attaching a fresh LoRA (`add_lora`), marking the trained parameters (`trainable_parameters`), running the
frozen base model (`reference`) or other weights (`weights`: DiffusionNFT's old policy, AWM's old/EMA
weights) inside a block, and a LoRA as file bytes or swapped in place (`lora_file`, `set_lora`: the
rollout server's weight updates).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.families import FamilyAdapter
from stages.models.lora_weights import lora_file, swap_lora


class TrainedWeights:
    """`FlowPolicy`'s methods over its trained weights; the policy holds the state they read."""

    parts: dict[str, torch.nn.Module]  # the trained pipeline modules by attribute (one, or each expert)
    transformer: torch.nn.Module  # the network they form (swapped for `_reference` by `reference`)
    module: torch.nn.Module  # the trained network, unwrapped
    family: FamilyAdapter
    lora: bool
    model_path: str
    device: torch.device
    dtype: torch.dtype
    _reference: torch.nn.Module | None  # the frozen base network a full fine-tune loads once

    def add_lora(
        self, *, rank: int = 32, alpha: int = 64, targets: tuple[str, ...] | None = None, seed: int = 0
    ) -> None:
        """Attach a fresh LoRA adapter (gaussian A, zero B: the policy starts equal to the base model) on
        `targets`, by default the family's (the reference trainers' list), to every trained module (each
        expert gets its own)."""
        from peft import LoraConfig

        targets = self.family.lora_targets if targets is None else targets
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for part in self.parts.values():
                part.add_adapter(
                    LoraConfig(
                        r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets)
                    )
                )
        self.lora = True

    def trainable_parameters(self, full: bool = False) -> list[torch.nn.Parameter]:
        """Mark and return the trained parameters: LoRA weights, or every weight of the trained module
        with `full`. They are cast to fp32 whatever --dtype (diffusers' `cast_training_params`), so the
        optimizer steps in fp32; --dtype stays the storage dtype of the frozen weights."""
        if full and not self.family.full_weights:
            raise UserInputError(
                f"--full: {self.family.name} trains a LoRA only (on {', '.join(self.family.lora_targets)}); "
                "drop --full and pass --lora-rank"
            )
        params = []
        for name, p in self.transformer.named_parameters():
            train = full or "lora_" in name
            p.requires_grad_(train)
            if train:
                p.data = p.data.float()
                params.append(p)
        if not params:
            raise UserInputError(
                "nothing to train: the policy has no LoRA adapter; pass --lora-rank > 0 or --full"
            )
        return params

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Run the frozen base model inside the block, for KL references.

        With LoRA the adapter is switched off; with full fine-tuning a frozen copy of the base
        transformer (loaded once from the model folder) stands in for the trained one.
        """
        if self.lora:
            adapted = [part for part in self.parts.values() if getattr(part, "peft_config", None)]
            for part in adapted:
                part.disable_adapters()
            try:
                yield
            finally:
                for part in adapted:
                    part.enable_adapters()
            return
        if self._reference is None:
            self._reference = self.family.trained_network(
                {
                    name: self.family.load_trained(Path(self.model_path), name, self.dtype)
                    .to(self.device)
                    .requires_grad_(False)
                    .eval()
                    for name, part in self.parts.items()
                }
            )
        trained, self.transformer = self.transformer, self._reference
        try:
            yield
        finally:
            self.transformer = trained

    @contextmanager
    def weights(self, state: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Run the transformer with `state` (name → tensor) in place of those weights inside the block.

        Used for DiffusionNFT's old policy and AWM's old/EMA weights. Plain parameters get the tensors
        swapped in (no copies, and the autograd graph of an earlier forward keeps its own). A sharded
        module (FSDP2, resharded after each forward) gathers its weights from the shards' own storage
        at every forward, so there the values are copied into the shards and back.
        """
        from torch.distributed.tensor import DTensor

        params = dict(self.module.named_parameters())
        state = state or {}
        if any(isinstance(params[name], DTensor) for name in state):
            saved = {name: params[name].detach().clone() for name in state}
            with torch.no_grad():
                for name, value in state.items():
                    params[name].copy_(value)
            try:
                yield
            finally:
                with torch.no_grad():
                    for name, value in saved.items():
                        params[name].copy_(value)
            return
        swapped = {}
        try:
            for name, value in state.items():
                swapped[name] = params[name].data
                params[name].data = value.to(params[name].device, params[name].dtype)
            yield
        finally:
            for name, value in swapped.items():
                params[name].data = value

    # ---------------------------------------------------------------- LoRA in memory
    def _one_trained_module(self, what: str) -> None:
        if len(self.parts) > 1:
            raise UserInputError(
                f"{what} takes a family with one trained module; this one trains {', '.join(self.parts)}: "
                "load the adapter folder instead (`omnirl serve --adapter`, or POST its path)"
            )

    def lora_file(self) -> bytes:
        """The trained module's LoRA as the bytes of a diffusers LoRA file (`lora_weights.lora_file`)."""
        self._one_trained_module("sending LoRA weights as one file")
        return lora_file(self.module, self.family.trained_module)

    def set_lora(self, layers: dict[str, torch.Tensor] | None, config: dict[str, Any] | None) -> str:
        """Swap LoRA `layers` of `config` onto the trained module in place of its adapter (None: the base
        model), without reloading anything (`lora_weights.swap_lora`); returns how it was done."""
        self._one_trained_module("swapping LoRA weights in place")
        how = swap_lora(self.module, layers, config)
        self.lora = bool(getattr(self.module, "peft_config", None))
        return how
