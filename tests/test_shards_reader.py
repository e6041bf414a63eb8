"""ShardSet / open_inputs: verification, corruption errors, column-group zips, describe()."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from stages.errors import CorruptShardError, UserInputError
from stages.shards import ShardSet, ShardSetWriter, describe, open_inputs
from stages.shards.manifest import MANIFEST_NAME

FORMATS = ("parquet", "webdataset")


def write(
    out: Path,
    shards: list[dict],
    fmt: str = "parquet",
    command: str = "sample",
    parents=(),
    config_seed: int = 0,
    **kw,
) -> Path:
    config = {"c": command, "seed": config_seed}
    w = ShardSetWriter(
        out, num_shards=len(shards), format=fmt, command=command, config=config, parents=parents, **kw
    )
    for i, b in enumerate(shards):
        w.write_shard(i, b)
    w.finalize()
    return out


def samples(rows=(3, 4)) -> list[dict]:
    return [
        {
            "sample_id": [f"s{i}-{r}" for r in range(n)],
            "latents": torch.arange(n * 8, dtype=torch.float32).reshape(n, 2, 4) + 100 * i,
            "prompt": [f"prompt {i} {r}" for r in range(n)],
        }
        for i, n in enumerate(rows)
    ]


def rewards(rows=(3, 4), ids=None) -> list[dict]:
    return [
        {
            "sample_id": ids[i] if ids else [f"s{i}-{r}" for r in range(n)],
            "reward": torch.arange(n, dtype=torch.float32) / 10 + i,
        }
        for i, n in enumerate(rows)
    ]


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_byte_is_a_checksum_error_naming_the_file(tmp_path, fmt: str) -> None:
    out = write(tmp_path / "set", samples(), fmt)
    s = ShardSet(out)
    path = s.shard_path(1)
    flip_byte(path)
    assert s.read_shard(0)["prompt"][0] == "prompt 0 0"
    with pytest.raises(CorruptShardError, match=rf"{path}: sha256 .* does not match the manifest"):
        s.read_shard(1)
    with pytest.raises(CorruptShardError, match=str(path)):
        ShardSet(out).verify()
    with pytest.raises(
        CorruptShardError,
        match="re-run the command that produced it \\(omnirl sample\\) with the same options",
    ):
        list(ShardSet(out))


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_or_missing_shard(tmp_path, fmt: str) -> None:
    out = write(tmp_path / "set", samples(), fmt)
    s = ShardSet(out)
    path = s.shard_path(0)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(
        CorruptShardError, match=rf"{path} has {size // 2} bytes but the manifest lists {size}"
    ):
        s.read_shard(0)
    path.unlink()
    with pytest.raises(CorruptShardError, match=rf"{path} is listed in the manifest but missing"):
        s.read_shard(0)


def test_checksum_mismatch_in_manifest(tmp_path) -> None:
    out = write(tmp_path / "set", samples())
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["shards"][1]["sha256"] = "0" * 64
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    s = ShardSet(out)
    s.read_shard(0)
    with pytest.raises(
        CorruptShardError, match=r"train-00001-of-00002.parquet: sha256 .* manifest's 0000000000000000"
    ):
        s.read_shard(1)
    assert ShardSet(out, verify=False).read_shard(1)["prompt"] == [f"prompt 1 {r}" for r in range(4)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_garbage_with_matching_checksum_is_a_decode_error(tmp_path, fmt: str) -> None:
    """A shard whose bytes match the manifest but are not the format (a buggy producer)."""
    out = write(tmp_path / "set", samples(), fmt)
    m = json.loads((out / MANIFEST_NAME).read_text())
    path = out / m["shards"][0]["file"]
    junk = b"\x01" * 4096
    path.write_bytes(junk)
    m["shards"][0].update(bytes=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(CorruptShardError, match=str(path)):
        ShardSet(out).read_shard(0)


def test_verification_is_cached_but_rechecked_after_change(tmp_path) -> None:
    out = write(tmp_path / "set", samples())
    s = ShardSet(out)
    s.read_shard(0)
    path = s.shard_path(0)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.unlink()
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="sha256"):
        s.read_shard(0)


def test_missing_column_and_bad_index(tmp_path) -> None:
    out = write(tmp_path / "set", samples())
    s = ShardSet(out)
    with pytest.raises(
        UserInputError, match=rf"column 'reward' is not in {out} \(it has: sample_id, latents, prompt\)"
    ):
        s.read_shard(0, ["latents", "reward"])
    with pytest.raises(UserInputError, match=r"outside 0\.\.1"):
        s.read_shard(2)


# ----------------------------------------------------------------------------- zipped column groups


@pytest.mark.parametrize("fmt", FORMATS)
def test_zip_column_groups(tmp_path, fmt: str) -> None:
    a = write(tmp_path / "samples", samples(), fmt)
    b = write(tmp_path / "rewards", rewards(), "parquet", command="score", parents=[a])
    z = open_inputs([a, b])
    assert z.num_shards == 2 and z.num_rows == 7
    assert list(z.columns) == ["sample_id", "latents", "prompt", "reward"]
    got = z.read_shard(1)
    assert got["sample_id"] == [f"s1-{r}" for r in range(4)]
    assert torch.equal(got["reward"], torch.arange(4, dtype=torch.float32) / 10 + 1)
    assert torch.equal(got["latents"], samples()[1]["latents"])
    sub = z.read_shard(0, ["reward", "prompt"])
    assert list(sub) == ["reward", "prompt"]
    everything = z.read_all(["reward"])
    assert everything["reward"].shape == (7,)
    assert [len(batch["prompt"]) for batch in z] == [3, 4]
    assert [m.command for m in z.manifests] == ["sample", "score"]


def test_zip_sample_id_mismatch_names_both_files(tmp_path) -> None:
    a = write(tmp_path / "samples", samples())
    ids = [[f"s0-{r}" for r in range(3)], ["s1-0", "s1-1", "OTHER", "s1-3"]]
    b = write(tmp_path / "rewards", rewards(ids=ids), parents=[a])
    z = open_inputs([a, b])
    z.read_shard(0, ["reward"])
    with pytest.raises(
        UserInputError,
        match=rf"sample_id differs at row 2 of shard 1: {a}/train-00001-of-00002.parquet vs {b}/train-00001-of-00002.parquet",
    ):
        z.read_shard(1, ["reward"])


def test_zip_row_count_mismatch_names_both_files(tmp_path) -> None:
    a = write(tmp_path / "samples", samples())
    b = write(tmp_path / "rewards", rewards(rows=(3, 5)), parents=[a])
    with pytest.raises(
        UserInputError,
        match=rf"{a}/train-00001-of-00002.parquet has 4 rows but {b}/train-00001-of-00002.parquet has 5",
    ):
        open_inputs([a, b])


def test_zip_shard_count_mismatch_names_both_dirs(tmp_path) -> None:
    a = write(tmp_path / "samples", samples())
    b = write(tmp_path / "rewards", rewards(rows=(7,)), parents=[a])
    with pytest.raises(UserInputError, match=rf"{a} has 2 shards but {b} has 1"):
        open_inputs([a, b])


def test_zip_duplicate_column_names_both_dirs(tmp_path) -> None:
    a = write(tmp_path / "samples", samples())
    more = [{"sample_id": s["sample_id"], "prompt": s["prompt"]} for s in samples()]
    b = write(tmp_path / "more", more, parents=[a])
    with pytest.raises(UserInputError, match=rf"column 'prompt' is in both {a} and {b}"):
        open_inputs([a, b])
    with pytest.raises(UserInputError, match="no input shard set"):
        open_inputs([])
    with pytest.raises(UserInputError, match="column 'nope' is not in any of"):
        open_inputs([a]).read_shard(0, ["nope"])


# ----------------------------------------------------------------------------- lineage of zipped sets


def rollout_family(root: Path, seed: int) -> dict[str, Path]:
    """A rollout (seed-dependent values, the same ids every time) and sets derived from it as the commands record them."""
    rollout = [{**s, "latents": s["latents"] + seed} for s in samples()]
    s = write(root / "samples", rollout, config_seed=seed)
    r = write(root / "rewards", rewards(), command="score", parents=[s])
    lp = write(
        root / "logprobs", [{"sample_id": b["sample_id"]} for b in samples()], command="logprob", parents=[s]
    )
    adv = [{"sample_id": b["sample_id"], "advantages": b["reward"] * 2} for b in rewards()]
    a = write(root / "advantages", adv, command="advantage", parents=[s, r])
    return {"samples": s, "rewards": r, "logprobs": lp, "advantages": a}


def test_zip_of_one_rollout_passes_lineage(tmp_path) -> None:
    f = rollout_family(tmp_path / "a", 0)
    assert open_inputs([f["samples"], f["rewards"]]).num_rows == 7
    assert list(open_inputs([f["samples"], f["logprobs"], f["advantages"]]).columns) == [
        "sample_id",
        "latents",
        "prompt",
        "advantages",
    ]
    # siblings without their rollout share it through their parents; so does a set reached through an input
    assert list(open_inputs([f["rewards"], f["logprobs"]]).columns) == ["sample_id", "reward"]
    assert open_inputs([f["rewards"], f["advantages"]]).num_rows == 7
    # lineage is followed only through the inputs: a grandchild needs its parent zipped too
    g = write(
        tmp_path / "g",
        [{"sample_id": b["sample_id"], "x": b["reward"]} for b in rewards()],
        parents=[f["rewards"]],
    )
    assert open_inputs([f["samples"], f["rewards"], g]).num_rows == 7
    with pytest.raises(UserInputError, match=rf"{f['samples']} and {g} come from different rollouts"):
        open_inputs([f["samples"], g])


def test_zip_of_two_rollouts_names_both_dirs(tmp_path) -> None:
    a, b = rollout_family(tmp_path / "a", 0), rollout_family(tmp_path / "b", 1)
    assert ShardSet(a["samples"]).read_all()["sample_id"] == ShardSet(b["samples"]).read_all()["sample_id"]
    for sets, first, second in [
        ([a["samples"], b["rewards"]], a["samples"], b["rewards"]),
        ([a["samples"], a["logprobs"], b["advantages"]], a["samples"], b["advantages"]),
        ([b["rewards"], a["samples"]], b["rewards"], a["samples"]),
        ([a["rewards"], b["logprobs"]], a["rewards"], b["logprobs"]),
    ]:
        with pytest.raises(UserInputError, match=rf"^{first} and {second} come from different rollouts"):
            open_inputs(sets)


def test_zip_with_a_set_derived_from_an_earlier_run_is_refused(tmp_path) -> None:
    f = rollout_family(tmp_path / "a", 0)
    write(f["samples"], samples(), overwrite=True, config_seed=5)  # sampled again, with the same ids
    with pytest.raises(
        UserInputError, match=rf"{f['samples']} and {f['rewards']} come from different rollouts"
    ):
        open_inputs([f["samples"], f["rewards"]])


# ----------------------------------------------------------------------------- describe


def test_describe_stats_on_known_values(tmp_path) -> None:
    x = [torch.tensor([1.0, 2.0, float("nan")]), torch.tensor([3.0, float("inf"), 4.0, -float("inf")])]
    ints = [
        torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int64),
        torch.tensor([[7, 8]] * 4, dtype=torch.int64),
    ]
    shards = [
        {
            "sample_id": [str(r) for r in range(len(x[i]))],
            "x": x[i],
            "k": ints[i],
            "flag": torch.arange(len(x[i])) % 2 == 0,
        }
        for i in range(2)
    ]
    out = write(tmp_path / "set", shards, policy={"adapter": "a", "version": 2})
    d = describe(ShardSet(out))
    assert (
        d["num_rows"] == 7 and d["num_shards"] == 2 and d["format"] == "parquet" and d["command"] == "sample"
    )
    assert d["policy"] == {"adapter": "a", "version": 2} and len(d["config_hash"]) == 64
    assert d["columns"][1] == {"name": "x", "kind": "tensor", "dtype": "float32", "shape": []}
    assert d["shards"][0]["rows"] == 3 and d["shards"][0]["file"] == "train-00000-of-00002.parquet"

    xs = d["stats"]["x"]
    assert xs["count"] == 4 and xs["nan_count"] == 1 and xs["inf_count"] == 2
    assert xs["min"] == 1.0 and xs["max"] == 4.0 and xs["mean"] == pytest.approx(2.5)
    assert xs["std"] == pytest.approx(math.sqrt(1.25))

    ks = d["stats"]["k"]
    values = [1, 2, 3, 4, 5, 6] + [7, 8] * 4
    mean = sum(values) / len(values)
    assert ks["count"] == 14 and ks["min"] == 1 and ks["max"] == 8 and ks["mean"] == pytest.approx(mean)
    assert ks["std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)))
    assert d["stats"]["flag"]["mean"] == pytest.approx(4 / 7)
    assert "sample_id" not in d["stats"]
    json.dumps(d)


def test_describe_lineage(tmp_path) -> None:
    s = write(tmp_path / "samples", samples(), command="sample")
    r = write(tmp_path / "rewards", rewards(), command="score", parents=[s])
    a = write(tmp_path / "adv", rewards(), command="advantage", parents=[s, r])
    lin = describe(ShardSet(a), stats=False)["lineage"]
    assert [p["path"] for p in lin] == ["../samples", "../rewards"]
    assert all(p["exists"] and p["unchanged"] for p in lin)
    assert lin[1]["command"] == "score" and lin[1]["parents"][0]["path"] == "../samples"
    assert lin[1]["parents"][0]["command"] == "sample"
    assert describe(ShardSet(a), stats=False, lineage_depth=1)["lineage"][1].get("command") is None

    write(s, samples(), command="sample", overwrite=True, policy={"v": 1})
    shutil.rmtree(r)
    lin = describe(ShardSet(a), stats=False)["lineage"]
    assert lin[0]["exists"] and not lin[0]["unchanged"]
    assert lin[1]["exists"] is False


def test_describe_zipped(tmp_path) -> None:
    a = write(tmp_path / "samples", samples())
    b = write(tmp_path / "rewards", rewards(), parents=[a])
    d = describe(open_inputs([a, b]))
    assert [i["path"] for i in d["inputs"]] == [str(a), str(b)]
    assert d["num_rows"] == 7 and [c["name"] for c in d["columns"]] == [
        "sample_id",
        "latents",
        "prompt",
        "reward",
    ]
    assert d["inputs"][1]["stats"]["reward"]["max"] == pytest.approx(1.3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_rows_returns_the_selected_rows_and_skips_shards_without_one(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = open_inputs([write(tmp_path / "s", samples(rows=(3, 4, 2)), fmt)])
    whole = src.read_all(["sample_id", "latents"])
    read: list[int] = []
    original = ShardSet.read_shard
    monkeypatch.setattr(
        ShardSet, "read_shard", lambda self, i, cols=None: read.append(i) or original(self, i, cols)
    )
    got = src.read_rows([1, 2, 7], ["sample_id", "latents"])  # shard 0 rows 1, 2 and shard 2 row 0
    assert got["sample_id"] == [whole["sample_id"][i] for i in (1, 2, 7)] == ["s0-1", "s0-2", "s2-0"]
    assert torch.equal(got["latents"], whole["latents"][[1, 2, 7]])
    assert read == [0, 2]
    assert src.read_rows([], ["latents"])["latents"].shape == (0, 2, 4)
    with pytest.raises(ValueError, match="ascending"):
        src.read_rows([3, 1], ["latents"])
