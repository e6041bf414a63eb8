"""`update`'s conventions against the references (issue 10: items 5, 15, 16, 17, 18, 21).

The objectives run on stand-in policies (a two-parameter velocity field, a fixed table of token
log-probs), so every number is checked against float64 formulas written out here: the advantage clip
of the token algorithms (verl: none), GSPO's aggregation (verl), the KL divisor of each sampler
(flow_grpo for sde, verl-omni's exact Gaussian KL for dance), the ratio metrics (verl-omni's names,
flow_grpo's approx_kl), and a continued update that takes this run's optimizer settings.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from omnirl_cli.app import app
from stages.advantage.estimators import ESTIMATORS
from stages.models.kernels import Kernels
from stages.parallelism import ModelParallel
from stages.sample.rollout import SampleConfig
from stages.sample.samplers import step
from stages.update.config import UpdateConfig
from stages.update.config_rules import ALGORITHM_NAMES
from stages.update.losses import ALGORITHMS, get_algorithm
from stages.update.policy_gradient import PolicyGradient
from stages.update.token_losses import grpo_loss
from stages.update.token_objective import TokenPolicyGradient
from stages.update.trainer import Trainer, load_state, save_state

SHAPE = (1, 2, 2)  # latent [C, H, W]


class FakeFlow:
    """What PolicyGradient and the Trainer use of a FlowPolicy, with velocity v = w·x + b (w scalar, b per pixel)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.module = torch.nn.Module()
        self.module.w = torch.nn.Parameter(torch.tensor(0.5))
        self.module.b = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4).reshape(SHAPE))

    def trainable_parameters(self, full: bool = False) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def sigmas(self, steps: int, resolution: int) -> torch.Tensor:
        return torch.linspace(1.0, 0.0, steps + 1)

    def needs_negative(self, guidance: float) -> bool:
        return False

    def encode(self, *args: object) -> None:
        return None

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: object,
        guidance: float,
        guidance_2: float | None = None,
    ) -> torch.Tensor:
        return self.module.w * x + self.module.b


SIGMAS = torch.tensor([0.9, 0.6, 0.3])  # two stored steps; σ' > 0, so every step is stochastic


def rollout(policy: FakeFlow, sampler: str, eta: float, rows: int = 4) -> tuple[dict, list]:
    """A stored rollout of `rows` samples under `policy` (seeded), and the step outputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, *SHAPE, generator=gen)
    latents, log_probs, outs = [x], [], []
    for k in range(len(SIGMAS) - 1):
        eps = torch.randn(rows, *SHAPE, generator=gen)
        with torch.no_grad():
            v = policy.velocity(x, SIGMAS[k], None, 1.0)
            out = step(sampler, v, x, SIGMAS[k], SIGMAS[k + 1], noise_level=eta, noise=eps)
        x = out.prev_sample
        latents.append(x)
        log_probs.append(out.log_prob)
        outs.append(out)
    adv = torch.tensor([1.5, -0.5, 0.25, -1.25])[:rows]
    data = {
        "prompt": ["p"] * rows,
        "latents": torch.stack(latents, 1),
        "sigmas": SIGMAS.expand(rows, -1).clone(),
        "log_probs": torch.stack(log_probs, 1),
        "advantages": adv[:, None].expand(rows, len(SIGMAS) - 1).clone(),
    }
    return data, outs


def scfg(sampler: str, eta: float) -> SampleConfig:
    return SampleConfig(steps=2, guidance=1.0, sampler=sampler, noise_level=eta, batch_size=4)


def step_metrics(objective: PolicyGradient, rows: int = 4) -> list[dict[str, float]]:
    """Metric records of every trained step of one micro-batch holding all rows."""
    (chunk,) = objective.epoch(list(range(rows)), rows, random.Random(0))
    return [dict(zip(objective.metric_keys, values)) for _, values in objective.losses(chunk)]


# ---------------------------------------------------------------- item 17: the KL divisor per sampler


@pytest.mark.parametrize("sampler", ["dance", "sde"])
def test_kl_to_reference_divides_by_each_references_variance(sampler: str) -> None:
    """dance: the exact KL of the two step Gaussians N(μ, s²), s = η·sqrt(σ − σ') (verl-omni dance_sde);
    sde: flow_grpo's mean (μ − μ_ref)²/(2g²), g = a·sqrt(σ/(1 − σ))."""
    eta = 0.7
    policy = FakeFlow()
    data, outs = rollout(policy, sampler, eta)
    gap = torch.tensor([0.03, -0.02, 0.05, 0.01]).view(4, 1, 1, 1) * torch.tensor([1.0, -2.0, 0.5, 3.0]).view(
        1, *SHAPE
    )
    data["ref_means"] = torch.stack([o.mean + gap for o in outs], 1)  # μ_ref = μ + δ at both steps
    cfg = UpdateConfig(algo="dance_grpo" if sampler == "dance" else "flow_grpo", beta=0.1)
    objective = PolicyGradient(policy, data, scfg(sampler, eta), cfg, get_algorithm(cfg.algo))
    got = step_metrics(objective)[0]["actor/kl_loss"]  # stored step 0: σ = 0.9 → σ' = 0.6

    sigma, sigma_next = 0.9, 0.6
    # dance: the step variance s²; sde: g², flow_grpo's divisor (= the exact KL · |Δσ|)
    d2 = eta**2 * (sigma - sigma_next) if sampler == "dance" else eta**2 * sigma / (1 - sigma)
    delta = gap.double().numpy()
    expected = float(np.mean(np.mean(delta.reshape(4, -1) ** 2, axis=1) / (2 * d2)))
    assert got == pytest.approx(expected, rel=1e-4)


# ---------------------------------------------------------------- item 18: ratio metrics


def test_ratio_metrics_on_a_hand_made_vector() -> None:
    from stages.update.losses import ratio_metrics

    log_r = torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float64)
    m = ratio_metrics(torch.exp(log_r), log_r)
    r = [math.exp(x) for x in (0.1, -0.2, 0.3, 0.0)]
    assert m["actor/ppo_kl"] == pytest.approx(-0.05, abs=1e-12)  # verl-omni: mean(−log r)
    assert m["actor/approx_kl"] == pytest.approx(0.5 * (0.01 + 0.04 + 0.09) / 4, rel=1e-12)  # flow_grpo
    assert m["actor/ratio_mean"] == pytest.approx(sum(r) / 4, rel=1e-12)
    assert m["actor/ratio_std"] == pytest.approx(statistics.stdev(r), rel=1e-12)  # Bessel, as torch.std
    assert ratio_metrics(torch.ones(1), torch.zeros(1))["actor/ratio_std"] == 0.0


def test_policy_gradient_logs_verl_omni_and_flow_grpo_quantities() -> None:
    policy = FakeFlow()
    data, _ = rollout(policy, "sde", 0.7)
    with torch.no_grad():
        policy.module.w += 0.05  # off-policy: ratios leave 1
    cfg = UpdateConfig(algo="flow_grpo")
    records = step_metrics(PolicyGradient(policy, data, scfg("sde", 0.7), cfg, get_algorithm("flow_grpo")))
    assert len(records) == 2
    for k, record in enumerate(records):
        x, x_next = data["latents"][:, k], data["latents"][:, k + 1]
        with torch.no_grad():
            v = policy.velocity(x, SIGMAS[k], None, 1.0)
            new = step("sde", v, x, SIGMAS[k], SIGMAS[k + 1], noise_level=0.7, prev_sample=x_next).log_prob
        log_r = (new - data["log_probs"][:, k]).double().tolist()
        assert max(abs(v) for v in log_r) > 1e-3
        r = [math.exp(v) for v in log_r]
        assert record["actor/ppo_kl"] == pytest.approx(-sum(log_r) / 4, rel=1e-4)
        assert record["actor/approx_kl"] == pytest.approx(sum(v * v for v in log_r) / 8, rel=1e-4)
        assert record["actor/ratio_std"] == pytest.approx(statistics.stdev(r), rel=1e-3)


# ---------------------------------------------------------------- item 5: a continued update


def test_continued_update_uses_this_runs_optimizer_settings(tmp_path: Path) -> None:
    policy = FakeFlow()
    data, _ = rollout(policy, "sde", 0.7)
    sample_cfg = scfg("sde", 0.7)
    first = UpdateConfig(algo="flow_grpo", lr=1e-2, micro_batch=2)
    trainer = Trainer(policy, first, {})
    metrics = trainer.step(data, sample_cfg)
    assert [m["actor/lr"] for m in metrics] == [1e-2, 1e-2]
    save_state(tmp_path, trainer.state(), metrics[-1]["step"], first)
    state, start = load_state(tmp_path)
    assert start == 2

    before = [p.detach().clone() for p in policy.module.parameters()]
    second = UpdateConfig(
        algo="flow_grpo", lr=0.0, weight_decay=0.25, betas=(0.5, 0.75), adam_eps=1e-3, micro_batch=2
    )
    trainer = Trainer(policy, second, state, start)
    metrics = trainer.step(data, sample_cfg)
    for group in trainer.optimizer.param_groups:
        assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (
            0.0,
            (0.5, 0.75),
            0.25,
            1e-3,
        )
    assert [m["actor/lr"] for m in metrics] == [0.0, 0.0]  # the effective lr, read from the optimizer
    for p, b in zip(policy.module.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)  # lr 0: nothing moved (the saved lr 1e-2 would have)
    moments = trainer.optimizer.state[next(iter(policy.module.parameters()))]
    assert float(moments["step"]) == 4  # the saved moments carried over


def test_a_preset_section_is_an_update_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset's `update:` mapping is an UpdateConfig as it stands: YAML's list of betas becomes a pair,
    an unset mixed precision is the launcher's, the model-parallel and kernel knobs make the trainer's
    settings, and the adapter records the training settings, not where the run reads and writes."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")
    cfg = UpdateConfig(
        lr=0.5, betas=[0.5, 0.6], algo="dapo", out=Path("x"), model="m", sp_degree=2, compile=True
    )
    assert (cfg.lr, cfg.betas, cfg.algo, cfg.adam_eps, cfg.mixed_precision) == (
        0.5,
        (0.5, 0.6),
        "dapo",
        1e-8,
        "bf16",
    )
    assert cfg.parallel == ModelParallel(sp_degree=2) and cfg.kernels == Kernels(compile=True)
    recorded = cfg.settings()
    assert recorded["sp_degree"] == 2 and recorded["lr"] == 0.5 and recorded["ema_every"] == 8
    assert not {"inputs", "out", "model", "adapter", "dtype", "report_to", "run_name"} & set(recorded)
    assert UpdateConfig(mixed_precision="no").mixed_precision == "no"


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--lr", "-1"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--weight-decay", "-0.1"], "--weight-decay"),
        (["--adam-eps", "0"], "--adam-eps"),
        (["--adam-betas", "1.0", "0.999"], "--adam-betas"),
        (["--adam-betas", "0.9", "-0.1"], "--adam-betas"),
        (["--max-grad-norm", "-1"], "--max-grad-norm"),
        (["--adv-clip", "-1"], "--adv-clip"),
        (["--algo", "nft", "--adv-clip", "0"], "--adv-clip"),
        (["--samples-per-step", "4", "--grad-accum", "2"], "--samples-per-step 4 and --grad-accum 2"),
    ],
)
def test_impossible_optimiser_values_are_one_line_exit_2(
    tmp_path: Path, args: list[str], option: str
) -> None:
    result = CliRunner().invoke(
        app,
        [
            "update",
            "--model",
            str(tmp_path),  # an existing folder: the option values are refused before anything loads
            "--in",
            str(tmp_path / "x"),
            "--out",
            str(tmp_path / "o"),
            *args,
        ],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and option in lines[0], result.output


def test_one_trainer_stepped_twice_equals_a_save_and_resume_between_the_steps(tmp_path: Path) -> None:
    """`online` keeps one Trainer across iterations where staged updates save and resume between them:
    weights, AdamW moments, the EMA and the lr schedule's position agree bit for bit."""
    cfg = UpdateConfig(
        algo="flow_grpo",
        lr=1e-2,
        micro_batch=2,
        ema=True,
        ema_every=1,
        lr_scheduler="linear",
        lr_warmup_steps=1,
        lr_total_steps=8,
    )
    data, _ = rollout(FakeFlow(), "sde", 0.7)
    sample_cfg = scfg("sde", 0.7)
    kept = Trainer(FakeFlow(), cfg, {})
    kept.step(data, sample_cfg, seed=0)
    second = kept.step(data, sample_cfg, seed=1)

    first = Trainer(FakeFlow(), cfg, {})
    first.step(data, sample_cfg, seed=0)
    save_state(tmp_path, first.state(), first.global_step, cfg)
    policy = FakeFlow()  # as `update --adapter` loads the first update's weights
    policy.module.load_state_dict(first.policy.module.state_dict())
    resumed = Trainer.resume(policy, cfg, tmp_path)
    assert resumed.global_step == 2
    again = resumed.step(data, sample_cfg, seed=1)

    assert kept.global_step == resumed.global_step == 4
    lrs = [1e-2 * (1 - 1 / 7), 1e-2 * (1 - 2 / 7)]  # steps 2 and 3: linear decay after 1 warmup step
    assert [m["actor/lr"] for m in again] == [m["actor/lr"] for m in second] == pytest.approx(lrs)
    assert [m["actor/pg_loss"] for m in again] == [m["actor/pg_loss"] for m in second]
    for (name, p), q in zip(kept.named.items(), resumed.named.values(), strict=True):
        assert torch.equal(p, q), name
        a, b = kept.optimizer.state[p], resumed.optimizer.state[q]
        assert all(torch.equal(a[key], b[key]) for key in ("step", "exp_avg", "exp_avg_sq")), name
        assert torch.equal(kept.ema.shadow[name], resumed.ema.shadow[name]), name
    assert kept.ema.updates == resumed.ema.updates == 4


# ---------------------------------------------------------------- token objectives (items 15, 16)


class FakeVLM:
    """What TokenPolicyGradient uses of a VLMPolicy: a fixed table of response log-probs and entropies."""

    device = torch.device("cpu")
    moe = False

    def __init__(self, logp: torch.Tensor, entropy: torch.Tensor) -> None:
        self.logp, self.entropy = logp, entropy

    def response_forward(self, inputs, tokens, mask, temperature, *, entropy, entropy_grad, router):
        from stages.models.vlm import ResponseForward

        return ResponseForward(self.logp[:, : tokens.shape[1]], self.entropy[:, : tokens.shape[1]])


def token_objective(
    monkeypatch: pytest.MonkeyPatch,
    cfg: UpdateConfig,
    lengths: list[int],
    adv: list[float],
    **cols: torch.Tensor,
) -> tuple[TokenPolicyGradient, FakeVLM]:
    """The objective over rows with the given response lengths (prompt handling stubbed out)."""
    from stages.sample import vlm_stage

    monkeypatch.setattr(vlm_stage, "row_media", lambda data, where: [{} for _ in data["sample_id"]])
    monkeypatch.setattr(vlm_stage, "prompt_inputs", lambda *args: {})
    n, width = len(lengths), max(lengths) + 1
    mask = torch.tensor([[t < m for t in range(width)] for m in lengths])
    logp = cols.pop("logp").requires_grad_(True)
    entropy = cols.pop("entropy", torch.zeros(n, width))
    data = {
        "sample_id": [f"s{i}" for i in range(n)],
        "group_id": ["g"] * n,
        "prompt": ["q"] * n,
        "images": [b""] * n,
        "prompt_ids": torch.zeros(n, 1, dtype=torch.int64),
        "prompt_mask": torch.ones(n, 1, dtype=torch.int64),
        "response_ids": torch.ones(n, width, dtype=torch.int64),
        "response_mask": mask.long(),
        "advantages": torch.tensor(adv)[:, None],
        **cols,
    }
    policy = FakeVLM(logp, entropy)
    objective = TokenPolicyGradient(
        policy, data, SimpleNamespace(temperature=1.0), cfg, get_algorithm(cfg.algo)
    )
    return objective, policy


def run_token_step(objective: TokenPolicyGradient, rows: int) -> tuple[torch.Tensor, dict[str, float]]:
    (chunk,) = objective.epoch(list(range(rows)), rows, random.Random(0))
    ((loss, values),) = list(objective.losses(chunk))
    return loss, dict(zip(objective.metric_keys, values))


def test_one_success_in_a_group_of_64_keeps_its_advantage(monkeypatch: pytest.MonkeyPatch) -> None:
    rewards = [1.0] + [0.0] * 63
    adv = ESTIMATORS["grpo_verl"](rewards, ["g"] * 64)
    # mean 1/64, Bessel std 1/8: A = (63/64)/(1/8 + 1e-6) = 7.87494
    assert adv[0].item() == pytest.approx((63 / 64) / (0.125 + 1e-6), rel=1e-6)
    for name in ("grpo", "dapo", "gspo"):
        assert UpdateConfig(algo=name).advantage_clip() is None  # verl never clips
    for name in ("flow_grpo", "dance_grpo", "mix_grpo", "grpo_guard", "nft", "awm"):
        assert UpdateConfig(algo=name).advantage_clip() == 5.0  # flow_grpo / verl-omni adv_clip_max
    assert UpdateConfig(algo="flow_grpo", adv_clip=0).advantage_clip() is None
    assert UpdateConfig(algo="grpo", adv_clip=2.0).advantage_clip() == 2.0

    lengths = [3] * 64
    logp = torch.full((64, 4), -1.0)
    objective, policy = token_objective(
        monkeypatch, UpdateConfig(algo="grpo"), lengths, adv.tolist(), logp=logp, old_log_probs=logp.clone()
    )
    loss, _ = run_token_step(objective, 64)
    loss.backward()
    # on-policy token-mean: ∂L/∂logp of each token = −A_b / (64·3)
    grad = policy.logp.grad[0, :3]
    torch.testing.assert_close(grad, torch.full((3,), -adv[0].item() / 192), rtol=1e-5, atol=0)


# 3 responses, lengths 3, 2, 4; ratios near 1 so GSPO's 3e-4/4e-4 band clips some sequences.
LENGTHS = [3, 2, 4]
RATIOS = [[1.0002, 0.9999, 1.0003], [1.001, 1.0], [0.9998, 1.0001, 1.0, 1.0002]]
REF_GAP = [[0.3, -0.1, 0.2], [0.05, 0.4], [-0.2, 0.1, 0.0, 0.25]]  # logp − ref_logp
ENTROPY = [[0.5, 1.0, 1.5], [2.0, 0.25], [1.0, 1.0, 0.5, 0.75]]
ADV = [1.0, -0.5, -2.0]


def table(rows: list[list[float]], fill: float = 0.0, width: int = 5) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def gspo_reference(mode: str) -> dict[str, float]:
    """verl's GSPO in float64: policy term seq-mean-token-mean of max(−A·s, −A·clip(s)), s the geometric
    mean ratio; KL (k3) and entropy aggregated with `mode` (token-mean or seq-mean-token-sum here)."""
    s = [math.exp(np.mean(np.log(r))) for r in RATIOS]
    pg = float(np.mean([max(-a * si, -a * min(max(si, 1 - 3e-4), 1 + 4e-4)) for a, si in zip(ADV, s)]))

    def agg(rows: list[list[float]]) -> float:
        if mode == "token-mean":
            return sum(map(sum, rows)) / sum(map(len, rows))
        return float(np.mean([sum(r) for r in rows]))

    kl = agg([[math.exp(-d) + d - 1 for d in row] for row in REF_GAP])
    return {"pg_loss": pg, "kl_loss": kl, "entropy": agg(ENTROPY)}


def gspo_inputs() -> dict[str, torch.Tensor]:
    old = table([[-1.0 - 0.1 * t for t in range(n)] for n in LENGTHS])
    logp = old + table([[math.log(r) for r in row] for row in RATIOS])
    return {"logp": logp, "old": old, "ref": logp - table(REF_GAP), "entropy": table(ENTROPY)}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_gspo_policy_term_ignores_the_aggregation_that_kl_and_entropy_follow(mode: str) -> None:
    t = gspo_inputs()
    mask = table([[1.0] * n for n in LENGTHS]).bool()
    kwargs = {} if mode == "token-mean" else {"agg_mode": mode}  # token-mean is verl's default
    total, m = grpo_loss(
        t["logp"],
        t["old"],
        torch.tensor(ADV),
        mask,
        ref_logp=t["ref"],
        entropy=t["entropy"],
        kl_coef=0.01,
        entropy_coef=0.1,
        clip_low=3e-4,
        clip_high=4e-4,
        dual_clip_c=None,
        ratio_type="sequence",
        **kwargs,
    )
    ref = gspo_reference(mode)
    for key in ("pg_loss", "kl_loss", "entropy"):
        assert m[key].item() == pytest.approx(ref[key], rel=1e-5), key
    assert total.item() == pytest.approx(
        ref["pg_loss"] + 0.01 * ref["kl_loss"] - 0.1 * ref["entropy"], rel=1e-5
    )


@pytest.mark.parametrize("mode", [None, "seq-mean-token-sum"])
def test_gspo_objective_aggregates_like_verl(monkeypatch: pytest.MonkeyPatch, mode: str | None) -> None:
    t = gspo_inputs()
    cfg = UpdateConfig(algo="gspo", beta=0.01, entropy_coef=0.1, loss_agg_mode=mode)
    objective, _ = token_objective(
        monkeypatch,
        cfg,
        LENGTHS,
        ADV,
        logp=t["logp"],
        old_log_probs=t["old"],
        ref_log_probs=t["ref"],
        entropy=t["entropy"],
    )
    loss, m = run_token_step(objective, 3)
    ref = gspo_reference(mode or "token-mean")
    assert m["actor/pg_loss"] == pytest.approx(ref["pg_loss"], rel=1e-5)
    assert m["actor/kl_loss"] == pytest.approx(ref["kl_loss"], rel=1e-5)
    assert m["actor/entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    assert loss.item() == pytest.approx(
        ref["pg_loss"] + 0.01 * ref["kl_loss"] - 0.1 * ref["entropy"], rel=1e-5
    )


def test_samples_per_step_gives_each_world_size_the_same_optimizer_step() -> None:
    """--samples-per-step N: each rank's grad_accum is N ÷ (micro-batch × ranks), so every world size
    takes N samples per step; --grad-accum stays per rank; a remainder is refused naming both options."""
    from stages.errors import UserInputError

    preset = UpdateConfig(samples_per_step=256, micro_batch=16)  # flow_grpo_qwen_image.yaml
    assert [preset.accumulation(16, world) for world in (1, 2, 4, 8)] == [16, 8, 4, 2]
    assert [UpdateConfig(grad_accum=3).accumulation(16, world) for world in (1, 4)] == [3, 3]
    assert UpdateConfig().accumulation(16, 4) == 1
    with pytest.raises(
        UserInputError, match=r"--samples-per-step 256 .* --micro-batch 16 × 3 rank\(s\) = 48"
    ):
        preset.accumulation(16, 3)
    with pytest.raises(UserInputError, match=r"--micro-batch 0 \(the rollout's batch size 6\)"):
        UpdateConfig(samples_per_step=8).accumulation(6, 1)


def test_presets_state_the_optimizer_step_over_all_ranks() -> None:
    """No shipped preset sets grad_accum (per rank, so its step would grow with the world size); each
    samples_per_step splits into whole micro-batches on 1, 2 and 4 ranks."""
    import yaml

    stepped = {}
    for preset in sorted((Path(__file__).parents[1] / "recipes" / "configs").glob("*.yaml")):
        data = yaml.safe_load(preset.read_text())
        cfg = UpdateConfig(**(data.get("update") or {}))
        assert cfg.grad_accum is None, preset.name
        if cfg.samples_per_step:
            micro = cfg.micro_batch or data["sample"]["batch_size"]
            steps = [cfg.accumulation(micro, world) * micro * world for world in (1, 2, 4)]
            assert steps == [cfg.samples_per_step] * 3, preset.name
            stepped[preset.stem] = cfg.samples_per_step
    assert stepped["flow_grpo_qwen_image"] == 256 and stepped["nft_qwen_image"] == 192  # verl-omni's
    # verl geo3k: 128 prompts × 5
    assert stepped["vlm_grpo_qwen2_5_vl"] == stepped["vlm_grpo_qwen3_vl"] == 640


def test_every_builtin_algo_name_is_implemented() -> None:
    """--algo offers the config's built-in names; the registry implements each, in that order."""
    assert tuple(ALGORITHMS) == ALGORITHM_NAMES


def test_only_the_diffusion_family_defaults_to_a_clip() -> None:
    token = {a.name for a in ALGORITHMS.values() if a.family == "token"}
    assert token == {"grpo", "dapo", "gspo"}
    # flow_dppo: verl-omni's FlowDPPOLoss leaves advantages unclipped (its trust region bounds the step)
    assert {a.name for a in ALGORITHMS.values() if a.adv_clip is None} == token | {"flow_dppo"}


def test_a_short_micro_batch_weighs_by_its_samples(staged: dict[str, Path], tmp_path: Path) -> None:
    """One optimizer step over 6 samples as chunks of 4 and 2 has the gradient of one chunk of 6: each
    chunk's mean loss counts by its share of the step's samples (not 1/grad_accum each)."""
    from helpers import run, staged_update_args

    norms = []
    for name, micro, accum in (("one", "6", "1"), ("split", "4", "2")):
        out = tmp_path / name
        run(*staged_update_args(staged, out, "--no-shuffle", "--micro-batch", micro, "--grad-accum", accum))
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 1
        norms.append(metrics[0]["actor/grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_held_rows_index_like_the_whole_tensor_by_global_rows() -> None:
    from stages.update.rows import HeldRows

    whole = torch.arange(6 * 3 * 2, dtype=torch.float32).reshape(6, 3, 2)
    held = HeldRows("latents", 6, (3, 2), torch.float32)
    held.hold([1, 4, 5], whole[[1, 4, 5]])
    assert held.shape == whole.shape and held.held == 3
    index, j = torch.tensor([5, 1]), torch.tensor([2, 0])
    assert torch.equal(held[index, j], whole[index, j])
    assert torch.equal(held[index, j + 1 - 1], whole[index, j])
    assert torch.equal(held[torch.tensor([4])], whole[[4]])
    with pytest.raises(RuntimeError, match="row 2 was not read"):
        held[torch.tensor([1, 2])]


def test_each_rank_plans_the_rows_of_its_own_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over 2 ranks × grad_accum 2 each rank plans exactly the rows its micro-batches read (a padded
    slot replays the step's first chunk); shuffled over 2 epochs, every trained row is still planned."""
    from stages.update import trainer
    from stages.update.chunks import fixed_steps

    class Rows:  # chunks of row numbers, like PolicyGradient
        rows_of = staticmethod(lambda idx: idx)
        steps = staticmethod(fixed_steps)

        def epoch(self, order: list[int], micro: int, rng: object) -> list[list[int]]:
            return [order[i : i + micro] for i in range(0, len(order), micro)]

    rows = [0, 1, 2, 3, 4, 6, 7, 8, 9]  # row 5 masked out
    # chunks [0,1] [2,3] [4,6] [7,8] | [9]: step 1 gives two chunks to each rank, step 2 one to rank 0
    expected = {0: [0, 1, 2, 3, 9], 1: [4, 6, 7, 8, 9]}
    for rank in (0, 1):
        monkeypatch.setattr(trainer, "data_parallel", lambda r=rank: (2, r))
        plain = UpdateConfig(grad_accum=2, shuffle=False)
        assert trainer._planned_rows(Rows(), rows, 2, plain, seed=3) == expected[rank]
        shuffled = UpdateConfig(grad_accum=2, inner_epochs=2)
        expected[rank] = trainer._planned_rows(Rows(), rows, 2, shuffled, seed=3)
    assert set(expected[0]) | set(expected[1]) == set(rows)


# ---------------------------------------------------------------- failed rewards are never trained on


@pytest.mark.parametrize("how", ["flagged", "nan"])
def test_rows_with_a_failed_reward_train_as_if_absent(how: str) -> None:
    """Rows 2 and 3 of four failed (flagged in reward_failed, or a NaN reward), with a large advantage
    that would move the weights: the update equals, bit for bit, one over rows 0 and 1 alone."""
    data, _ = rollout(FakeFlow(), "sde", 0.7)
    data["advantages"][2:] = 100.0
    data["reward"] = torch.tensor([0.5, 0.1, 0.0, 0.0])
    if how == "flagged":
        data["reward_failed"] = torch.tensor([False, False, True, True])
    else:
        data["reward"][2:] = math.nan
    absent = {k: v[:2] for k, v in data.items() if k != "reward_failed"}
    absent["reward"] = data["reward"][:2]
    cfg = UpdateConfig(algo="flow_grpo", lr=1e-2, micro_batch=4)
    weights = []
    for rows in (data, absent):
        policy = FakeFlow()
        metrics = Trainer(policy, cfg, {}).step(rows, scfg("sde", 0.7))
        assert len(metrics) == 1
        weights.append([p.detach().clone() for p in policy.module.parameters()])
    for flagged, alone in zip(*weights, strict=True):
        assert torch.equal(flagged, alone)
    assert not torch.equal(weights[0][1], FakeFlow().module.b.detach())  # and the update did move them


def test_dpo_pairs_only_rows_whose_reward_did_not_fail() -> None:
    """A failed row stored as 0 would be its group's worst: it is never one side of a DPO pair."""
    from stages.update.forward_objectives import Preference

    data = {
        "prompt": ["p"] * 6,
        "group_id": ["a"] * 3 + ["b"] * 3,
        "reward": torch.tensor([0.0, 0.5, 0.9, 0.2, math.nan, 0.7]),
        "reward_failed": torch.tensor([True, False, False, False, False, False]),
    }
    pairs = Preference(FakeFlow(), data, scfg("sde", 0.7), UpdateConfig(algo="dpo")).pairs
    assert pairs == [(2, 1), (5, 3)]
