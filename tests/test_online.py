"""`omnirl online`: one fused iteration equals the staged commands (staleness 0), resume, overlap, failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import fails, ins, online_args, online_preset, run, runner
from safetensors.torch import load_file

from omnirl_cli.app import app
from omnirl_cli.runtime import device
from stages.shards.reader import ShardSet, open_inputs

PRESET = online_preset(steps=4, batch_size=3)


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("online") / "preset.yaml"
    path.write_text(PRESET)
    return path


def _online(preset: Path, staged: dict[str, Path], out: Path, *extra: str) -> dict:
    return run(*online_args(preset, staged, out, "--reward", "jpeg_compressibility", *extra))


def test_one_online_iteration_equals_the_staged_commands(
    preset: Path, staged: dict[str, Path], tmp_path: Path
) -> None:
    s = {n: tmp_path / "staged" / n for n in ("samples", "rewards", "logprobs", "advantages", "policy")}
    cfg = ["--config", str(preset)]
    run(
        "sample",
        *cfg,
        "--model",
        str(staged["model"]),
        "--prompts",
        str(staged["prompts"]),
        "--seed",
        "0",
        "--iteration",
        "0",
        "--out",
        str(s["samples"]),
    )
    run("score", "--in", str(s["samples"]), "--reward", "jpeg_compressibility", "--out", str(s["rewards"]))
    run("logprob", "--model", str(staged["model"]), "--in", str(s["samples"]), "--out", str(s["logprobs"]))
    run("advantage", *cfg, *ins(s["samples"], s["rewards"]), "--out", str(s["advantages"]))
    run(
        "update",
        *cfg,
        "--model",
        str(staged["model"]),
        *ins(s["samples"], s["logprobs"], s["advantages"]),
        "--seed",
        "0",
        "--out",
        str(s["policy"]),
    )

    out = _online(preset, staged, tmp_path / "online", "--iterations", "1", "--save-trajectories")
    assert out["iterations"][0]["policy_versions"] == [0]
    # The sampler worker runs on the trainer's device (Accelerate's), so the first update starts on-policy.
    assert out["iterations"][0]["sampler_device"] == out["iterations"][0]["device"] == str(device())
    o = tmp_path / "online"
    torch.testing.assert_close(
        ShardSet(o / "it0" / "samples").read_all()["latents"],
        ShardSet(s["samples"]).read_all()["latents"],
        rtol=0,
        atol=0,
    )
    assert torch.equal(
        ShardSet(o / "it0" / "rewards").read_all()["reward"], ShardSet(s["rewards"]).read_all()["reward"]
    )
    torch.testing.assert_close(
        open_inputs([o / "it0" / "advantages"]).read_all()["advantages"],
        ShardSet(s["advantages"]).read_all()["advantages"],
    )
    staged_metrics = [json.loads(x) for x in (s["policy"] / "metrics.jsonl").read_text().splitlines()]
    online_metrics = [
        json.loads(x) for x in (o / "it1" / "policy" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in online_metrics] == [m["step"] for m in staged_metrics]
    # On-policy up to fp32 rounding (sampling and training batch the rows differently); a sampler on
    # another device than the trainer's is off by far more.
    assert online_metrics[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for a, b in zip(staged_metrics, online_metrics, strict=True):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-5, abs=1e-8)
    w_staged = load_file(s["policy"] / "pytorch_lora_weights.safetensors")
    w_online = load_file(o / "it1" / "policy" / "pytorch_lora_weights.safetensors")
    assert w_staged.keys() == w_online.keys()
    for key in w_staged:
        torch.testing.assert_close(w_online[key], w_staged[key], rtol=1e-5, atol=1e-7)


def test_resume_and_staleness(preset: Path, staged: dict[str, Path], tmp_path: Path) -> None:
    fresh = _online(preset, staged, tmp_path / "s0", "--iterations", "2")["iterations"]
    assert [it["policy_versions"] for it in fresh] == [[0], [fresh[0]["step"]]]  # iteration 1 used the update
    again = _online(preset, staged, tmp_path / "s0", "--iterations", "3")["iterations"]
    assert [it["iteration"] for it in again] == [2]  # resumed after the it2 checkpoint
    assert again[0]["step"] == 3 * fresh[0]["step"]
    overlapped = _online(preset, staged, tmp_path / "s1", "--iterations", "2", "--max-staleness", "1")[
        "iterations"
    ]
    assert overlapped[1]["policy_versions"] == [0]  # sampled while iteration 0 trained


def test_the_trainer_is_built_once_and_carries_its_state_as_a_resumed_run(
    preset: Path, staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process keeps its optimizer and parallel wrapper across iterations; after 2 iterations its
    weights and AdamW moments equal those of a run stopped after 1 and resumed (its saved state)."""
    import shutil

    from stages.update.parallel import Parallel

    built = {"AdamW": 0, "Parallel.setup": 0}
    setup = Parallel.setup

    class CountedAdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs) -> None:
            built["AdamW"] += 1
            super().__init__(*args, **kwargs)

    def counted_setup(*args, **kwargs) -> Parallel:
        built["Parallel.setup"] += 1
        return setup(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", CountedAdamW)
    monkeypatch.setattr(Parallel, "setup", staticmethod(counted_setup))
    whole = _online(preset, staged, tmp_path / "whole", "--iterations", "2")["iterations"]
    assert [it["iteration"] for it in whole] == [0, 1] and whole[1]["step"] == 2 * whole[0]["step"]
    assert built == {"AdamW": 1, "Parallel.setup": 1}
    # the run stopped after its it1 checkpoint, then resumed from it
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed", ignore=lambda _, names: {"it2"} & set(names))
    resumed = _online(preset, staged, tmp_path / "resumed", "--iterations", "2")["iterations"]
    assert [it["iteration"] for it in resumed] == [1]
    a, b = (tmp_path / run / "it2" / "policy" for run in ("whole", "resumed"))
    weights = "pytorch_lora_weights.safetensors"
    expected, again = load_file(a / weights), load_file(b / weights)
    assert expected.keys() == again.keys() and all(torch.equal(expected[k], again[k]) for k in expected)
    moments = [torch.load(p / "trainer_state" / "optimizer.pt", weights_only=True)["state"] for p in (a, b)]
    assert moments[0].keys() == moments[1].keys() and len(moments[0]) == len(expected)
    for i, state in moments[0].items():
        assert all(torch.equal(state[key], moments[1][i][key]) for key in ("step", "exp_avg", "exp_avg_sq"))


def test_a_progressive_window_that_shrinks_keeps_running(
    preset: Path, staged: dict[str, Path], tmp_path: Path
) -> None:
    """MixGRPO's window slides every iteration here: steps [0, 1], then [1] (cut at the range's end,
    N − 2 = 2), then back to [0, 1]; each iteration stores and trains what its own window holds."""
    window = [
        "--set",
        "sample.sde_window=2",
        "--set",
        "sample.window_strategy=progressive",
        "--set",
        "sample.iters_per_group=1",
        "--set",
        "update.algo=mix_grpo",
    ]
    out = tmp_path / "mix"
    result = _online(preset, staged, out, "--iterations", "3", "--save-trajectories", *window)
    assert [it["iteration"] for it in result["iterations"]] == [0, 1, 2]
    sigmas = [ShardSet(out / f"it{k}" / "samples").read_all()["sigmas"] for k in range(3)]
    latents = [ShardSet(out / f"it{k}" / "samples").read_all()["latents"] for k in range(3)]
    assert [s.shape[1] for s in sigmas] == [3, 2, 3] and [x.shape[1] for x in latents] == [3, 2, 3]
    assert torch.equal(sigmas[1], sigmas[0][:, 1:])  # the window moved one step on
    assert torch.equal(sigmas[2], sigmas[0])  # and rolled back
    assert all((out / f"it{k}" / "policy").is_dir() for k in (1, 2, 3))


def test_top_level_preset_values_reach_the_stages_that_have_them() -> None:
    """As each staged command reads a shared preset: a top-level value goes to every stage section with a
    setting of that name, the section's own value wins within one layer, --set beats the YAML, and the
    sections of other commands (GRPO-Guard's `logprob:`) are theirs."""
    from omnirl_cli.commands.online import _merge, _sectioned, _stage_keys

    keys = _stage_keys()
    own = {"seed", "iterations"}  # omnirl online's own options go to `resolve`, not to a stage
    yaml_layer = {
        "steps": 6,
        "mixed_precision": "bf16",
        "reward": "pickscore",
        "reward_args": {"pickscore": {"model": "m"}},
        "sample": {"mixed_precision": "no"},
        "update": {"lr": 1e-3},
        "logprob": {"means": True},
    }
    got = _sectioned({**yaml_layer, "seed": 4}, keys, own, {"logprob"}, "--config p.yaml")
    assert got == {
        "sample": {"mixed_precision": "no", "steps": 6},
        "score": {"reward": "pickscore", "reward_args": {"pickscore": {"model": "m"}}},
        "update": {"lr": 1e-3, "mixed_precision": "bf16"},
    }
    sets = {"lr": 3e-4, "group-size": 8, "estimator": "global", "score": {"reward": "ocr"}}
    merged = _merge(got, _sectioned(sets, keys, own, {"logprob"}, "--set"))
    assert merged["update"]["lr"] == 3e-4 and merged["sample"]["group_size"] == 8
    assert merged["advantage"] == {"estimator": "global"} and merged["score"]["reward"] == "ocr"


def test_preset_values_online_would_not_use_are_refused(
    preset: Path, staged: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    fails(online_args(preset, staged, out, "--set", "lrr=1e-4"), "--set lrr", "omnirl online")
    fails(online_args(preset, staged, out, "--set", "updte.lr=1e-4"), "--set", "'updte'", "update.lr")
    fails(online_args(preset, staged, out, "--set", "sample.seed=3"), "'sample.seed'", "seed k", "--seed")
    fails(online_args(preset, staged, out, "--set", "update.seed=3"), "'update.seed'", "update --seed k")
    for algo, column in (("grpo_guard", "old_means"), ("dpo", "group_id")):
        args = online_args(
            preset, staged, out, "--reward", "jpeg_compressibility", "--set", f"update.algo={algo}"
        )
        fails(args, f"update.algo {algo}", f"'{column}'", "staged commands")
    for extra, named in (("iteration: 2\n", "'iteration'"), ("lrr: 1.0e-4\n", "'lrr'")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(PRESET + extra)
        fails(online_args(bad, staged, out, "--reward", "jpeg_compressibility"), str(bad), named)
    assert not out.exists()


def test_a_top_level_set_changes_the_run(preset: Path, staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    _online(
        preset, staged, out, "--iterations", "1", "--set", "lr=5e-4", "--set", "steps=3", "--set", "seed=7"
    )
    settings = json.loads((out / "online_run.json").read_text())["settings"]
    assert settings["update"]["lr"] == 5e-4 and settings["sample"]["steps"] == 3 and settings["seed"] == 7


def test_a_crashed_worker_is_named_and_nothing_is_left_running(
    preset: Path, staged: dict[str, Path], tmp_path: Path, monkeypatch
) -> None:
    import multiprocessing

    plugin = tmp_path / "dying_reward.py"
    plugin.write_text("import os\n\ndef score(images, prompts, meta):\n    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = runner.invoke(
        app,
        [
            "online",
            "--config",
            str(preset),
            "--model",
            str(staged["model"]),
            "--prompts",
            str(staged["prompts"]),
            "--reward",
            "dying_reward:score",
            "--iterations",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 1
    assert "scorer worker exited with code 3" in result.output
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnirl-")]
    assert not (tmp_path / "run" / "it1").exists()


NFT_PRESET = """\
sample:
  steps: 4
  guidance: 1.0
  resolution: 32
  sampler: ode
  group_size: 2
  batch_size: 6
update:
  algo: nft
  full: true
  lr: 3.0e-3
  grad_accum: 2
  micro_batch: 3
  old_decay: linear_to_0_5
  timestep_fraction: 0.9
"""


@pytest.mark.slow
def test_online_killed_and_resumed_equals_an_uninterrupted_run_bit_for_bit(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    """The demo's kind of run (DiffusionNFT, full weights, its old policy): killed (SIGKILL) after its
    it2 checkpoint and resumed, every weight and trainer-state tensor equals the uninterrupted run's.
    The prompt encodings were the difference (up to 4e-7 apart): they depend on the batch a prompt is
    first encoded in, and a resumed process had encoded others (`FlowPolicy.forget_prompts`)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    preset = tmp_path / "nft.yaml"
    preset.write_text(NFT_PRESET)
    args = ["--reward", "jpeg_compressibility"]
    run(*online_args(preset, staged, tmp_path / "whole", *args, "--iterations", "3"))
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [
        sys.executable,
        "-m",
        "omnirl_cli",
        *online_args(preset, staged, killed, *args),
        "--iterations",
        "100",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (killed / "it2" / "policy" / "omnirl_adapter.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed = run(*online_args(preset, staged, killed, *args, "--iterations", "3"))["iterations"]
    assert [it["iteration"] for it in resumed] == [2]  # after the it2 checkpoint, not from scratch
    for k in (1, 2, 3):
        files = sorted((tmp_path / "whole" / f"it{k}" / "policy").rglob("*.safetensors"))
        assert len(files) == 2  # the transformer's weights and NFT's old policy
        for whole in files:
            again = load_file(killed / whole.relative_to(tmp_path / "whole"))
            expected = load_file(whole)
            assert expected.keys() == again.keys()
            assert all(torch.equal(expected[key], again[key]) for key in expected), (k, whole.name)
