"""The policy-gradient family on the tiny model: which steps each `--algo` trains, GRPO-Guard's
on-policy ratio, and that every algorithm's update moves the policy toward high-advantage samples."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import ins, run, sample_args

from stages.shards.reader import ShardSet, open_inputs
from stages.update.losses import ALGORITHMS, step_plan


def test_step_plans_follow_each_reference() -> None:
    rng = random.Random(0)
    flow = step_plan(ALGORITHMS["flow_grpo"], 3, 10, 0.99, rng)
    assert flow.tolist() == [list(range(9))] * 3  # flow_grpo trains 9 of 10 steps, in order
    window = step_plan(ALGORITHMS["mix_grpo"], 2, 4, 0.5, rng)
    assert window.tolist() == [[0, 1, 2, 3]] * 2  # the whole stored window
    dance = step_plan(ALGORITHMS["dance_grpo"], 50, 16, 0.6, rng)
    assert dance.shape == (50, 9)  # int(15 · 0.6): the last step is never trained
    for row in dance.tolist():
        assert len(set(row)) == 9 and max(row) <= 14
    assert len({tuple(r) for r in dance.tolist()}) > 40  # each sample draws its own steps


def _advantage_weighted_logp_change(inputs: list[Path], policy_logprobs: Path) -> float:
    """mean_b,k A·(logp_new − logp_old): positive when the update favoured high-advantage steps."""
    data = open_inputs(inputs).read_all(columns=["log_probs", "advantages"])
    new = ShardSet(policy_logprobs).read_all()["old_log_probs"]
    return float((data["advantages"] * (new - data["log_probs"])).mean())


@pytest.mark.parametrize("algo", ["flow_grpo", "dance_grpo", "grpo_guard"])
def test_each_algorithm_moves_toward_high_advantage_steps(
    staged: dict[str, Path], tmp_path: Path, algo: str
) -> None:
    inputs = [staged["samples"], staged["advantages"]]
    if algo == "grpo_guard":
        run(
            "logprob",
            "--model",
            str(staged["model"]),
            "--in",
            str(staged["samples"]),
            "--means",
            "--out",
            str(tmp_path / "means"),
        )
        inputs.append(tmp_path / "means")
        assert ShardSet(tmp_path / "means").columns["old_means"].shape == (4, 16, 8, 8)
    else:
        inputs.append(staged["logprobs"])
    args = [x for p in inputs for x in ("--in", str(p))]
    run(
        "update",
        "--model",
        str(staged["model"]),
        *args,
        "--algo",
        algo,
        "--lr",
        "3e-3",
        "--clip-range",
        "0.2",
        "--timestep-fraction",
        "0.75",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--no-shuffle",
        "--out",
        str(tmp_path / "policy"),
    )
    metrics = [json.loads(x) for x in (tmp_path / "policy" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy at the first step
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in metrics)
    run(
        "logprob",
        "--model",
        str(staged["model"]),
        "--adapter",
        str(tmp_path / "policy"),
        "--in",
        str(staged["samples"]),
        "--out",
        str(tmp_path / "after"),
    )
    assert _advantage_weighted_logp_change([staged["samples"], staged["advantages"]], tmp_path / "after") > 0


def test_mix_grpo_trains_the_stored_window(staged: dict[str, Path], tmp_path: Path) -> None:
    p = {n: tmp_path / n for n in ("samples", "rewards", "logprobs", "advantages", "policy", "after")}
    run(
        *sample_args(
            staged["model"],
            staged["prompts"],
            p["samples"],
            "--steps",
            "6",
            "--sde-window",
            "2",
            "--sde-window-range",
            "0",
            "4",
            "--same-noise",
        )
    )
    samples = ShardSet(p["samples"]).read_all()
    assert samples["latents"].shape[1] == 3 and samples["log_probs"].shape[1] == 2
    from diffusers import FlowMatchEulerDiscreteScheduler

    from stages.models.schedules import flow_match_sigmas

    schedule = flow_match_sigmas(
        FlowMatchEulerDiscreteScheduler.from_pretrained(staged["model"] / "scheduler"), 6
    )
    for row in samples["sigmas"]:
        start = int((schedule == row[0]).nonzero()[0])
        assert 0 <= start <= 2 and torch.equal(row, schedule[start : start + 3])  # window of 2 in [0, 4)
    assert not torch.equal(samples["latents"][:, -1], samples["final_latent"])  # ODE steps follow the window
    run("score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"]))
    run("logprob", "--model", str(staged["model"]), "--in", str(p["samples"]), "--out", str(p["logprobs"]))
    assert torch.equal(ShardSet(p["logprobs"]).read_all()["old_log_probs"], samples["log_probs"])
    run(
        "advantage",
        *ins(p["samples"], p["rewards"]),
        "--estimator",
        "dance",
        "--out",
        str(p["advantages"]),
    )
    run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(p["samples"], p["logprobs"], p["advantages"]),
        "--algo",
        "mix_grpo",
        "--lr",
        "3e-3",
        "--clip-range",
        "0.2",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--no-shuffle",
        "--out",
        str(p["policy"]),
    )
    run(
        "logprob",
        "--model",
        str(staged["model"]),
        "--adapter",
        str(p["policy"]),
        "--in",
        str(p["samples"]),
        "--out",
        str(p["after"]),
    )
    assert _advantage_weighted_logp_change([p["samples"], p["advantages"]], p["after"]) > 0


def test_grpo_guard_without_means_is_a_clear_error(staged: dict[str, Path], tmp_path: Path) -> None:
    from helpers import runner

    from omnirl_cli.app import app

    result = runner.invoke(
        app,
        [
            "update",
            "--model",
            str(staged["model"]),
            *ins(staged["samples"], staged["logprobs"], staged["advantages"]),
            "--algo",
            "grpo_guard",
            "--out",
            str(tmp_path / "p"),
        ],
    )
    assert result.exit_code == 2 and "old_means" in result.output and "--means" in result.output


def test_progressive_window_slides_with_the_iteration(staged: dict[str, Path], tmp_path: Path) -> None:
    """MixGRPO: the window starts at 0 and moves one step every --iters-per-group iterations."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from stages.models.schedules import flow_match_sigmas

    sched = (
        flow_match_sigmas(FlowMatchEulerDiscreteScheduler.from_pretrained(staged["model"] / "scheduler"), 6)
        * 1000
    )
    starts = []
    for it in (0, 1, 2, 5):
        out = tmp_path / f"it{it}"
        run(
            *sample_args(
                staged["model"],
                staged["prompts"],
                out,
                "--steps",
                "6",
                "--sde-window",
                "2",
                "--window-strategy",
                "progressive",
                "--iters-per-group",
                "2",
                "--iteration",
                str(it),
                "--num-prompts",
                "1",
            )
        )
        timesteps = ShardSet(out).read_all()["timesteps"]
        assert (timesteps == timesteps[0]).all()  # one window for the whole iteration
        starts.append(int((sched == timesteps[0, 0]).nonzero()[0]))
    assert starts == [0, 0, 1, 2]


def test_advantage_aggregation_per_reward(staged: dict[str, Path], tmp_path: Path) -> None:
    """MixGRPO's advantage_aggr: each reward normalised on its own (flow_grpo global std), then weighted."""
    run(
        "score",
        "--in",
        str(staged["samples"]),
        "--reward",
        "jpeg_compressibility=1",
        "--reward",
        "jpeg_incompressibility=0.5",
        "--out",
        str(tmp_path / "r"),
    )
    run(
        "advantage",
        *ins(staged["samples"], tmp_path / "r"),
        "--aggregation",
        "advantage_aggr",
        "--out",
        str(tmp_path / "a"),
    )
    data = open_inputs([staged["samples"], tmp_path / "r", tmp_path / "a"]).read_all()
    groups = data["group_id"]
    expected = torch.zeros(len(groups), dtype=torch.float64)
    for name, weight in (("jpeg_compressibility", 1.0), ("jpeg_incompressibility", 0.5)):
        r = data[f"reward.{name}"].double()
        std = r.std(unbiased=False)
        for g in set(groups):
            idx = [i for i, x in enumerate(groups) if x == g]
            expected[idx] += weight * (r[idx] - r[idx].mean()) / (std + 1e-4)
    torch.testing.assert_close(data["advantages"][:, 0].double(), expected, rtol=1e-5, atol=1e-6)
    plain = run("advantage", *ins(staged["samples"], tmp_path / "r"), "--out", str(tmp_path / "b"))
    assert plain["estimator"] == "grpo"
    assert not torch.allclose(ShardSet(tmp_path / "b").read_all()["advantages"], data["advantages"])


def _fm_errors(model: Path, adapter: Path | None, data: dict, t: float = 0.6) -> torch.Tensor:
    """Per-sample flow-matching error of the final latents at one fixed (t, ε), under `adapter`."""
    from stages.models.diffusion import FlowPolicy
    from stages.update.family_losses import fm_error

    policy = FlowPolicy.load(model, adapter=adapter)
    x0 = data["final_latent"].float()
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1234))
    x_t = (1 - t) * x0 + t * eps
    cond = policy.encode(list(data["prompt"]), None, False)
    with torch.no_grad():
        return fm_error(policy.velocity(x_t, torch.tensor(t), cond, 1.0), eps, x0)


@pytest.mark.parametrize("algo", ["nft", "awm"])
def test_forward_process_algorithms_favour_high_advantage_samples(
    staged: dict[str, Path], tmp_path: Path, algo: str
) -> None:
    """NFT and AWM pull the velocity toward high-advantage x0s: Σ A·ℓ drops (ℓ = flow-matching error)."""
    extra = (
        ["--nft-beta", "1.0", "--old-decay", "copy"]
        if algo == "nft"
        else ["--awm-weighting", "ghuber", "--train-timesteps", "3"]
    )
    run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["advantages"]),
        "--algo",
        algo,
        "--lr",
        "3e-3",
        "--timestep-fraction",
        "0.75",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--inner-epochs",
        "2",
        *extra,
        "--out",
        str(tmp_path / "p"),
    )
    data = open_inputs([staged["samples"], staged["advantages"]]).read_all(
        columns=["prompt", "final_latent", "advantages"]
    )
    adv = data["advantages"][:, 0].double()
    before = _fm_errors(staged["model"], None, data).double()
    after = _fm_errors(staged["model"], tmp_path / "p", data).double()
    assert float((adv * (after - before)).sum()) < 0
    metrics = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in metrics)
    if algo == "nft":
        from safetensors.torch import load_file

        old = load_file(tmp_path / "p" / "trainer_state" / "old_weights.safetensors")
        new = load_file(tmp_path / "p" / "pytorch_lora_weights.safetensors")
        assert metrics[-1]["old_policy/decay"] == 0.0  # "copy": θ_old ← θ
        key = next(k for k in old if "lora_B" in k)
        assert torch.equal(old[key], new["transformer." + key.replace(".default", "")])


def test_online_dpo_raises_the_implicit_preference_margin(staged: dict[str, Path], tmp_path: Path) -> None:
    run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["advantages"]),
        "--algo",
        "dpo",
        "--dpo-beta",
        "100",
        "--lr",
        "3e-3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--inner-epochs",
        "3",
        "--micro-batch",
        "2",
        "--no-shuffle",
        "--out",
        str(tmp_path / "p"),
    )
    metrics = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["actor/dpo_loss"] == pytest.approx(
        0.6931471805599453, abs=1e-6
    )  # ln 2: policy == reference
    data = open_inputs([staged["samples"], staged["advantages"]]).read_all(
        columns=["prompt", "final_latent", "advantages", "group_id"]
    )
    from stages.advantage.estimators import best_worst_pairs

    pairs = best_worst_pairs(data["advantages"][:, 0], data["group_id"])
    base = _fm_errors(staged["model"], None, data)
    tuned = _fm_errors(staged["model"], tmp_path / "p", data)
    margin = sum(float((tuned[w] - base[w]) - (tuned[lo] - base[lo])) for w, lo in pairs)
    assert margin < 0  # the preferred samples became relatively easier to denoise


def test_nft_runs_from_an_ode_rollout_through_every_stage(staged: dict[str, Path], tmp_path: Path) -> None:
    """DiffusionNFT's rollout stores no steps; logprob then writes ids only and update trains on x0."""
    p = {n: tmp_path / n for n in ("samples", "rewards", "logprobs", "advantages", "policy")}
    run(*sample_args(staged["model"], staged["prompts"], p["samples"], "--sampler", "ode"))
    assert (
        "latents" not in ShardSet(p["samples"]).columns and "final_latent" in ShardSet(p["samples"]).columns
    )
    run("logprob", "--model", str(staged["model"]), "--in", str(p["samples"]), "--out", str(p["logprobs"]))
    assert list(ShardSet(p["logprobs"]).columns) == ["sample_id"]
    run("score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"]))
    run("advantage", *ins(p["samples"], p["rewards"]), "--out", str(p["advantages"]))
    out = run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(p["samples"], p["logprobs"], p["advantages"]),
        "--algo",
        "nft",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(p["policy"]),
    )
    assert out["step"] == 2
    assert (p["policy"] / "trainer_state" / "old_weights.safetensors").is_file()


def test_pairs_estimator_marks_best_and_worst(staged: dict[str, Path], tmp_path: Path) -> None:
    run(
        "advantage",
        *ins(staged["samples"], staged["rewards"]),
        "--estimator",
        "pairs",
        "--out",
        str(tmp_path / "a"),
    )
    data = open_inputs([staged["samples"], staged["rewards"], tmp_path / "a"]).read_all(
        columns=["group_id", "reward", "advantages"]
    )
    for g in set(data["group_id"]):
        idx = [i for i, x in enumerate(data["group_id"]) if x == g]
        r, a = data["reward"][idx], data["advantages"][idx, 0]
        if r.max() == r.min():
            assert a.tolist() == [0.0, 0.0]  # no preference within an all-equal group
        else:
            assert float(a[int(r.argmax())]) == 1.0 and float(a[int(r.argmin())]) == -1.0
    out = run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], tmp_path / "a"),
        "--algo",
        "dpo",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(tmp_path / "p"),
    )
    assert out["step"] >= 1
