"""verl-omni's diffusion-loss unit tests, run against omnirl's functions (issue 32's fidelity check).

verl-omni's `tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py` calls its losses and advantage
estimators through `verl_omni.trainer.diffusion.diffusion_algos` and builds their config with hydra.
This script runs that file unchanged with those modules replaced by adapters (`omnirl_algos` below): each
verl-omni entry point calls the omnirl function that does the same job, with verl-omni's arguments
mapped onto omnirl's. Nothing of verl-omni is imported; its test file is read from VERL_OMNI and its
`diffusion_loss` defaults from the actor YAML the tests name (verl_omni/trainer/config/diffusion/actor/).
verl's `DataProto` is not provided, so the tests that build one fail on that import and are reported
as such: they exercise verl-omni's trainer-side batch plumbing, which omnirl does with shard sets.

How the adapters map (reference/verl-omni.md §2):
- `compute_flow_grpo_outcome_advantage`: `stages.advantage.estimators.group_advantages` with Bessel's
  std (`unbiased`, verl-omni's torch.std); std `global` / `group` / `none` from global_std and
  norm_adv_by_std_in_grpo. omnirl holds one reward per sample, so it runs on each column of verl-omni's
  [B, L] rewards.
- `DiffusionNFTLoss._compute_group_advantages`: the same, on [B]; `_advantage_to_reward_prob`:
  `nft_optimality`; `compute_loss`: `family_losses.nft_loss` (t = the first element of each row of
  t_expanded, which is constant per row).
- `flow_grpo` / `dance_grpo`: `losses.clipped_policy_loss` and `ratio_metrics`; pg_clipfrac_higher and
  _lower are split from the ratio as the trainer does (`objectives.PolicyGradient.losses`).
- `grpo_guard`: `family_losses.grpo_guard_loss`, step std s = std_dev_t·sqrt_dt, Δ = −sqrt_dt². omnirl
  computes the normalised ratio from the stored next sample x' rather than from two log-probs, so the
  adapter draws x' = μ_old + s·ε (fixed seed); the test's log-probs enter ppo_kl only, as in omnirl.
- `flow_dppo`: `family_losses.flow_dppo_loss` with s = std_dev_t·sqrt_dt, or s = 1 for verl-omni's
  `add_kl_coefficient: false` (D without the 1/s²; omnirl's update has no option for it).

    python tools/verl_omni_loss_tests.py /tmp/verl-omni            # a table: test, result, reason
    python tools/verl_omni_loss_tests.py /tmp/verl-omni --json     # one object per test

VERL_OMNI is a checkout of github.com/verl-project/verl-omni (a clone, or `git archive HEAD | tar -x`
of a mirror). Exit status 0 when every test passes but those that need DataProto, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from stages.advantage.estimators import group_advantages, nft_optimality
from stages.update.family_losses import flow_dppo_loss, grpo_guard_loss, nft_loss
from stages.update.losses import clipped_policy_loss, ratio_metrics

TEST_FILE = "tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py"
ACTOR_YAML = "diffusion_actor.yaml"  # holds the diffusion_loss block every actor config inherits
NEEDS_DATAPROTO = "DataProto"


# ----------------------------------------------------------------------------- the adapters


def _std_mode(norm_by_std: bool, global_std: bool) -> str:
    return "none" if not norm_by_std else "global" if global_std else "group"


def _group_advantages(
    rewards: torch.Tensor, uid: np.ndarray, norm_by_std: bool, global_std: bool, eps: float
) -> torch.Tensor:
    return group_advantages(
        rewards, list(uid), std=_std_mode(norm_by_std, global_std), eps=eps, unbiased=True
    )


def compute_flow_grpo_outcome_advantage(
    sample_level_rewards: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-4,
    norm_adv_by_std_in_grpo: bool = True,
    global_std: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl-omni's flow_grpo / dance_grpo estimator: omnirl's group advantages per column of [B, L]."""
    columns = [
        _group_advantages(sample_level_rewards[:, j], index, norm_adv_by_std_in_grpo, global_std, epsilon)
        for j in range(sample_level_rewards.shape[1])
    ]
    adv = torch.stack(columns, dim=1)
    return adv, adv


def _clip_split(ratio: torch.Tensor, clip: float) -> dict[str, float]:
    """pg_clipfrac_higher / _lower, split as `objectives.PolicyGradient.losses` logs them."""
    return {
        "actor/pg_clipfrac_higher": (ratio > 1.0 + clip).float().mean().item(),
        "actor/pg_clipfrac_lower": (ratio < 1.0 - clip).float().mean().item(),
    }


class FlowGRPOLoss:
    """flow_grpo / dance_grpo: `clipped_policy_loss`."""

    @classmethod
    def compute_loss(
        cls, *, old_log_prob, log_prob, advantages, config, rollout_is_weights=None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        c = config.diffusion_loss
        res = clipped_policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            clip_range=c.clip_ratio,
            adv_clip=c.adv_clip_max,
            weights=rollout_is_weights,
        )
        metrics = ratio_metrics(res.ratio, res.log_ratio)
        metrics.update(
            {"actor/pg_clipfrac": res.clipped.mean().item(), **_clip_split(res.ratio, c.clip_ratio)}
        )
        return res.loss, metrics


def _step_std(std_dev_t: torch.Tensor, sqrt_dt: torch.Tensor) -> torch.Tensor:
    """verl-omni's σ_t = std_dev_t·sqrt_dt per row, [B] (std_dev_t is [B, 1, ...] or a scalar)."""
    return std_dev_t.reshape(-1) * sqrt_dt.reshape(-1)


class GRPOGuardLoss:
    """grpo_guard: `grpo_guard_loss` on x' = μ_old + s·ε."""

    @classmethod
    def compute_loss(
        cls,
        *,
        old_log_prob,
        log_prob,
        advantages,
        config,
        old_prev_sample_mean,
        prev_sample_mean,
        std_dev_t,
        sqrt_dt,
        rollout_is_weights=None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        c = config.diffusion_loss
        s = _step_std(std_dev_t, sqrt_dt)
        noise = torch.randn(old_prev_sample_mean.shape, generator=torch.Generator().manual_seed(0))
        prev_sample = old_prev_sample_mean + s.view(-1, *([1] * (noise.ndim - 1))) * noise
        res = grpo_guard_loss(
            prev_sample_mean,
            old_prev_sample_mean,
            prev_sample,
            s,
            -(sqrt_dt.reshape(-1) ** 2),
            advantages,
            clip_range=c.clip_ratio,
            adv_clip=c.adv_clip_max,
            weights=rollout_is_weights,
        )
        metrics = ratio_metrics(res.ratio, log_prob - old_log_prob)
        metrics.update(
            {"actor/pg_clipfrac": res.clipped.mean().item(), **_clip_split(res.ratio, c.clip_ratio)}
        )
        return res.loss, metrics


class FlowDPPOLoss:
    """flow_dppo: `flow_dppo_loss`."""

    @classmethod
    def compute_loss(
        cls,
        *,
        old_log_prob,
        log_prob,
        advantages,
        config,
        old_prev_sample_mean,
        prev_sample_mean,
        std_dev_t,
        sqrt_dt,
        rollout_is_weights=None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        c = config.diffusion_loss
        s = _step_std(std_dev_t, sqrt_dt) if c.add_kl_coefficient else 1.0
        res = flow_dppo_loss(
            prev_sample_mean,
            old_prev_sample_mean,
            s,
            log_prob,
            old_log_prob,
            advantages,
            kl_threshold=c.kl_mask_threshold,
            weights=rollout_is_weights,
        )
        return res.loss, {**ratio_metrics(res.ratio, res.log_ratio), **res.extra}


class DiffusionNFTLoss:
    """diffusion_nft: `nft_loss`, and the optimality weight's two helpers."""

    @classmethod
    def compute_loss(
        cls,
        *,
        forward_prediction,
        old_prediction,
        ref_forward_prediction,
        x0,
        xt,
        t_expanded,
        reward_prob,
        config,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        c = config.diffusion_loss
        r = reward_prob.flatten(1).mean(dim=1) if reward_prob.ndim > 1 else reward_prob
        return nft_loss(
            forward_prediction,
            old_prediction,
            ref_forward_prediction,
            x0,
            xt,
            t_expanded.flatten(1)[:, 0],
            r,
            beta=c.mix_beta,
            kl_beta=c.ref_kl_coef,
            adv_clip=c.adv_clip_max,
            weight_floor=c.adaptive_weight_min,
        )

    @staticmethod
    def _compute_group_advantages(rewards, uid, norm_by_std, global_std, epsilon=1e-4) -> torch.Tensor:
        return _group_advantages(rewards, uid, norm_by_std, global_std, epsilon)

    @staticmethod
    def _advantage_to_reward_prob(advantages, adv_clip_max, adv_mode) -> torch.Tensor:
        return nft_optimality(advantages, adv_clip_max, adv_mode)


LOSSES = {
    "flow_grpo": FlowGRPOLoss,
    "dance_grpo": FlowGRPOLoss,
    "grpo_guard": GRPOGuardLoss,
    "flow_dppo": FlowDPPOLoss,
    "diffusion_nft": DiffusionNFTLoss,
}


def get_diffusion_loss_fn(name: str) -> Any:
    if name not in LOSSES:
        raise ValueError(f"no omnirl adapter for verl-omni loss_mode {name!r}")
    return LOSSES[name]()


# ----------------------------------------------------------------------------- hydra and verl stand-ins


def _number(value: Any) -> Any:
    """A YAML value as hydra reads it: '1e-5' (a string to YAML 1.1) is a float; ${oc.select:K,D} is D."""
    if isinstance(value, str):
        select = re.fullmatch(r"\$\{oc\.select:[^,]*,(.*)\}", value)
        if select:
            return _number(select.group(1))
        with contextlib.suppress(ValueError):
            return float(value)
    return value


def _namespace(tree: dict[str, Any]) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        **{
            k: _namespace(v) if isinstance(v, dict) else _number(v)
            for k, v in tree.items()
            if k != "_target_"
        }
    )


class _Hydra:
    """`initialize_config_dir` + `compose` over the actor YAML's diffusion_loss block and the overrides."""

    config_dir: Path | None = None

    @classmethod
    @contextlib.contextmanager
    def initialize_config_dir(cls, config_dir: str, version_base: Any = None) -> Iterator[None]:
        cls.config_dir = Path(config_dir)
        yield
        cls.config_dir = None

    @classmethod
    def compose(cls, config_name: str, overrides: list[str]) -> types.SimpleNamespace:
        assert cls.config_dir is not None, "compose outside initialize_config_dir"
        tree = {"diffusion_loss": yaml.safe_load((cls.config_dir / ACTOR_YAML).read_text())["diffusion_loss"]}
        for item in overrides:
            path, value = item.split("=", 1)
            *parents, leaf = path.split(".")
            node = tree
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = yaml.safe_load(value)
        return _namespace(tree)


def install_stand_ins() -> None:
    """Put the adapters under verl-omni's module names, and hydra / verl stand-ins, in sys.modules."""

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package, so submodules resolve from sys.modules
        sys.modules[name] = m
        return m

    algos = module(
        "verl_omni.trainer.diffusion.diffusion_algos",
        compute_flow_grpo_outcome_advantage=compute_flow_grpo_outcome_advantage,
        get_diffusion_loss_fn=get_diffusion_loss_fn,
        DiffusionNFTLoss=DiffusionNFTLoss,
    )
    module("verl_omni")
    module("verl_omni.trainer")
    module("verl_omni.trainer.diffusion", diffusion_algos=algos)
    for name in ("verl_omni.workers", "verl_omni.workers.config", "verl_omni.workers.config.diffusion"):
        module(name)
    module("verl_omni.workers.config.diffusion.actor", FSDPDiffusionActorConfig=types.SimpleNamespace)
    module("hydra", initialize_config_dir=_Hydra.initialize_config_dir, compose=_Hydra.compose)
    module("verl")  # no DataProto: the tests that build one fail on its import
    module("verl.utils")
    module("verl.utils.config", omega_conf_to_dataclass=lambda cfg: cfg)


# ----------------------------------------------------------------------------- the run


class _Collector:
    """pytest plugin: each test's outcome and the first line of its failure."""

    def __init__(self) -> None:
        self.results: list[dict[str, str]] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            reason = ""
            if report.failed:
                lines = [ln for ln in str(report.longrepr).splitlines() if ln.startswith("E ")]
                reason = (lines[0][1:].strip() if lines else str(report.longrepr).splitlines()[-1])[:160]
            self.results.append(
                {"test": report.nodeid.split("::", 1)[1], "result": report.outcome, "reason": reason}
            )


def run(verl_omni: Path) -> list[dict[str, str]]:
    """Run TEST_FILE of the checkout `verl_omni` against the adapters: one {test, result, reason} per test."""
    install_stand_ins()
    collector = _Collector()
    cwd = os.getcwd()
    os.chdir(verl_omni)  # the tests name their config directory relative to the checkout
    try:
        pytest.main(
            [
                TEST_FILE,
                "-q",
                "--tb=short",
                "-p",
                "no:cacheprovider",
                "--noconftest",
                "--import-mode=importlib",
                "--rootdir",
                str(verl_omni),
                "-o",
                "addopts=",
            ],
            plugins=[collector],
        )
    finally:
        os.chdir(cwd)
    return collector.results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_omni", type=Path, help="a checkout of verl-project/verl-omni")
    parser.add_argument("--json", action="store_true", help="one JSON object per test on stdout")
    args = parser.parse_args()
    if not (args.verl_omni / TEST_FILE).is_file():
        print(f"{args.verl_omni}: no {TEST_FILE}; pass a checkout of verl-project/verl-omni", file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # pytest's own report is progress
        results = run(args.verl_omni.resolve())
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print("| test | result | reason |\n|---|---|---|")
        for r in results:
            print(f"| `{r['test']}` | {r['result']} | {r['reason'].replace('|', '/')} |")
    passed = sum(r["result"] == "passed" for r in results)
    dataproto = sum(r["result"] != "passed" and NEEDS_DATAPROTO in r["reason"] for r in results)
    print(
        f"{passed} passed, {len(results) - passed} failed ({dataproto} need verl's DataProto)",
        file=sys.stderr,
    )
    return 0 if passed + dataproto == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
