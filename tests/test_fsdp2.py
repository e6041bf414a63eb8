"""FSDP2 (`update --strategy fsdp2`, torch fully_shard on a gloo CPU mesh) computes the update of one
process, holds a share of the weights and AdamW state per rank, and writes whole adapters and trainer
state that a plain process resumes from; gradient checkpointing changes memory, not numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import fails, run, staged_update_args, torchrun
from safetensors.torch import load_file

from stages.errors import UserInputError

LORA = "pytorch_lora_weights.safetensors"
FULL = Path("transformer") / "diffusion_pytorch_model.safetensors"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _same_update(one: Path, two: Path, weights: Path) -> None:
    a, b = load_file(one / weights), load_file(two / weights)
    assert a.keys() == b.keys()
    for k in a:  # rank sums in another order; Adam may amplify a ~0 gradient's rounding (test_families)
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    for x, y in zip(_metrics(one), _metrics(two), strict=True):
        assert y["actor/grad_norm"] == pytest.approx(x["actor/grad_norm"], rel=1e-5)
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], rel=1e-6, abs=1e-8)


@pytest.mark.distributed
def test_fsdp2_lora_on_two_ranks_equals_one_process(staged: dict[str, Path], tmp_path: Path) -> None:
    common = ("--no-shuffle", "--micro-batch", "1", "--beta", "0.04")
    run(*staged_update_args(staged, tmp_path / "one", *common, "--grad-accum", "2"))
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--grad-accum", "1", "--strategy", "fsdp2")
    )
    _same_update(tmp_path / "one", tmp_path / "two", Path(LORA))
    state = json.loads((tmp_path / "two" / "omnirl_adapter.json").read_text())
    assert state["update_config"]["strategy"] == "fsdp2" and state["step"] == 3


@pytest.mark.distributed
def test_fsdp2_full_fine_tune_shards_weights_and_optimizer_state(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    common = ("--no-shuffle", "--micro-batch", "1", "--full", "--lr", "1e-4")
    run(*staged_update_args(staged, tmp_path / "one", *common, "--grad-accum", "2"))
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--grad-accum", "1", "--strategy", "fsdp2")
    )
    _same_update(tmp_path / "one", tmp_path / "two", FULL)
    one, two = _metrics(tmp_path / "one")[-1], _metrics(tmp_path / "two")[-1]
    # rank 0's shard of the weights and of AdamW's two moments: about half of one process's
    assert two["memory/param_bytes"] <= 0.6 * one["memory/param_bytes"]
    assert two["memory/optimizer_bytes"] <= 0.6 * one["memory/optimizer_bytes"]
    assert one["memory/optimizer_bytes"] >= 2 * one["memory/param_bytes"]  # exp_avg and exp_avg_sq

    # The trainer state is whole: a single process resumes from the sharded run's adapter exactly as
    # from the single-process one.
    resumed = []
    for name in ("one", "two"):
        out = tmp_path / f"{name}-next"
        run(*staged_update_args(staged, out, *common, "--grad-accum", "2", "--adapter", str(tmp_path / name)))
        resumed.append(load_file(out / FULL))
    for k in resumed[0]:
        torch.testing.assert_close(resumed[1][k], resumed[0][k], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_fsdp2_rank_never_holds_a_private_copy_of_the_whole_transformer(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    # tests/fsdp2_probe.py watches each rank of a full fine-tune: the device it loads onto, its share of
    # the trained module, and the whole tensors alive at once while the adapter and trainer state are saved.
    common = ("--no-shuffle", "--micro-batch", "1", "--grad-accum", "1", "--full", "--lr", "1e-4")
    probe = tmp_path / "probe"
    probe.mkdir()
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--strategy", "fsdp2"),
        program=(str(Path(__file__).with_name("fsdp2_probe.py")),),
        env={"PROBE_OUT": str(probe)},
    )
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    whole = ranks[0]["param_bytes"]
    for r in ranks:
        # Loaded onto plain `cpu`: under a launcher Accelerate says `cpu:0`, and `.to("cpu:0")` copied the
        # whole transformer into private memory on every rank before sharding.
        assert r["device"] == "cpu"
        assert r["param_bytes"] == whole and 0.45 * whole <= r["shard_bytes"] <= 0.55 * whole
    # Saving: rank 0 gathers the weights (1x), writes and drops them, then AdamW's two moments (2x),
    # never all three whole at once; the other ranks drop each gathered tensor at once.
    assert 2 * whole <= ranks[0]["max_whole_bytes"] <= 2.05 * whole
    assert ranks[1]["max_whole_bytes"] == 0


def test_gradient_checkpointing_gives_the_same_update(staged: dict[str, Path], tmp_path: Path) -> None:
    common = ("--no-shuffle", "--micro-batch", "2")
    run(*staged_update_args(staged, tmp_path / "plain", *common))
    run(*staged_update_args(staged, tmp_path / "ckpt", *common, "--gradient-checkpointing"))
    a, b = load_file(tmp_path / "plain" / LORA), load_file(tmp_path / "ckpt" / LORA)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    cfg = json.loads((tmp_path / "ckpt" / "omnirl_adapter.json").read_text())["update_config"]
    assert cfg["gradient_checkpointing"] is True


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_fsdp2_nft_with_ema_keeps_the_old_policy_and_ema_whole(
    staged: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    # The old policy runs between the trained forward and its backward, on weights copied into the shards.
    full = ("--full", "--lr", "1e-4") if kind == "full" else ()
    common = ("--no-shuffle", "--micro-batch", "1", "--algo", "nft", "--ema", *full)
    run(*staged_update_args(staged, tmp_path / "one", *common, "--grad-accum", "2"))
    torchrun(
        *staged_update_args(staged, tmp_path / "two", *common, "--grad-accum", "1", "--strategy", "fsdp2")
    )
    weights = FULL if full else Path(LORA)
    a, b = load_file(tmp_path / "one" / weights), load_file(tmp_path / "two" / weights)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    for name in ("ema.safetensors", "old_weights.safetensors"):
        x, y = (load_file(tmp_path / d / "trainer_state" / name) for d in ("one", "two"))
        assert x.keys() == y.keys() and x
        for k in x:
            torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-5)


def test_fsdp2_refuses_no_launcher_and_weight_swapping_without_reshard_after_forward(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = staged_update_args(staged, tmp_path / "p", "--strategy", "fsdp2", "--algo", "nft")
    fails(args, "--strategy fsdp2 needs a launcher", "torchrun")  # no process group to shard over
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under a launcher; refused before any process group is made
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")  # the gathered weights would be stale
    fails(args, "fsdp_reshard_after_forward", "old/EMA policy")


def _whole(folder: Path) -> dict[str, torch.Tensor]:
    """A sharded state's tensors, whole, by flat key ("ema.<param>", "optimizer.state.<param>.exp_avg"),
    assembled from every rank's safetensors file and the offsets in its header."""
    from safetensors import safe_open

    pieces: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                pieces.setdefault(key, []).append((offsets[key]["saved_offsets"], f.get_tensor(key)))
    whole = {}
    for key, chunks in pieces.items():
        size = [max(o[d] + t.shape[d] for o, t in chunks) for d in range(chunks[0][1].dim())]
        whole[key] = torch.zeros(size, dtype=chunks[0][1].dtype)
        for o, t in chunks:
            whole[key][tuple(slice(a, a + n) for a, n in zip(o, t.shape))] = t
    return whole


@pytest.mark.distributed
def test_fsdp2_sharded_state_resumes_as_the_full_state(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFT with EMA: optimizer moments, EMA and old policy are all trainer state. Two updates in a row on
    # 2 ranks, once with whole tensors (the default) and once with each rank's shards (DCP).
    common = ("--no-shuffle", "--micro-batch", "1", "--grad-accum", "1", "--algo", "nft", "--ema")
    common += ("--strategy", "fsdp2", "--full", "--lr", "1e-4")
    for layout in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        monkeypatch.setenv("FSDP_STATE_DICT_TYPE", layout)
        first, second = tmp_path / layout / "it1", tmp_path / layout / "it2"
        torchrun(*staged_update_args(staged, first, *common))
        torchrun(*staged_update_args(staged, second, *common, "--adapter", str(first)))
    full, sharded = tmp_path / "FULL_STATE_DICT", tmp_path / "SHARDED_STATE_DICT"

    state = sharded / "it1" / "trainer_state"
    assert sorted(p.name for p in (state / "sharded").iterdir()) == [
        "index.json",  # JSON and safetensors only: nothing in the folder is a pickle
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    assert not (state / "optimizer.pt").exists() and not (state / "ema.safetensors").exists()
    info = json.loads((state / "state.json").read_text())
    assert info["sharded"] == ["ema", "old_weights", "optimizer"] and info["sharded_world_size"] == 2
    # The shards hold exactly the whole tensors the default layout writes.
    whole, ref = _whole(state / "sharded"), full / "it1" / "trainer_state"
    for part in ("ema", "old_weights"):
        expected = load_file(ref / f"{part}.safetensors")
        assert {k for k in whole if k.startswith(f"{part}.")} == {f"{part}.{k}" for k in expected}
        for k in expected:
            torch.testing.assert_close(whole[f"{part}.{k}"], expected[k], rtol=0, atol=0)
    optimizer = torch.load(ref / "optimizer.pt", weights_only=True)
    index = json.loads((state / "sharded" / "index.json").read_text())
    names = index["values"]["optimizer"]["param_groups"][0]["params"]  # by name, in the optimizer's order
    assert index["world_size"] == 2 and len(names) == len(optimizer["state"])
    for i, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(
                whole[f"optimizer.state.{name}.{moment}"], optimizer["state"][i][moment]
            )

    # The adapter itself stays whole and loadable; resuming from the shards gives the same bytes.
    for it in ("it1", "it2"):
        a, b = load_file(full / it / FULL), load_file(sharded / it / FULL)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    for x, y in zip(_metrics(full / "it2"), _metrics(sharded / "it2"), strict=True):
        assert y["actor/grad_norm"] == x["actor/grad_norm"] and y["actor/pg_loss"] == x["actor/pg_loss"]

    # One process resumes from the 2 ranks' shards as from the whole tensors (DCP reads them by name).
    monkeypatch.delenv("FSDP_STATE_DICT_TYPE")
    single = ("--no-shuffle", "--micro-batch", "1", "--algo", "nft", "--ema", "--full", "--lr", "1e-4")
    for layout in (full, sharded):
        run(*staged_update_args(staged, layout / "one", *single, "--adapter", str(layout / "it1")))
    a, b = load_file(full / "one" / FULL), load_file(sharded / "one" / FULL)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)


def test_sharded_state_round_trips_into_a_plain_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a process group DCP writes one shard and reads it back into whole tensors: the layout a
    # one-process or DDP run resumes a sharded checkpoint into (by parameter name, not position).
    from stages.update import sharded_state
    from stages.update.trainer import load_state

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    module[0].bias.requires_grad_(False)  # a frozen parameter has no optimizer state
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(named.values(), lr=1e-2)
    for _ in range(3):
        module(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    ema = {k: v.detach() * 0.5 for k, v in named.items()}
    state = sharded_state.collect(module, optimizer, {"ema": ema, "old_weights": None})
    folder = tmp_path / "trainer_state"
    assert sharded_state.save(folder, state) == ["ema", "optimizer"]

    fresh = torch.optim.AdamW(named.values(), lr=5.0)
    loaded = sharded_state.load(folder, ["ema", "optimizer"], module, fresh, named)
    assert loaded.keys() == {"ema"}
    for k in ema:
        torch.testing.assert_close(loaded["ema"][k], ema[k], rtol=0, atol=0)
    before, after = optimizer.state_dict(), fresh.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-2  # the saved groups; `train` then applies this run's
    for i, s in before["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(after["state"][i][key], value, rtol=0, atol=0)

    # A sharded folder whose index (index.json, written last) is missing is refused in one line.
    (folder / "state.json").write_text(json.dumps({"step": 3, "sharded": ["ema", "optimizer"]}))
    pending, step = load_state(tmp_path)
    assert (
        step == 3 and pending["sharded"]["parts"] == ["ema", "optimizer"] and pending["ema"]["shadow"] is None
    )
    index = (folder / "sharded" / "index.json").read_bytes()
    (folder / "sharded" / "index.json").unlink()
    with pytest.raises(UserInputError, match=r"has no index\.json; it is incomplete"):
        load_state(tmp_path)
    (folder / "sharded" / "index.json").write_bytes(index)


class _Payload:
    """What a crafted pickle runs when unpickled: it creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _sharded_adapter(tmp_path: Path) -> tuple[Path, torch.nn.Module, dict[str, torch.Tensor]]:
    """An adapter folder holding a one-process sharded trainer state of a tiny module (ema + optimizer)."""
    from stages.update import sharded_state

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    named = dict(module.named_parameters())
    optimizer = torch.optim.AdamW(named.values(), lr=1e-2)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()  # a resuming run's fresh optimizer meets parameters without gradients
    state = sharded_state.collect(module, optimizer, {"ema": {k: v.detach() for k, v in named.items()}})
    folder = tmp_path / "adapter" / "trainer_state"
    sharded_state.save(folder, state)
    (folder / "state.json").write_text(json.dumps({"step": 1, "sharded": ["ema", "optimizer"]}))
    return tmp_path / "adapter", module, named


def test_a_crafted_sharded_state_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    # Adapters are shared: every file in one is untrusted. DCP's own index (.metadata) is a pickle; a
    # crafted one whose __reduce__ creates a file must never run, and each damaged file is named.
    import pickle

    from stages.update import sharded_state
    from stages.update.trainer import load_state

    adapter, module, named = _sharded_adapter(tmp_path)
    sharded = adapter / "trainer_state" / "sharded"
    marker = tmp_path / "pwned"
    (sharded / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (sharded / "__0_0.distcp").write_bytes(pickle.dumps(_Payload(marker)))

    def refused(match: str) -> None:
        with pytest.raises(UserInputError, match=match) as info:
            load_state(adapter)
            sharded_state.load(adapter / "trainer_state", ["ema", "optimizer"], module, opt, named)
        assert "\n" not in str(info.value) and not marker.exists()

    opt = torch.optim.AdamW(named.values(), lr=1.0)
    # the crafted pickles beside a whole state are never read
    loaded = sharded_state.load(adapter / "trainer_state", ["ema", "optimizer"], module, opt, named)
    assert loaded.keys() == {"ema"} and not marker.exists()

    # DCP's pickle format alone (an older omnirl's, or a crafted one) is refused, not unpickled
    index = (sharded / "index.json").read_bytes()
    (sharded / "index.json").unlink()
    refused(r"pickle format .* never unpickles")
    (sharded / "index.json").write_bytes(index)

    # a truncated shard names the file
    shard = sharded / "shard-00001-model-00001-of-00001.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) - 7])
    refused(r"shard-00001-model-00001-of-00001\.safetensors is not a whole safetensors file")
    shard.write_bytes(b"\xff" * 5)
    refused(r"shard-00001-model-00001-of-00001\.safetensors is not a whole safetensors file")
    shard.write_bytes(whole)

    # an extra shard file the index does not name, or an index that is no index
    (sharded / "shard-00002-model-00001-of-00001.safetensors").write_bytes(whole)
    refused(r"index\.json names")
    (sharded / "shard-00002-model-00001-of-00001.safetensors").unlink()
    (sharded / "index.json").write_text("[1, 2")
    refused(r"index\.json is not an omnirl sharded-state index")
    (sharded / "index.json").write_bytes(index)

    # the index's values keep this run's structure and kinds (lr a number, not a string)
    tampered = json.loads(index)
    tampered["values"]["optimizer"]["param_groups"][0]["lr"] = "0.1"
    (sharded / "index.json").write_text(json.dumps(tampered))
    with pytest.raises(UserInputError, match=r"param_groups\[0\]\.lr is '0\.1' where this run has a float"):
        sharded_state.load(adapter / "trainer_state", ["ema", "optimizer"], module, opt, named)
    # another model's state (other parameter shapes) is refused in one line
    (sharded / "index.json").write_bytes(index)
    other = torch.nn.Linear(3, 5)
    other_named = dict(other.named_parameters())
    with pytest.raises(UserInputError, match=r"does not fit this run"):
        sharded_state.load(
            adapter / "trainer_state",
            ["ema", "optimizer"],
            other,
            torch.optim.AdamW(other_named.values()),
            other_named,
        )
    assert not marker.exists()


@pytest.mark.parametrize(
    ("value", "layout"),
    [(None, "full"), ("FULL_STATE_DICT", "full"), ("SHARDED_STATE_DICT", "sharded"), ("3", "sharded")],
)
def test_the_launchers_state_dict_type_picks_the_layout(
    value: str | None, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.update.parallel import launcher_state_dict_type

    if value is None:
        monkeypatch.delenv("FSDP_STATE_DICT_TYPE", raising=False)
    else:
        monkeypatch.setenv("FSDP_STATE_DICT_TYPE", value)
    assert launcher_state_dict_type() == layout


def test_fsdp1s_local_state_dict_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages.update.parallel import launcher_strategy

    for var, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT",
    }.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(UserInputError, match="fsdp_state_dict_type LOCAL_STATE_DICT"):
        launcher_strategy()
