"""One rank of a torchrun launch for tests/gpu/test_gpu_parallelism.py: a FLUX transformer's velocity and
LoRA gradients with the whole sequence in this process, then with sequence parallelism over every rank of
the launch (`--sp-kind`, `--attention-backend`), its gradients summed over the group (each rank's
backward covers its own part of the sequence: stages/parallelism.py). Rank 0 prints one JSON object: the
relative differences ‖sp − whole‖ / ‖whole‖ of the velocity and of the gradient. With `--tp`, tensor
parallelism over every rank instead, for the velocity of a rollout step (no LoRA: diffusers' plan shards
plain linear layers only), and the family's own guidance (`--guidance`).

    torchrun --standalone --nproc_per_node 2 tests/gpu/sp_probe.py MODEL --sp-kind ring \
        --attention-backend _native_cudnn --dtype bf16 --resolution 256
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from stages.dist import all_reduce_sum, device, world_and_rank
from stages.models.diffusion import FlowPolicy
from stages.models.kernels import Kernels, prepare
from stages.parallelism import ModelParallel, parallelize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--sp-kind", default="ulysses")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--resolution", default="256")
    ap.add_argument("--tp", action="store_true", help="tensor parallelism (velocity only) instead of sp")
    ap.add_argument("--guidance", type=float, default=3.5)
    ap.add_argument("--json", action="store_true", help="accepted for tests/helpers.torchrun; always JSON")
    args = ap.parse_args()

    on = device()  # joins the launch's process group
    world, rank = world_and_rank()
    policy = FlowPolicy.load(args.model, device=on, dtype=args.dtype)
    if args.tp:
        return tensor_parallel(policy, args, on, world, rank)
    policy.add_lora(rank=8, alpha=8, seed=0)
    params = policy.trainable_parameters()
    # a fresh adapter's B is zero (so A has no gradient): give every B the same small seeded values
    seeded = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=seeded))
    prepare(policy.parts, ModelParallel(), Kernels(attention_backend=args.attention_backend))
    x = policy.initial_noise([0], args.resolution)
    sigma = policy.sigmas(4, args.resolution)[1]
    cond = policy.encode(["a sign that says omnirl"], None, False)

    def velocity_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        v = policy.velocity(x, sigma, cond, 3.5)
        grads = torch.autograd.grad(v.float().square().mean(), params)
        return v.detach().float(), torch.cat([g.flatten() for g in grads]).float()

    whole_v, whole_g = velocity_and_grad()
    parallelize(policy.parts, ModelParallel(sp_degree=world, sp_kind=args.sp_kind))
    sp_v, sp_g = velocity_and_grad()
    sp_g = all_reduce_sum(sp_g, on)

    if rank == 0:
        report = {"world": world, "sp_kind": args.sp_kind, "backend": args.attention_backend}
        report |= {"velocity_rel": rel(sp_v, whole_v), "grad_rel": rel(sp_g, whole_g)}
        report |= {"grad_norm": float(whole_g.norm()), "latent_shape": list(x.shape)}
        print(json.dumps(report))
    return 0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return float((a - b).norm() / b.norm())


def tensor_parallel(
    policy: FlowPolicy, args: argparse.Namespace, on: torch.device, world: int, rank: int
) -> int:
    """One rollout step's velocity with the whole transformer here, then with its linear layers split over
    every rank of the launch (`--tp-degree`); rank 0 prints the relative difference."""
    x = policy.initial_noise([0], args.resolution)
    sigma = policy.sigmas(4, args.resolution)[1]
    cfg = policy.needs_negative(args.guidance)
    cond = policy.encode(["a sign that says omnirl"], None, cfg)
    with torch.no_grad():
        whole = policy.velocity(x, sigma, cond, args.guidance).float()
        parallelize(policy.parts, ModelParallel(tp_degree=world))
        split = policy.velocity(x, sigma, cond, args.guidance).float()
    if rank == 0:
        report = {"world": world, "tp": True, "velocity_rel": rel(split, whole), "norm": float(whole.norm())}
        print(json.dumps(report | {"latent_shape": list(x.shape)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
