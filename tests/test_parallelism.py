"""Sequence parallelism (--sp-degree, diffusers' Ulysses context parallelism) on 2 and 4 gloo CPU ranks
equals one process, for every family whose transformer has a `_cp_plan`: the rollout, the replay and one
update; and the settings it cannot run are refused in one line (stages/parallelism.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, ins, run, torchrun_commands, torchrun_fails
from safetensors.torch import load_file

from stages.errors import UserInputError
from stages.models.diffusion import FlowPolicy
from stages.models.folders import LORA_WEIGHTS
from stages.models.kernels import Kernels, prepare
from stages.parallelism import ModelParallel, guard_splits, parallelize
from stages.shards.reader import ShardSet

# init-model family → the sampling flags that fit its tiny build (Wan: 5 frames, 2 latent frames)
FAMILIES = {
    "flux": ["--resolution", "32", "--guidance", "3.5"],
    "qwen_image": ["--resolution", "32", "--guidance", "4"],
    "wan2_1": ["--resolution", "32", "--frames", "5", "--guidance", "4"],
}
TRAIN = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--no-shuffle", "--micro-batch", "1"]


def _sample(model: Path, prompts: Path, name: str, out: Path, *extra: str) -> list[str]:
    return [
        "sample", "--model", str(model), "--prompts", str(prompts), "-n", "2", "--steps", "3",
        "--batch-size", "3", *FAMILIES[name], "--out", str(out), *extra,
    ]  # fmt: skip


def _metrics(policy: Path) -> list[dict]:
    return [json.loads(line) for line in (policy / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process's staged iteration of a family (sample → score → logprob → advantage → update), and
    the same sample, the replay of its rollout and the update on its inputs (DDP, then FSDP2 sharding
    over both ranks) by 2 ranks with --sp-degree 2."""
    from stages.models.factory import init_model

    name = request.param
    root = tmp_path_factory.mktemp(f"sp-{name}")
    model, prompts = root / "model", root / "prompts.txt"
    init_model(name, model, size="tiny", seed=0)
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run(*_sample(model, prompts, name, root / "samples"))
    reward = "jpeg_compressibility@frames=mean" if name.startswith("wan") else "jpeg_compressibility"
    run("score", "--in", str(root / "samples"), "--reward", reward, "--out", str(root / "rewards"))
    run("logprob", "--model", str(model), "--in", str(root / "samples"), "--out", str(root / "logprobs"))
    run("advantage", *ins(root / "samples", root / "rewards"), "--out", str(root / "advantages"))
    inputs = ins(root / "samples", root / "logprobs", root / "advantages")
    run("update", "--model", str(model), *inputs, *TRAIN, "--out", str(root / "policy"))
    sp = ["--sp-degree", "2"]
    reports = torchrun_commands(
        _sample(model, prompts, name, root / "sp-samples", *sp),
        [
            "logprob",
            "--model",
            str(model),
            "--in",
            str(root / "samples"),
            "--out",
            str(root / "sp-logprobs"),
            *sp,
        ],
        ["update", "--model", str(model), *inputs, *TRAIN, "--out", str(root / "sp-policy"), *sp],
        [
            *["update", "--model", str(model), *inputs, *TRAIN, "--out", str(root / "sp-fsdp2-policy"), *sp],
            *["--strategy", "fsdp2"],
        ],
    )
    return {"name": name, "root": root, "model": model, "prompts": prompts, "reports": reports}


@pytest.mark.distributed
def test_sp_rollout_replay_and_update_equal_one_process(family: dict) -> None:
    root = family["root"]
    assert len(family["reports"]) == 4  # one report per command: rank 0's
    sampled, replay, update, _ = family["reports"]
    assert sampled["rows_written"] == 6 and sampled["complete"]  # each row once, by one rank of the group
    one, sp = ShardSet(root / "samples").read_all(), ShardSet(root / "sp-samples").read_all()
    assert one["sample_id"] == sp["sample_id"] and torch.equal(one["seed"], sp["seed"])
    for column in ("latents", "log_probs", "final_latent"):
        torch.testing.assert_close(sp[column], one[column], rtol=0, atol=1e-5)
    assert (root / "sp-samples" / "conditioning-00000-of-00001.safetensors").is_file()

    # the replay of the one-process rollout under sp: its log-probs, to 1e-5
    assert replay["replayed"] and replay["abs_delta_max"] <= 1e-5
    old = ShardSet(root / "logprobs").read_all()["old_log_probs"]
    torch.testing.assert_close(
        ShardSet(root / "sp-logprobs").read_all()["old_log_probs"], old, rtol=0, atol=1e-5
    )

    # one update, under DDP and under FSDP2: the sp group's gradients add up to one process's (grad norm
    # and loss per step, to 1e-5 relative) and the trained LoRA weights agree to 1e-5 of their size
    assert update["step"] == 6
    ref = load_file(root / "policy" / LORA_WEIGHTS)
    scale = max(float(v.abs().max()) for v in ref.values())
    assert scale > 0
    for policy in ("sp-policy", "sp-fsdp2-policy"):
        for a, b in zip(_metrics(root / "policy"), _metrics(root / policy), strict=True):
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
            assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-5, abs=1e-9)
        got = load_file(root / policy / LORA_WEIGHTS)
        assert ref.keys() == got.keys()
        for key, value in ref.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5 * scale)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["flux", "qwen_image"], indirect=True)
def test_tp_rollout_and_replay_on_cpu_equal_one_process(family: dict) -> None:
    """--tp-degree 2 on 2 gloo ranks (diffusers' `_tp_plan`: column- then row-parallel linears, an
    all-reduce after each row-parallel one): the rollout and the replay of one process's rollout agree
    with one process to 1e-5."""
    root, model, name = family["root"], family["model"], family["name"]
    tp = ["--tp-degree", "2"]
    sampled, replay = torchrun_commands(
        _sample(model, family["prompts"], name, root / "tp-samples", *tp),
        ["logprob", "--model", str(model), "--in", str(root / "samples"), "--out", str(root / "tp-lp"), *tp],
    )
    assert sampled["rows_written"] == 6 and sampled["complete"]
    one, split = ShardSet(root / "samples").read_all(), ShardSet(root / "tp-samples").read_all()
    assert one["sample_id"] == split["sample_id"] and torch.equal(one["seed"], split["seed"])
    for column in ("latents", "log_probs", "final_latent"):
        torch.testing.assert_close(split[column], one[column], rtol=0, atol=1e-5)
    assert replay["replayed"] and replay["rows_replayed"] == 6 and replay["abs_delta_max"] <= 1e-5
    old = ShardSet(root / "logprobs").read_all()["old_log_probs"]
    torch.testing.assert_close(ShardSet(root / "tp-lp").read_all()["old_log_probs"], old, rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["flux"], indirect=True)
def test_tp_full_update_and_its_resumption_on_cpu_equal_one_process(family: dict, tmp_path: Path) -> None:
    """update --full --tp-degree 2 on 2 gloo ranks, then a second update resumed from it (its weights and
    AdamW moments gathered whole, then split again): per-step grad norms and losses to 1e-5 relative and
    the saved weights to 1e-5 of their scale. FLUX's single blocks split a fused projection block by
    block, and each rank's QK-norm gradients are its heads' share: either mishandled is off by ~1e-3."""
    root, model = family["root"], family["model"]
    inputs = ins(root / "samples", root / "logprobs", root / "advantages")
    full = [*inputs, "--full", "--lr", "1e-4", "--no-shuffle", "--micro-batch", "1"]

    def updates(name: str, *extra: str) -> list[list[str]]:
        """A first update into `name`, then one resumed from it into `name`2."""
        base, first = ["update", "--model", str(model), *full, *extra], str(tmp_path / name)
        return [[*base, "--out", first], [*base, "--adapter", first, "--out", f"{first}2"]]

    for args in updates("one"):
        run(*args)
    torchrun_commands(*updates("tp", "--tp-degree", "2"))
    for name in ("", "2"):
        one, tp = tmp_path / f"one{name}", tmp_path / f"tp{name}"
        for a, b in zip(_metrics(one), _metrics(tp), strict=True):
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
            assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-5, abs=1e-9)
        weights = "transformer/diffusion_pytorch_model.safetensors"
        ref, got = load_file(one / weights), load_file(tp / weights)
        scale = max(float(v.abs().max()) for v in ref.values())
        assert ref.keys() == got.keys() and scale > 0
        for key, value in ref.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5 * scale)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["flux", "qwen_image"], indirect=True)
def test_dp2_by_tp2_on_four_ranks_equals_one_process(family: dict, tmp_path: Path) -> None:
    """4 ranks as 2 data-parallel replicas of a 2-rank tensor-parallel group, in one launch: each replica
    samples and replays its own shard; update --full averages the replicas' gradients over dp only, under DDP
    (torch's `replicate` over the dp mesh) and FSDP2 (`fully_shard` over dp of the dp × tp mesh), and a
    run resumed from the FSDP2 one (its 2-D shards gathered whole, then laid out again; its steps are all
    clipped, so its weights move by the restored AdamW moments alone), also with a sharded trainer state
    (SHARDED_STATE_DICT: each rank's 2-D shards written and read back), equals one process with grad_accum
    2: per-step grad norms and losses to 1e-5 relative, weights to 1e-5 of their scale. Scaling the
    losses by the world (4) instead of dp (2) doubles every gradient."""
    root, model = family["root"], family["model"]
    inputs = ins(root / "samples", root / "logprobs", root / "advantages")
    full = [
        "update",
        "--model",
        str(model),
        *inputs,
        "--full",
        "--lr",
        "1e-4",
        "--no-shuffle",
        "--micro-batch",
        "1",
    ]

    def out(name: str) -> list[str]:
        return ["--out", str(tmp_path / name)]

    one = [*full, "--grad-accum", "2"]
    run(*one, *out("one"))
    run(*one, "--adapter", str(tmp_path / "one"), *out("one2"))
    tp = ["--tp-degree", "2"]
    fsdp2 = [*full, *tp, "--strategy", "fsdp2"]
    sampled, replay, *_ = torchrun_commands(
        _sample(model, family["prompts"], family["name"], tmp_path / "samples", "--num-shards", "2", *tp),
        [
            "logprob",
            "--model",
            str(model),
            "--in",
            str(tmp_path / "samples"),
            *out("lp"),
            *tp,
            "--replay",
            "yes",
        ],
        [*full, *tp, *out("ddp")],
        [*fsdp2, *out("fsdp2")],
        [*fsdp2, "--adapter", str(tmp_path / "fsdp2"), *out("fsdp22")],
        ranks=4,
    )
    # FSDP2 × tp with a sharded trainer state (each rank writes its 2-D shards, a resume reads them back)
    torchrun_commands(
        [*fsdp2, *out("sharded")],
        [*fsdp2, "--adapter", str(tmp_path / "sharded"), *out("sharded2")],
        ranks=4,
        env={"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"},
    )
    assert (tmp_path / "sharded" / "trainer_state" / "sharded").is_dir()
    assert sampled["rows_written"] == 6 and sampled["complete"]
    split, four = ShardSet(root / "samples").read_all(), ShardSet(tmp_path / "samples").read_all()
    assert (
        len(ShardSet(tmp_path / "samples").manifest.shards) == 2 and split["sample_id"] == four["sample_id"]
    )
    for column in ("latents", "log_probs"):
        torch.testing.assert_close(four[column], split[column], rtol=0, atol=1e-5)
    # the replay: each dp replica's tp group replays its own shard, as its rollout drew it
    assert replay["replayed"] and replay["rows_replayed"] == 6 and replay["abs_delta_max"] <= 1e-5
    torch.testing.assert_close(
        ShardSet(tmp_path / "lp").read_all()["old_log_probs"], four["log_probs"], rtol=0, atol=1e-5
    )
    weights = "transformer/diffusion_pytorch_model.safetensors"
    for ref, got in (
        ("one", "ddp"),
        ("one", "fsdp2"),
        ("one2", "fsdp22"),
        ("one", "sharded"),
        ("one2", "sharded2"),
    ):
        a_metrics, b_metrics = _metrics(tmp_path / ref), _metrics(tmp_path / got)
        assert len(a_metrics) == len(b_metrics) == 3  # 6 rows, 2 per optimizer step
        for a, b in zip(a_metrics, b_metrics, strict=True):
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
            # the loss is a difference of near-equal terms (~1e-5): its rounding is absolute, ~3e-9
            assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-5, abs=1e-8)
        expected, trained = load_file(tmp_path / ref / weights), load_file(tmp_path / got / weights)
        scale = max(float(v.abs().max()) for v in expected.values())
        assert expected.keys() == trained.keys() and scale > 0
        for key, value in expected.items():
            torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-5 * scale)


def test_sp_needs_a_launch_of_a_multiple_of_its_degree(tiny_sd3: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    args = ["sample", "--model", str(tiny_sd3), "--prompts", str(prompts), "--out", str(tmp_path / "s")]
    fails([*args, "--sp-degree", "2"], "--sp-degree 2", "torchrun --nproc_per_node")
    fails([*args, "--sp-degree", "2", "--tp-degree", "2"], "--sp-degree 2", "--tp-degree 2", "choose one")
    fails([*args, "--sp-degree", "2", "--sp-kind", "unified"], "--sp-kind unified", "two factors")
    assert not (tmp_path / "s").exists()  # refused before anything is written


@pytest.mark.distributed
def test_a_sequence_the_sp_group_cannot_split_is_refused_in_one_line(
    flux_model: Path, tmp_path: Path
) -> None:
    """24 px on the tiny FLUX (VAE factor 4) is 3 × 3 latent patches: 9 tokens, which diffusers' splitter
    would fail on with a bare assertion under --sp-degree 2."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    line = torchrun_fails(
        *["sample", "--model", str(flux_model), "--prompts", str(prompts), "--resolution", "24"],
        *["--steps", "2", "--out", str(tmp_path / "s"), "--sp-degree", "2"],
    )
    assert line.startswith("error: --sp-degree 2: ") and "9 tokens (3 × 3 patches)" in line
    assert "divide it: 3, 9" in line
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def flux_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stages.models.factory import init_model

    path = tmp_path_factory.mktemp("flux") / "model"
    init_model("flux", path, size="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def flux(flux_model: Path) -> FlowPolicy:
    return FlowPolicy.load(flux_model)


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        (ModelParallel(sp_degree=2, sp_kind="ring"), ["--sp-kind ring", "log-sum-exp", "(native)"]),
        (ModelParallel(sp_degree=2, sp_kind="unified"), ["--sp-kind unified", "log-sum-exp"]),
        (ModelParallel(tp_degree=3), ["--tp-degree 3", "4 attention heads"]),
        (ModelParallel(sp_degree=3), ["--sp-degree 3", "4 attention heads"]),
    ],
)
def test_what_diffusers_cannot_run_here_is_refused_before_the_model_changes(
    flux: FlowPolicy, parallel: ModelParallel, named: list[str]
) -> None:
    with pytest.raises(UserInputError) as refused:
        parallelize(flux.parts, parallel)
    assert all(n in str(refused.value) for n in named) and "\n" not in str(refused.value)
    assert flux.module._parallel_config is None


def test_every_sequence_diffusers_splits_is_refused_in_one_line_before_its_splitter(
    flux_model: Path, tmp_path: Path
) -> None:
    """The check diffusers' `_cp_plan` splits get (`guard_splits`), on one process with a pretended group
    size: FLUX's latents (9 tokens at 24 px) divide by 3 but its 128 text tokens do not; FLUX.1 Kontext's
    16 latent tokens (32 px) divide by 2, but not with a 24 px source's 9 tokens appended to them."""
    from PIL import Image

    from stages.models.factory import init_model

    flux = FlowPolicy.load(flux_model)
    guard_splits(flux.module, 3)
    with pytest.raises(UserInputError) as refused:
        flux.velocity(
            flux.initial_noise([1], 24), flux.sigmas(3, 24)[1], flux.encode(["a cat"], None, False), 3.5
        )
    assert str(refused.value) == (
        "--sp-degree 3: the prompt's text tokens (encoder_hidden_states) are 128 tokens, which 3 ranks cannot "
        "split evenly; degrees up to 16 that divide it: 2, 4, 8, 16: pass one that divides every sequence"
    )
    init_model("flux_kontext", tmp_path / "kontext", size="tiny", seed=0)
    kontext = FlowPolicy.load(tmp_path / "kontext")
    source = tmp_path / "source.png"
    Image.new("RGB", (24, 24), (200, 0, 0)).save(source)
    cond = kontext.encode(["a cat"], None, False, images=[[source.read_bytes()]])
    x, sigma = kontext.initial_noise([1], 32), kontext.sigmas(3, 32)[1]
    velocity = kontext.velocity(x, sigma, cond, 3.5)  # one process runs it: the refusal below is the guard's
    guard_splits(kontext.module, 2)
    with pytest.raises(UserInputError) as refused:
        kontext.velocity(x, sigma, cond, 3.5)
    assert str(refused.value).startswith(
        "--sp-degree 2: the latent tokens (the sample's, then any reference image's) (hidden_states) are 25 "
        "tokens, which 2 ranks cannot split evenly; degrees up to 16 that divide it: 5: "
    )
    assert velocity.shape == x.shape


def test_a_fused_projection_the_tp_group_cannot_split_is_refused_in_one_line(flux_model: Path) -> None:
    """FLUX's single-block proj_out reads [attention | MLP] blocks; a layout whose blocks 2 ranks cannot
    split (diffusers' ValueError) is one line naming the weight, before the model changes."""
    policy = FlowPolicy.load(flux_model)
    proj_out = policy.module.single_transformer_blocks[1].proj_out
    attention, mlp = proj_out._tp_packed_row_blocks
    proj_out._tp_packed_row_blocks = [attention - 1, mlp + 1]
    with pytest.raises(UserInputError) as refused:
        parallelize(policy.parts, ModelParallel(tp_degree=2))
    assert str(refused.value) == (
        "--tp-degree 2: the transformer FluxTransformer2DModel's single_transformer_blocks.1.proj_out.weight "
        f"splits the fused blocks {attention - 1} + {mlp + 1} along dim 1, which 2 ranks cannot split evenly; "
        "degrees up to 16 that divide it: none"
    )
    assert policy.module._parallel_config is None


def test_a_transformer_without_a_plan_is_refused(tiny_sd3: Path) -> None:
    policy = FlowPolicy.load(tiny_sd3)
    with pytest.raises(UserInputError, match=r"--sp-degree 2: the transformer SD3Transformer2DModel has no "):
        parallelize(policy.parts, ModelParallel(sp_degree=2))
    with pytest.raises(UserInputError, match=r"_tp_plan"):
        parallelize(policy.parts, ModelParallel(tp_degree=2))


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["flux"], indirect=True)
def test_dp2_by_sp2_on_four_ranks_equals_one_process(family: dict, tmp_path: Path) -> None:
    """4 ranks as 2 data-parallel groups of 2 sequence-parallel ranks: each group samples its own shard,
    and an update with 2 groups × grad_accum 1 equals one process with grad_accum 2."""
    root, model = family["root"], family["model"]
    inputs = ins(root / "samples", root / "logprobs", root / "advantages")
    run("update", "--model", str(model), *inputs, *TRAIN, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    sp = ["--sp-degree", "2"]
    sampled, _ = torchrun_commands(
        _sample(model, family["prompts"], "flux", tmp_path / "samples", "--num-shards", "2", *sp),
        ["update", "--model", str(model), *inputs, *TRAIN, "--out", str(tmp_path / "four"), *sp],
        ranks=4,
    )
    assert sampled["rows_written"] == 6 and sampled["complete"]
    one, four = ShardSet(root / "samples").read_all(), ShardSet(tmp_path / "samples").read_all()
    assert len(ShardSet(tmp_path / "samples").manifest.shards) == 2 and one["sample_id"] == four["sample_id"]
    for column in ("latents", "log_probs"):
        torch.testing.assert_close(four[column], one[column], rtol=0, atol=1e-5)
    for a, b in zip(_metrics(tmp_path / "one"), _metrics(tmp_path / "four"), strict=True):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
    ref, got = load_file(tmp_path / "one" / LORA_WEIGHTS), load_file(tmp_path / "four" / LORA_WEIGHTS)
    scale = max(float(v.abs().max()) for v in ref.values())
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5 * scale)


def test_attention_backend_and_compile_are_set_on_the_transformer(flux_model: Path, tmp_path: Path) -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    policy = FlowPolicy.load(flux_model)
    x, sigma = policy.initial_noise([1, 2], 32), policy.sigmas(3, 32)[1]
    cond = policy.encode(PROMPTS[:2], None, False)
    native = policy.velocity(x, sigma, cond, 3.5)
    prepare(policy.parts, ModelParallel(), Kernels(attention_backend="_native_math", compile=True))
    backends = {m.processor._attention_backend for m in policy.module.modules() if hasattr(m, "processor")}
    assert backends == {AttentionBackendName._NATIVE_MATH}
    # regional compilation: every repeated block is compiled (lazily, at its first call), the root is not
    blocks = [*policy.module.transformer_blocks, *policy.module.single_transformer_blocks]
    assert (
        all(b._compiled_call_impl is not None for b in blocks) and policy.module._compiled_call_impl is None
    )
    math = FlowPolicy.load(flux_model)
    prepare(math.parts, ModelParallel(), Kernels(attention_backend="_native_math"))
    torch.testing.assert_close(math.velocity(x, sigma, cond, 3.5), native, rtol=0, atol=1e-5)

    args = [
        "sample",
        "--model",
        str(flux_model),
        "--prompts",
        str(tmp_path / "p.txt"),
        "--out",
        str(tmp_path / "s"),
    ]
    (tmp_path / "p.txt").write_text("a cat\n")
    fails(
        [*args, "--attention-backend", "flash_hub"],
        "--attention-backend flash_hub",
        "choose one of",
        "_native_math",
    )
    assert not (tmp_path / "s").exists()


def test_online_runs_its_kernels_in_its_trainer_and_its_sampler(
    flux_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """online's --attention-backend and --compile are its trainer's update settings (which the trainer
    prepares with, as `update`'s) and its in-process sampler's pipeline runs them too; neither enters
    the run's identity (they agree with native attention to rounding)."""
    from diffusers.models.attention_dispatch import AttentionBackendName
    from typer.testing import CliRunner

    from omnirl_cli.app import app
    from stages.online import pipeline
    from stages.online.workers import sampler_policy

    captured: list = []

    class Built(Exception):
        pass

    def built(cfg, overwrite: bool) -> None:
        captured.append(cfg)
        raise Built

    monkeypatch.setattr(pipeline, "prepare_run", built)
    (tmp_path / "p.txt").write_text("a cat\n")
    online = ["online", "--model", str(flux_model), "--prompts", str(tmp_path / "p.txt"), "-r", "ocr"]
    for n, extra in enumerate(([], ["--attention-backend", "_native_math", "--compile"]), start=1):
        result = CliRunner().invoke(app, [*online, "--out", str(tmp_path / "o"), *extra])
        assert len(captured) == n, result.output
    default, chosen = captured
    assert (chosen.update.attention_backend, chosen.update.compile) == ("_native_math", True)
    assert chosen.update.kernels == Kernels("_native_math", True) and default.update.kernels == Kernels()
    identity = pipeline.run_identity(default)
    assert pipeline.run_identity(chosen) == identity
    spread = replace(default, update=replace(default.update, sp_degree=2, tp_degree=2, sp_kind="ring"))
    assert pipeline.run_identity(spread) == identity
    # a run recorded before these left the identity (it recorded them) resumes; a new setting differs
    old = {
        **identity,
        "settings": {**identity["settings"], "update": {**identity["settings"]["update"], "sp_degree": 1}},
    }
    assert pipeline._first_difference(old, identity) is None
    assert pipeline._first_difference(identity, old) == "settings.update.sp_degree"
    policy, params = sampler_policy(chosen, None, "cpu")
    backends = {m.processor._attention_backend for m in policy.module.modules() if hasattr(m, "processor")}
    assert backends == {AttentionBackendName._NATIVE_MATH}
    assert policy.module.transformer_blocks[0]._compiled_call_impl is not None
    assert params and all("lora_" in name for name in params)


def test_serve_runs_its_kernels_on_every_pipeline_it_opens(flux_model: Path) -> None:
    """serve's --attention-backend / --compile reach each pipeline it loads (`Pipelines.open`, also a
    swapped-in adapter's); a backend this machine lacks is one line before anything loads."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    from stages.sample.lockstep import Pipelines

    with pytest.raises(UserInputError, match="--attention-backend flash_hub: not installed here"):
        Pipelines(flux_model, dtype="fp32", device="cpu", kernels=Kernels("flash_hub"))
    engine = Pipelines(flux_model, dtype="fp32", device="cpu", kernels=Kernels("_native_math", True)).open(
        None
    )
    module = engine.policy.module
    assert {m.processor._attention_backend for m in module.modules() if hasattr(m, "processor")} == {
        AttentionBackendName._NATIVE_MATH
    }
    assert module.transformer_blocks[0]._compiled_call_impl is not None


def test_only_a_quantized_attention_backend_is_part_of_the_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.outputs import run_config

    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    assert run_config({"steps": 4, "attention_backend": None, "compile": True}) == {"steps": 4}
    assert run_config({"steps": 4, "attention_backend": "_native_cudnn"}) == {"steps": 4}
    assert run_config({"steps": 4, "attention_backend": "sage"}) == {"steps": 4, "attention_backend": "sage"}
    # diffusers' default backend from the environment, under the same rule; the option overrides it
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "sage")
    assert run_config({"steps": 4, "attention_backend": None}) == {"steps": 4, "attention_backend": "sage"}
    assert run_config({"steps": 4, "attention_backend": "native"}) == {"steps": 4}
    assert run_config({"steps": 4}) == {"steps": 4}  # a command that runs no transformer
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "_native_flash")
    assert run_config({"steps": 4, "attention_backend": None}) == {"steps": 4}


@pytest.mark.parametrize("flag", ["--sp-degree", "--tp-degree"])
def test_online_model_parallelism_needs_a_launch_and_is_onlines_own_option(
    tiny_sd3: Path, tmp_path: Path, flag: str
) -> None:
    """online's --sp-degree / --tp-degree spread its trainer over a launch's ranks
    (tests/test_online_parallel.py): one process is refused naming the launcher, from the flag or a
    preset's top level, and a stage section's degree names online's own option; nothing is written."""
    prompts, preset = tmp_path / "p.txt", tmp_path / "preset.yaml"
    prompts.write_text("a cat\n")
    preset.write_text("sample:\n  steps: 2\n")
    online = ["online", "--config", str(preset), "--model", str(tiny_sd3), "--prompts", str(prompts)]
    fails([*online, "--out", str(tmp_path / "run"), flag, "2"], f"{flag} 2", "torchrun --nproc_per_node")
    preset.write_text(f"{flag[2:].replace('-', '_')}: 4\nsample:\n  steps: 2\n")
    fails([*online, "--out", str(tmp_path / "run")], f"{flag} 4", "torchrun --nproc_per_node")
    for section in ("sample", "update"):
        preset.write_text(f"{section}:\n  {flag[2:].replace('-', '_')}: 2\n")
        fails(
            [*online, "--out", str(tmp_path / "run")],
            f"'{section}.{flag[2:].replace('-', '_')}' is omnirl online's own {flag}",
            "the preset's top level",
        )
    assert not (tmp_path / "run").exists()
