"""`omnirl online --engine remote` against a real `omnirl serve` on 127.0.0.1, and pushed LoRA weights.

With staleness 0 the remote run writes the same bytes as the in-process run (samples, rewards,
advantages, checkpoints: the server returns the prompt conditioning it sampled with, and the trainer
trains on it without a text encoder, as the in-process one does) and every sample's version gap is 0; with staleness 1 the gaps stay within 1,
one version per iteration (the sampler pins it), and each sample's version is the step of the update its gap names. A LoRA file pushed to
/omnirl/v1/weights swaps onto the server's pipeline in place, changes the next samples and equals the
in-process `--adapter` samples; a cut, oversized or malformed push is refused and the weights stay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, online_args, run, runner
from helpers import SMALL_ONLINE_PRESET as PRESET
from safetensors.torch import load_file
from test_serve import Server, _request

from omnirl_cli.app import app
from stages.shards.reader import ShardSet


@pytest.fixture(scope="module")
def files(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("online-remote")
    (root / "preset.yaml").write_text(PRESET)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return {"model": tiny_sd3, "prompts": root / "prompts.txt", "preset": root / "preset.yaml"}


@pytest.fixture(scope="module")
def server(tiny_sd3: Path) -> Iterator[Server]:
    srv = Server(tiny_sd3, "--max-weights-mb", "1")
    yield srv
    code, err = srv.stop()  # SIGTERM by PID
    assert code == 0 and "Traceback" not in err, err


def _online(files: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    args = online_args(files["preset"], files, out, "--reward", "jpeg_compressibility", *extra)
    return run(*args)["iterations"]


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("train-*"))}


def test_remote_online_equals_in_process_online_at_staleness_0(
    files: dict[str, Path], server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.sample.remote_engine import RemoteEngine

    local = _online(files, tmp_path / "local", "--iterations", "2", "--save-trajectories")
    before = set(_request(server.url, "GET", "/omnirl/v1/weights")[1]["named_weights"])
    held_at_close: list[dict] = []
    close = RemoteEngine.close

    def recording_close(engine: RemoteEngine) -> None:
        if engine.pushed_named:
            held_at_close.append(_request(server.url, "GET", "/omnirl/v1/weights")[1]["named_weights"])
        close(engine)

    monkeypatch.setattr(RemoteEngine, "close", recording_close)
    remote = _online(
        files,
        tmp_path / "remote",
        "--iterations",
        "2",
        "--save-trajectories",
        "--engine",
        "remote",
        "--server-url",
        server.url,
    )
    assert [it["version_gaps"] for it in remote] == [[0], [0]] == [it["version_gaps"] for it in local]
    assert [it["policy_versions"] for it in remote] == [[0], [remote[0]["step"]]]
    assert remote[0]["sampler_device"] == f"remote {server.url}"
    # the run pushed its checkpoints under its own random name (as its run ended: the optimizer steps of
    # both updates) and forgot them; the server's unnamed weights stay the base model
    (named,) = held_at_close
    (name,) = set(named) - before
    assert name.startswith("online-") and len(name) == len("online-") + 16
    assert named[name]["versions"] == [remote[0]["step"], remote[1]["step"]]
    held = _request(server.url, "GET", "/omnirl/v1/weights")[1]
    assert set(held["named_weights"]) == before
    assert held["weights"]["adapter"] is None
    # Both trainers train on the prompt conditioning their sampler drew with, handed over with the
    # trajectories (the server returns it): neither loads a text encoder, and every checkpoint (LoRA and
    # optimizer state) is the same bits. Each rollout is drawn by the same weights through both engines
    # (the second by the pushed LoRA): the same bytes.
    for k in (0, 1):
        for part in ("samples", "rewards", "advantages"):
            a, b = tmp_path / "local" / f"it{k}" / part, tmp_path / "remote" / f"it{k}" / part
            assert _bytes(a) and _bytes(a) == _bytes(b), (k, part)
    assert [it["loaded_components"] for it in remote] == [["scheduler", "transformer"]] * 2
    assert [it["conditioning"] for it in remote] == ["from the sampler"] * 2
    for k in (0, 1):
        policies = [tmp_path / d / f"it{k + 1}" / "policy" for d in ("local", "remote")]
        weights = [{p.name: load_file(p) for p in sorted(d.rglob("*.safetensors"))} for d in policies]
        assert weights[0].keys() == weights[1].keys() and weights[0], k  # LoRA and optimizer state
        for name, tensors in weights[0].items():
            assert tensors.keys() == weights[1][name].keys()
            assert all(torch.equal(weights[1][name][key], value) for key, value in tensors.items()), name
    for key in ("reward_mean", "pg_loss", "ratio_mean", "step"):
        assert [it[key] for it in remote] == [it[key] for it in local], key


def test_a_run_that_fails_to_start_forgets_the_weights_it_pushed(
    files: dict[str, Path], server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.online.pipeline as pipeline
    from stages.errors import RuntimeFailure
    from stages.sample.remote_engine import RemoteEngine

    before = set(_request(server.url, "GET", "/omnirl/v1/weights")[1]["named_weights"])
    held_after_push: list[set[str]] = []
    push = RemoteEngine.push_weights

    def recording_push(engine: RemoteEngine, *args, **kwargs):
        reply = push(engine, *args, **kwargs)
        held_after_push.append(set(_request(server.url, "GET", "/omnirl/v1/weights")[1]["named_weights"]))
        return reply

    def workers_that_fail(*args, **kwargs):
        raise RuntimeFailure("the sampler worker could not start")

    monkeypatch.setattr(RemoteEngine, "push_weights", recording_push)
    monkeypatch.setattr(pipeline, "Workers", workers_that_fail)
    extra = ("--reward", "jpeg_compressibility", "--engine", "remote", "--server-url", server.url)
    result = runner.invoke(app, online_args(files["preset"], files, tmp_path / "run", *extra))
    assert result.exit_code == 1 and "the sampler worker could not start" in result.output
    (held,) = held_after_push  # the first push went through under the run's own name ...
    assert len(held - before) == 1
    assert (
        set(_request(server.url, "GET", "/omnirl/v1/weights")[1]["named_weights"]) == before
    )  # ... and is gone


def test_remote_online_at_staleness_1_keeps_gaps_within_1(
    files: dict[str, Path], server: Server, tmp_path: Path
) -> None:
    its = _online(
        files,
        tmp_path / "s1",
        "--iterations",
        "3",
        "--max-staleness",
        "1",
        "--save-trajectories",
        "--engine",
        "remote",
        "--server-url",
        server.url,
    )
    assert its[0]["version_gaps"] == [0]
    steps = {0: 0, **{it["iteration"] + 1: it["step"] for it in its}}  # iteration count → its step
    for it in its:
        assert set(it["version_gaps"]) <= {0, 1} and it["version_gap_max"] == max(it["version_gaps"])
        k = it["iteration"]
        versions = ShardSet(tmp_path / "s1" / f"it{k}" / "samples").read_all()["policy_version"]
        assert {int(v) for v in versions} <= {steps[k], steps[k - 1] if k else 0}
        assert len(set(versions.tolist())) == 1  # the sampler pinned one version for the iteration
        assert sorted({k - next(j for j, s in steps.items() if s == v) for v in versions.tolist()}) == sorted(
            it["version_gaps"]
        )


def test_online_remote_needs_a_server_url_and_lora(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "x"
    base = online_args(files["preset"], files, out, "--reward", "jpeg_compressibility", "--engine", "remote")
    fails(base, "--engine remote", "--server-url")
    fails(
        [*base, "--server-url", "http://127.0.0.1:1", "--set", "update.full=true"], "--engine remote", "full"
    )
    # vLLM-Omni takes no pushed weights in either mode: refused before anything is opened or written
    vllm = online_args(
        files["preset"], files, out, "--reward", "jpeg_compressibility", "--engine", "vllm-omni"
    )
    for extra in ([], ["--server-url", "http://127.0.0.1:1"]):
        fails([*vllm, *extra], "--engine vllm-omni", "no pushed weights", "--engine remote")
    assert not out.exists()


# ---- pushed LoRA weights ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter (rank 4, random B so that it changes the samples) at optimizer step 5."""
    from stages.models.diffusion import FlowPolicy

    policy = FlowPolicy.load(tiny_sd3)
    policy.add_lora(rank=4, alpha=8)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    out = tmp_path_factory.mktemp("online-remote") / "adapter"
    policy.save_adapter(out, kind="lora", extra={"step": 5})
    return out


def _push(url: str, raw: bytes, version: int, digest: str | None = None) -> tuple[int, dict]:
    query = f"sha256={digest or hashlib.sha256(raw).hexdigest()}&version={version}"
    headers = {"Content-Type": "application/octet-stream"}
    return _request(url, "POST", f"/omnirl/v1/weights?{query}", raw=raw, headers=headers)


def test_a_pushed_lora_swaps_in_place_and_equals_the_in_process_adapter(
    server: Server, adapter: Path, files: dict[str, Path]
) -> None:
    from stages.sample.engines import EngineOptions, open_engine
    from stages.sample.prompts import read_prompts
    from stages.sample.rollout import SampleConfig
    from stages.sample.stage import plan_rows, sample_shard

    model = files["model"]
    cfg = SampleConfig(steps=3, guidance=1.0, resolution=32, sampler="sde", noise_level=0.7, batch_size=2)
    cfg.max_sequence_length = 32
    rows = plan_rows(list(enumerate(read_prompts([str(files["prompts"])]))), 2, cfg)
    remote = open_engine(
        "remote", EngineOptions(model=model, server_url=server.url, pushed_weights=True), "cpu"
    )
    raw = (adapter / "pytorch_lora_weights.safetensors").read_bytes()

    status, reply = _request(server.url, "POST", "/omnirl/v1/weights", {"adapter": None})
    assert status == 200 and reply["load"]["how"] == "unloaded"
    before = reply["weights"]
    base = sample_shard(remote, cfg, rows, 0)
    refusals = [
        (400, _push(server.url, raw[:-1], 9, hashlib.sha256(raw).hexdigest())),  # cut on the way
        (400, _push(server.url, raw, 9, "xyz")),
        (422, _push(server.url, b"{}" + raw, 9)),  # not a safetensors file
        (413, _push(server.url, raw + b"\0" * 2**20, 9)),  # over --max-weights-mb 1
    ]
    for status, (got, reply) in refusals:
        assert got == status and reply["error"]["code"] == status, reply
    assert _request(server.url, "GET", "/omnirl/v1/weights")[1]["weights"] == before

    status, reply = _push(server.url, raw, 9)
    assert status == 200, reply
    assert reply["weights"]["adapter_sha256"] == hashlib.sha256(raw).hexdigest()
    assert reply["weights"]["version"] == 9 and reply["load"]["how"] == "replaced"
    status, reply = _push(server.url, raw, 10)
    assert status == 200 and reply["load"]["how"] == "copied"  # same LoRA config: values copied in place

    pushed = sample_shard(remote, cfg, rows, 0)
    local = sample_shard(
        open_engine("diffusers", EngineOptions(model=model, adapter=adapter), "cpu"), cfg, rows, 5
    )
    assert pushed["policy_version"].tolist() == [10] * len(rows)  # the version the server used
    assert base["policy_version"].tolist() == [0] * len(rows)
    for key in ("latents", "log_probs", "final_latent"):
        assert torch.equal(pushed[key], local[key]), key
    assert pushed["image"] == local["image"]
    assert not torch.equal(base["final_latent"], pushed["final_latent"])  # the push changed the samples


def test_a_lora_that_does_not_fit_leaves_the_pipeline_as_it_was(tiny_sd3: Path, adapter: Path) -> None:
    from stages.errors import UserInputError
    from stages.models.diffusion import FlowPolicy
    from stages.models.lora_weights import read_lora_file

    policy = FlowPolicy.load(tiny_sd3, adapter=adapter)
    before = {n: p.detach().clone() for n, p in policy.transformer.named_parameters()}
    raw = (adapter / "pytorch_lora_weights.safetensors").read_bytes()
    layers, config = read_lora_file(raw, "transformer")
    first = next(iter(layers))
    with pytest.raises(UserInputError, match=f"lacks {first}"):  # same config: checked before copying
        policy.set_lora({k: v for k, v in layers.items() if k != first}, config)
    with pytest.raises(UserInputError, match="has shape"):  # rank 2: unloaded, added, refused, restored
        policy.set_lora(layers, {**config, "r": 2})
    after = dict(policy.transformer.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    with pytest.raises(ValueError, match="safetensors"):
        read_lora_file(raw[:100], "transformer")


def test_the_prompt_cache_keeps_text_lengths_apart(tiny_sd3: Path) -> None:
    """A server keeps its policy (and prompt cache) across weight swaps and clients: a request at
    another text length must not get the embeddings cached at the first one."""
    from stages.models.diffusion import FlowPolicy

    policy = FlowPolicy.load(tiny_sd3)
    short, long = (policy.encode(["a cat"], None, False, n).pos for n in (32, 128))
    assert [v.shape for v in short.values()] != [v.shape for v in long.values()]
    again = policy.encode(["a cat"], None, False, 32).pos
    assert all(torch.equal(again[k], short[k]) for k in short)


def test_a_server_holding_a_full_adapter_reloads_the_base_for_a_pushed_lora(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """A LoRA cannot swap onto a full fine-tune in place: the base pipeline is loaded beside, the
    LoRA put on it, then swapped in; after that pushes copy in place again."""
    from stages.models.diffusion import FlowPolicy
    from stages.sample.rollout_server import RolloutService

    policy = FlowPolicy.load(tiny_sd3)
    policy.trainable_parameters(full=True)
    policy.save_adapter(tmp_path / "full", kind="full", extra={"step": 3})
    policy.add_lora(rank=4, alpha=8)
    raw = policy.lora_file()
    service = RolloutService(tiny_sd3, tmp_path / "full")
    assert service.weights["version"] == 3 and service.held.full
    query = {"sha256": [hashlib.sha256(raw).hexdigest()]}
    reply = service.held.load(raw, {**query, "version": ["4"]})
    assert reply["load"]["how"] == "reloaded, replaced" and not service.held.full
    assert reply["weights"]["adapter"] == "pushed" and reply["weights"]["version"] == 4
    assert service.held.load(raw, {**query, "version": ["5"]})["load"]["how"] == "copied"
