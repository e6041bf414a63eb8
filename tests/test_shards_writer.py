"""ShardSetWriter: crash safety, resume, re-runs, overwrite, schema checks, several writers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages.errors import UserInputError
from stages.shards import ShardSet, ShardSetWriter, parquet_codec, tar_codec
from stages.shards.manifest import MANIFEST_NAME, manifest_sha256, read_manifest

REPO = Path(__file__).resolve().parents[1]
NUM_SHARDS = 4


def shard_batch(index: int) -> dict:
    """Deterministic trajectory-like rows for shard `index`."""
    g = torch.Generator().manual_seed(index)
    return {
        "sample_id": [f"p{index}-{r}" for r in range(5)],
        "latents": torch.randn(5, 3, 2, 4, 4, generator=g),
        "log_probs": torch.randn(5, 2, generator=g),
        "prompt_meta": [{"target": f"text {index} {r}"} for r in range(5)],
    }


def make_writer(out, fmt: str = "parquet", config: dict | None = None, **kw) -> ShardSetWriter:
    num_shards = kw.pop("num_shards", NUM_SHARDS)
    return ShardSetWriter(
        out, num_shards=num_shards, format=fmt, command="sample", config=config or {"n": 16}, **kw
    )


def write_all(out, fmt: str = "parquet", **kw) -> ShardSetWriter:
    w = make_writer(out, fmt, **kw)
    for i in range(w.num_shards):
        w.write_shard(i, shard_batch(i))
    w.finalize()
    return w


def file_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("train-*"))}


def _crash_child(out: str) -> None:
    """Run in a subprocess: write shards 0 and 1, then die by SIGKILL halfway through shard 2."""
    w = make_writer(out)
    for i in range(2):
        w.write_shard(i, shard_batch(i))

    def dying_encode(batch, columns, sink, index):
        sink.write(b"PAR1" + bytes(1 << 20))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)

    parquet_codec.encode = dying_encode
    w.write_shard(2, shard_batch(2))


def test_sigkill_mid_run_then_resume_is_byte_identical(tmp_path) -> None:
    out = tmp_path / "crashed"
    code = f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; import test_shards_writer as t; t._crash_child({str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    assert not (out / MANIFEST_NAME).exists()
    assert sorted(p.name for p in out.glob("train-*")) == [
        "train-00000-of-00004.parquet",
        "train-00001-of-00004.parquet",
    ]
    leftovers = list(out.glob(".train-00002-of-00004.parquet.tmp-*"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0
    with pytest.raises(UserInputError, match="not a finished output"):
        ShardSet(out)

    w = make_writer(out)
    assert not w.complete
    assert [w.shard_done(i) for i in range(NUM_SHARDS)] == [True, True, False, False]
    for i in range(NUM_SHARDS):
        if not w.shard_done(i):
            w.write_shard(i, shard_batch(i))
    w.finalize()
    assert not list(out.glob(".part-*"))

    clean = tmp_path / "clean"
    write_all(clean)
    assert file_hashes(out) == file_hashes(clean)
    assert [s.to_json() for s in read_manifest(out).shards] == [
        s.to_json() for s in read_manifest(clean).shards
    ]


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_exception_mid_shard_leaves_no_partial_file(tmp_path, monkeypatch, fmt: str) -> None:
    codec = parquet_codec if fmt == "parquet" else tar_codec

    def failing(batch, columns, sink, index):
        sink.write(bytes(1 << 20))
        raise RuntimeError("boom")

    w = make_writer(tmp_path / "out", fmt)
    w.write_shard(0, shard_batch(0))
    monkeypatch.setattr(codec, "encode", failing)
    with pytest.raises(RuntimeError, match="boom"):
        w.write_shard(1, shard_batch(1))
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    ext = "parquet" if fmt == "parquet" else "tar"
    # the lock of the shard it wrote is held while it lives (or until it finalizes)
    assert names == [
        f".lock-train-00000-of-00004.{ext}",
        f".train-00000-of-00004.{ext}.done.json",
        f"train-00000-of-00004.{ext}",
    ]
    assert w.shard_done(0) and not w.shard_done(1)


def test_tampered_completed_shard_is_rewritten_on_resume(tmp_path) -> None:
    out = tmp_path / "out"
    w = make_writer(out)
    for i in range(2):
        w.write_shard(i, shard_batch(i))
    path = w.shard_file(1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    w2 = make_writer(out)
    assert w2.shard_done(0) and not w2.shard_done(1)


def test_shards_of_an_older_layout_are_rewritten_never_mixed(tmp_path) -> None:
    """Completion records and damaged sets from before schema version 2 are not resumed shard by
    shard: the new layout would sit beside the old one in one set."""
    out = tmp_path / "out"
    w = make_writer(out)
    w.write_shard(0, shard_batch(0))
    record = out / ".train-00000-of-00004.parquet.done.json"
    rec = json.loads(record.read_text())
    assert rec["schema_version"] == 2
    del rec["schema_version"]  # as omnirl before version 2 wrote it
    record.write_text(json.dumps(rec))
    assert not make_writer(out).shard_done(0)
    # a finished version-1 set with one damaged shard: every shard is written again on resume
    write_all(tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / MANIFEST_NAME).read_text())
    manifest["schema_version"] = 1
    (tmp_path / "old" / MANIFEST_NAME).write_text(json.dumps(manifest))
    (tmp_path / "old" / "train-00002-of-00004.parquet").write_bytes(b"damaged")
    w = make_writer(tmp_path / "old")
    assert not w.complete and not any(w.shard_done(i) for i in range(NUM_SHARDS))
    assert not (tmp_path / "old" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_rerun_with_same_config_is_complete(tmp_path, fmt: str) -> None:
    first = write_all(tmp_path / "out", fmt).manifest
    w = make_writer(tmp_path / "out", fmt)
    assert w.complete and all(w.shard_done(i) for i in range(NUM_SHARDS))
    assert w.finalize().created == first.created
    with pytest.raises(ValueError, match="already complete"):
        w.write_shard(0, shard_batch(0))


def test_different_config_needs_overwrite(tmp_path) -> None:
    out = tmp_path / "out"
    write_all(out)
    with pytest.raises(UserInputError, match=r"different configuration.*--overwrite.*--out"):
        make_writer(out, config={"n": 8})
    with pytest.raises(UserInputError, match="different format or shard count"):
        make_writer(out, num_shards=2)
    w = write_all(out, config={"n": 8}, num_shards=2, overwrite=True)
    assert sorted(p.name for p in out.glob("train-*")) == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert read_manifest(out).config == {"n": 8} and w.complete
    assert ShardSet(out).num_rows == 10


def test_changed_parent_needs_overwrite(tmp_path) -> None:
    parent = tmp_path / "samples"
    write_all(parent)
    out = tmp_path / "rewards"
    w = write_all(out, parents=[parent])
    entry = read_manifest(out).parents[0]
    assert entry == {"path": "../samples", "manifest_sha256": manifest_sha256(parent)}
    assert w.complete and make_writer(out, parents=[parent]).complete
    write_all(parent, config={"n": 4}, overwrite=True)
    with pytest.raises(UserInputError, match="different inputs"):
        make_writer(out, parents=[parent])


def test_parent_file_and_missing_parent(tmp_path) -> None:
    prompts = tmp_path / "prompts.parquet"
    prompts.write_bytes(b"not really parquet")
    w = write_all(tmp_path / "out", parents=[prompts])
    assert w.manifest.parents == [
        {"path": "../prompts.parquet", "sha256": hashlib.sha256(prompts.read_bytes()).hexdigest()}
    ]
    with pytest.raises(UserInputError, match="does not exist"):
        make_writer(tmp_path / "out2", parents=[tmp_path / "missing"])
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(UserInputError, match="not a finished output"):
        make_writer(tmp_path / "out3", parents=[tmp_path / "unfinished"])


def test_schema_mismatch_across_shards(tmp_path) -> None:
    w = make_writer(tmp_path / "out")
    w.write_shard(0, shard_batch(0))
    bad = shard_batch(1)
    bad["latents"] = bad["latents"].to(torch.float16)
    with pytest.raises(
        UserInputError,
        match=r"'latents' is tensor float32\[3, 2, 4, 4\] in train-00000-of-00004.parquet "
        r"but tensor float16\[3, 2, 4, 4\] in train-00001-of-00004.parquet",
    ):
        w.write_shard(1, bad)
    missing = shard_batch(1)
    del missing["prompt_meta"]
    with pytest.raises(
        UserInputError,
        match=r"'prompt_meta' is json in train-00000-of-00004\.parquet but absent in train-00001",
    ):
        w.write_shard(1, missing)
    assert not w.shard_file(1).exists()


def test_several_writers_then_one_finalize(tmp_path) -> None:
    out = tmp_path / "out"
    ranks = [make_writer(out) for _ in range(2)]
    for i in range(3):
        ranks[i % 2].write_shard(i, shard_batch(i))
    with pytest.raises(
        UserInputError, match=r"1 of 4 shards are not written yet \(train-00003-of-00004.parquet\)"
    ):
        ranks[0].finalize()
    ranks[1].write_shard(3, shard_batch(3))
    m = ranks[0].finalize()
    assert m.num_rows == 20 and [s.file for s in m.shards][-1] == "train-00003-of-00004.parquet"
    assert file_hashes(out) == file_hashes(write_all(tmp_path / "single").out_dir)


def _holding_child(out: str) -> None:
    """Run in a subprocess: write shard 0 of `out`, say so, then wait (holding its writer lock)."""
    make_writer(out).write_shard(0, shard_batch(0))
    print("written", flush=True)
    sys.stdin.read()


def test_a_second_run_onto_one_output_is_refused_naming_the_first_until_it_dies(tmp_path) -> None:
    import socket

    out = tmp_path / "out"
    code = f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; import test_shards_writer as t; t._holding_child({str(out)!r})"
    first = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout.readline() == "written\n"
        second = make_writer(out)
        named = f"pid {first.pid} on {socket.gethostname()} \\(sample {out}\\) is writing this output"
        with pytest.raises(UserInputError, match=rf"{named} \(shard 0\)"):
            second.write_shard(0, shard_batch(0))
        assert second.shard_done(0)  # the first run's shard was left as it was
        with pytest.raises(UserInputError, match=rf"3 of 4 shards are not written yet .*; {named}"):
            second.finalize()
        for i in (1, 2):  # other shards of the output: as the tasks of a Slurm array, both write
            second.write_shard(i, shard_batch(i))
    finally:
        first.kill()  # SIGKILL: no clean-up runs, its lock file stays
        first.wait()
    assert (out / ".lock-train-00000-of-00004.parquet").exists()
    second.write_shard(0, shard_batch(0))  # the dead run's lock is taken over
    second.write_shard(3, shard_batch(3))
    second.finalize()
    assert not list(out.glob(".lock-*"))
    assert file_hashes(out) == file_hashes(write_all(tmp_path / "single").out_dir)


def test_finalize_detects_schema_mismatch_between_ranks(tmp_path) -> None:
    out = tmp_path / "out"
    a, b = make_writer(out), make_writer(out)
    for i in range(3):
        a.write_shard(i, shard_batch(i))
    bad = shard_batch(3)
    bad["log_probs"] = bad["log_probs"].double()
    b.write_shard(3, bad)
    with pytest.raises(
        UserInputError,
        match=r"'log_probs' is tensor float32.*train-00000-of-00004\.parquet.*float64.*train-00003",
    ):
        a.finalize()
    assert not (out / MANIFEST_NAME).exists()


def test_bad_arguments(tmp_path) -> None:
    with pytest.raises(UserInputError, match="unknown shard format"):
        make_writer(tmp_path / "a", "csv")
    with pytest.raises(UserInputError, match="--num-shards"):
        make_writer(tmp_path / "a", num_shards=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match="is a file"):
        make_writer(tmp_path / "file")
    w = make_writer(tmp_path / "a")
    with pytest.raises(UserInputError, match=r"outside 0\.\.3"):
        w.write_shard(4, shard_batch(0))


def test_completion_record_is_hidden_and_removed(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00007-of-00009.parquet").write_bytes(b"left over from an unfinished run")
    (out / ".train-00001-of-00004.parquet.tmp-1-abc").write_bytes(b"crash leftover")
    (out / "notes.txt").write_text("user file")
    w = make_writer(out)
    info = w.write_shard(0, shard_batch(0))
    rec = json.loads((tmp_path / "out" / ".train-00000-of-00004.parquet.done.json").read_text())
    assert rec["sha256"] == info.sha256 and rec["rows"] == 5 and rec["config_hash"] == w.config_hash
    assert {c["name"] for c in rec["columns"]} == {"sample_id", "latents", "log_probs", "prompt_meta"}
    for i in range(1, NUM_SHARDS):
        w.write_shard(i, shard_batch(i))
    w.finalize()
    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST_NAME,
        "notes.txt",
        *[f"train-0000{i}-of-00004.parquet" for i in range(NUM_SHARDS)],
    ]


def test_corrupt_manifest_in_out_dir(tmp_path) -> None:
    out = tmp_path / "out"
    write_all(out)
    (out / MANIFEST_NAME).write_text('{"format": "parquet", "shards": [')
    with pytest.raises(UserInputError, match="corrupt"):
        make_writer(out)
    w = write_all(out, overwrite=True)
    assert ShardSet(out / MANIFEST_NAME).num_rows == 20 and w.complete
