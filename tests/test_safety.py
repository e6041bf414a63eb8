"""What no command may do: write over its inputs or data it did not write, leave half-written output
looking complete, call stale output finished, or end a user's mistake in a traceback (issue 10)."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PROMPTS, fails, run, sample_args, staged_update_args

from stages.shards.atomic import recover_dir, replace_dir
from stages.shards.manifest import MANIFEST_NAME
from stages.shards.reader import ShardSet


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path → bytes)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# ----------------------------------------------------------------------------- update --out (item 1)


def test_update_refuses_an_out_that_is_not_an_adapter(staged: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "it0"
    (run_dir / "samples").mkdir(parents=True)
    (run_dir / "samples" / "keep.txt").write_text("user data")
    line = fails(staged_update_args(staged, run_dir))
    assert "non-empty directory without an adapter" in line
    assert (run_dir / "samples" / "keep.txt").read_text() == "user data"


@pytest.mark.parametrize("which", ["samples", "advantages"])
def test_update_refuses_an_out_that_is_an_input(staged: dict[str, Path], which: str) -> None:
    before = snapshot(staged[which])
    line = fails(staged_update_args(staged, staged[which], "--overwrite"))
    assert "is the input" in line and "no command writes over its own inputs" in line
    assert snapshot(staged[which]) == before


def test_update_refuses_an_out_that_contains_an_input(staged: dict[str, Path]) -> None:
    before = snapshot(staged["samples"])
    line = fails(staged_update_args(staged, staged["samples"].parent, "--overwrite"))
    assert "contains the input" in line
    assert snapshot(staged["samples"]) == before


def test_update_refuses_to_write_over_its_adapter(staged: dict[str, Path]) -> None:
    before = snapshot(staged["policy1"])
    line = fails(
        staged_update_args(staged, staged["policy1"], "--adapter", str(staged["policy1"]), "--overwrite")
    )
    assert "is the input" in line
    assert snapshot(staged["policy1"]) == before


def test_update_cwd_out_is_refused(staged: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert "current directory" in fails(staged_update_args(staged, Path(".")))  # even when empty
    Path("notes.md").write_text("mine")
    assert "current directory" in fails(staged_update_args(staged, Path(".")))
    assert Path("notes.md").read_text() == "mine"


# ------------------------------------------------- adapter replacement: atomic, no litter, stable bytes (3)


def test_identical_updates_write_identical_adapter_bytes(staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "policy"
    run(*staged_update_args(staged, out))
    first = snapshot(out)
    shutil.rmtree(out)
    run(*staged_update_args(staged, out))
    second = snapshot(out)
    first.pop("metrics.jsonl"), second.pop("metrics.jsonl")  # holds wall-clock throughput
    assert sorted(first) == sorted(second) and any(k.endswith(".safetensors") for k in first)
    assert first == second


def test_replacing_an_adapter_leaves_no_litter_and_cleans_a_killed_save(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "policy"
    run(*staged_update_args(staged, out))
    first = snapshot(out)
    # what a SIGKILL during the next save leaves behind: a half-written hidden sibling
    killed = tmp_path / ".policy.tmp-999999-deadbeef"
    (killed / "trainer_state").mkdir(parents=True)
    (killed / "pytorch_lora_weights.safetensors").write_bytes(b"half")
    run(*staged_update_args(staged, out, "--lr", "1e-3", "--overwrite"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    assert snapshot(out) != first


def test_replace_dir_swaps_and_recover_restores_the_previous_directory(tmp_path: Path) -> None:
    out, new = tmp_path / "policy", tmp_path / ".policy.tmp-1-x"
    out.mkdir()
    (out / "w").write_text("old")
    new.mkdir()
    (new / "w").write_text("new")
    replace_dir(new, out)
    assert (out / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    # a kill between the fallback's two renames: the old adapter aside, nothing at `out`
    aside = tmp_path / ".policy.old-1-y"
    os.replace(out, aside)
    (tmp_path / ".policy.tmp-2-z").mkdir()
    recover_dir(out)
    assert (out / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


# ----------------------------------------------------------------------------- score over its input (2)


def test_score_refuses_to_write_over_its_input(staged: dict[str, Path]) -> None:
    before = snapshot(staged["samples"])
    line = fails(["score", "--in", str(staged["samples"]), "--reward", "jpeg_compressibility", "--overwrite",
        "--out", str(staged["samples"])])  # fmt: skip
    assert "is the input" in line
    assert snapshot(staged["samples"]) == before


# ---------------------------------------------------------------- run identity: content, not the split


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def test_slurm_array_tasks_complete_one_shard_set(tiny_sd3: Path, prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "samples"
    first = run(*sample_args(tiny_sd3, prompts, out, "--num-shards", "2", "--shard-index", "0"))
    assert not first["complete"] and first["rows_written"] == first["rows"] > 0
    # a finalising run makes only the missing shard and says so (3 prompts × 2 rows in all)
    result = run(*sample_args(tiny_sd3, prompts, out, "--num-shards", "2"))
    assert result["complete"] and (out / MANIFEST_NAME).is_file()
    assert (result["rows"], result["rows_written"]) == (6, 6 - first["rows"])
    before = snapshot(out)
    assert run(*sample_args(tiny_sd3, prompts, out, "--num-shards", "2"))["skipped"]
    assert snapshot(out) == before


def test_a_finished_logprob_or_score_says_it_was_already_complete(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    from helpers import runner

    from omnirl_cli.app import app

    commands = {
        "logprob": ["logprob", "--model", str(staged["model"]), "--in", str(staged["samples"])],
        "score": ["score", "--in", str(staged["samples"]), "--reward", "jpeg_compressibility"],
    }
    for name, args in commands.items():
        out = tmp_path / name
        first = run(*args, "--out", str(out))
        before = snapshot(out)
        again = run(*args, "--out", str(out))
        assert (first["skipped"], again["skipped"]) == (False, True), name
        # the finished output's own numbers, as the run that wrote it reported them; it loaded nothing
        assert again.get("loaded_components", []) == []
        loading = ("skipped", "loaded_components", "conditioning")
        assert {k: v for k, v in again.items() if k not in loading} == {
            k: v for k, v in first.items() if k not in loading and not k.startswith("perf/")
        }
        said = runner.invoke(app, [*args, "--out", str(out)])
        assert said.exit_code == 0, said.output
        assert said.stderr.split() == f"{out} is already complete; nothing to do".split(), said.stderr
        assert snapshot(out) == before


def test_a_second_sample_onto_one_out_names_the_first_and_resumes_once_it_is_killed(
    tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "samples"
    out.mkdir()
    lock = out / ".lock-train-00000-of-00001.parquet"  # what a running `sample` of that --out holds
    code = (
        "import sys; from pathlib import Path; from stages.shards.atomic import hold_lock; "
        f"hold_lock(Path({str(lock)!r}), 'sample'); print('held', flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert first.stdout.readline() == "held\n"
        fails(sample_args(tiny_sd3, prompts, out, "--num-shards", "1"), f"pid {first.pid} on", "is writing")
        assert not list(out.glob("train-*")) and not (out / MANIFEST_NAME).exists()
    finally:
        first.kill()  # kill -9: its lock file stays, and never blocks the resume
        first.wait()
    assert run(*sample_args(tiny_sd3, prompts, out, "--num-shards", "1"))["complete"]
    assert not lock.exists()


def test_an_edited_prompt_file_is_not_resumed_into_the_old_set(
    tiny_sd3: Path, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "samples"
    run(*sample_args(tiny_sd3, prompts, out, "--num-shards", "3", "--shard-index", "0"))  # then a crash
    prompts.write_text("a green frog\na purple cat\na yellow dog\n")
    run(*sample_args(tiny_sd3, prompts, out, "--num-shards", "3"))
    assert ShardSet(out).read_all(["prompt"])["prompt"] == [
        p for p in ("a green frog", "a purple cat", "a yellow dog") for _ in range(2)
    ]
    prompts.write_text("a white horse\na black bird\na grey cloud\n")
    assert "different inputs" in fails([*sample_args(tiny_sd3, prompts, out, "--num-shards", "3")])


def test_changed_adapter_weights_change_the_identity(staged: dict[str, Path], tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(staged["policy1"], adapter)
    out = tmp_path / "samples"
    args = sample_args(staged["model"], staged["prompts"], out, "--adapter", str(adapter))
    run(*args)
    assert run(*args)["skipped"]
    weights = next(adapter.glob("*.safetensors"))
    shutil.copyfile(next(staged["policy2"].glob("*.safetensors")), weights)  # same config, new weights
    assert "different configuration" in fails([*args])


def test_an_edited_reward_plugin_makes_score_redo(staged: dict[str, Path], tmp_path: Path) -> None:
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def score(images, prompts, meta):\n    return [1.0 for _ in images]\n")
    out = tmp_path / "rewards"
    args = ["score", "--in", str(staged["samples"]), "--reward", f"{plugin}:score", "--out", str(out)]
    run(*args)
    assert run(*args)["rows"] == 6
    plugin.write_text("def score(images, prompts, meta):\n    return [2.0 for _ in images]\n")
    assert "different inputs" in fails([*args])
    run(*args, "--overwrite")
    recorded = [p["sha256"] for p in ShardSet(out).manifest.parents if "sha256" in p]
    assert recorded == [hashlib.sha256(plugin.read_bytes()).hexdigest()]


# ----------------------------------------------------------------------------- corrupt shard advice (13)


def test_the_advice_for_a_corrupt_shard_repairs_it(tiny_sd3: Path, prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "samples"
    args = sample_args(tiny_sd3, prompts, out, "--num-shards", "3")
    run(*args)
    good = snapshot(out)
    damaged = sorted(out.glob("train-*"))[1]
    blob = bytearray(damaged.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    damaged.write_bytes(bytes(blob))
    kept = sorted(out.glob("train-*"))[0].stat().st_mtime_ns
    line = fails(
        ["score", "--in", str(out), "--reward", "jpeg_compressibility", "--out", str(tmp_path / "r")]
    )
    assert (
        str(damaged) in line
        and "re-run the command that produced it (omnirl sample) with the same options" in line
    )
    assert not (tmp_path / "r" / MANIFEST_NAME).exists()  # shard 0 is kept for the resume, unlisted
    run(*args)  # the advice
    assert snapshot(out).keys() == good.keys()
    assert {k: v for k, v in snapshot(out).items() if k != MANIFEST_NAME} == {
        k: v for k, v in good.items() if k != MANIFEST_NAME
    }
    assert sorted(out.glob("train-*"))[0].stat().st_mtime_ns == kept  # the intact shards were kept
    run("score", "--in", str(out), "--reward", "jpeg_compressibility", "--out", str(tmp_path / "r"))


# ----------------------------------------------------------------------------- shards by rows (14)


def test_default_shards_hold_about_shard_rows_rows(tiny_sd3: Path, prompts: Path, tmp_path: Path) -> None:
    assert ShardSet(run(*sample_args(tiny_sd3, prompts, tmp_path / "a"))["out"]).num_shards == 1
    small = ShardSet(run(*sample_args(tiny_sd3, prompts, tmp_path / "b", "--shard-rows", "2"))["out"])
    assert small.num_shards == 3 and [s.rows for s in small.manifest.shards] == [2, 2, 2]
    # shards hold whole groups: 6 rows at 4 per shard → 2 shards (1 and 2 groups of 2)
    assert (
        ShardSet(run(*sample_args(tiny_sd3, prompts, tmp_path / "c", "--shard-rows", "4"))["out"]).num_shards
        == 2
    )


# ----------------------------------------------------------------------------- non-finite options (11)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_options_are_refused(tiny_sd3: Path, prompts: Path, tmp_path: Path, value: str) -> None:
    out = tmp_path / "s"
    assert (
        fails([*sample_args(tiny_sd3, prompts, out), "--guidance", value])
        == f"error: --guidance {float(value)}: must be a finite number"
    )
    assert "--noise-level" in fails(
        [*sample_args(tiny_sd3, prompts, out), "--set", f"noise_level=.{value.strip('-')}"]
    )
    assert not out.exists()


# ----------------------------------------------------------------------------- outputs in the way (21, 22)


def test_out_that_is_a_file_or_a_dangling_symlink(staged: dict[str, Path], tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "gone")
    base = ["score", "--in", str(staged["samples"]), "--reward", "jpeg_compressibility", "--out"]
    assert "is a file" in fails([*base, str(afile)])
    assert "dangling symlink" in fails([*base, str(dangling)])
    assert afile.read_text() == "x" and dangling.is_symlink()
    assert "is a file" in fails(staged_update_args(staged, afile))


def test_unwritable_out_is_one_line(staged: dict[str, Path]) -> None:
    line = fails(
        [
            "score",
            "--in",
            str(staged["samples"]),
            "--reward",
            "jpeg_compressibility",
            "--out",
            "/sys/omnirl-out",
        ]
    )
    assert "/sys/omnirl-out" in line


def test_failing_score_leaves_no_out_directory(staged: dict[str, Path], tmp_path: Path) -> None:
    plugin = tmp_path / "nan_reward.py"
    plugin.write_text("def score(images, prompts, meta):\n    return [float('nan') for _ in images]\n")
    out = tmp_path / "rewards"
    fails(["score", "--in", str(staged["samples"]), "--reward", f"{plugin}:score", "--out", str(out)])
    assert not out.exists()


def test_a_plugin_calling_sys_exit_does_not_set_the_exit_code(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    plugin = tmp_path / "quitter.py"
    plugin.write_text("import sys\n\ndef score(images, prompts, meta):\n    sys.exit(0)\n")
    line = fails(
        ["score", "--in", str(staged["samples"]), "--reward", f"{plugin}:score", "--out", str(tmp_path / "r")]
    )
    assert "sys.exit(0)" in line


def test_usage_errors_are_one_line() -> None:
    assert fails(["sample", "--no-such-flag"]).startswith("error: No such option: --no-such-flag")
    assert "'--group-size' / '-n'" in fails(["sample", "-n", "many"])
    assert "No such command 'sampel'" in fails(["sampel"])


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "logprobs"
    result = subprocess.run(
        [sys.executable, "-m", "omnirl_cli", "score", "--in", str(staged["samples"]), "--reward",
         "jpeg_compressibility", "--out", str(out)],
        capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "size limit" in result.stderr
    assert not (out / MANIFEST_NAME).exists()
    assert not out.exists() or not [p.name for p in out.iterdir() if ".tmp-" in p.name]


def test_stages_dispatch_on_the_recorded_modality_not_on_columns(tmp_path: Path) -> None:
    """A set with image-like columns but no recorded rollout modality is refused in one line: stages
    never guess the rollout kind from the columns present."""
    import torch

    from stages.shards.writer import ShardSetWriter

    out = tmp_path / "samples"
    writer = ShardSetWriter(out, num_shards=1, command="sample", config={}, kinds={"prompt_meta": "json"})
    writer.write_shard(
        0,
        {
            "sample_id": ["a", "b"],
            "group_id": ["g", "g"],
            "prompt": ["x", "x"],
            "prompt_meta": [{}, {}],
            "image": [b"", b""],
            "reward": torch.zeros(2),
        },
    )
    writer.finalize()
    fails(
        ["score", "--in", str(out), "--reward", "jpeg_compressibility", "--out", str(tmp_path / "r")],
        "modality",
    )
