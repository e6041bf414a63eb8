"""The edit demo, cheaply: the committed pretrained edit model (recipes/models/demo-edit) edits held-out
shape edits part of the time, as `make demo-edit-model` builds it; `make -n demo-edit` plans the staged
recipe on it with the held-out evaluation, and pretrains nothing."""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "recipes" / "models" / "demo-edit"
CONFIG = ROOT / "recipes" / "configs" / "demo_edit.yaml"


def plan(target: str, *variables: str) -> list[str]:
    """The commands `make -n TARGET VARIABLES` prints, one a line (continued lines joined)."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-o", "install", target, *variables],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return out.replace("\\\n", " ").splitlines()


def test_committed_edit_model_edits_part_of_the_time(tmp_path: Path) -> None:
    edits = tmp_path / "heldout" / "edits.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "recipes/tasks/shape_edits.py"), "--kinds", "recolor", "--shapes", "circle",
         "--out", str(edits), "--num-prompts", "16", "--seed", "2"],
        check=True, capture_output=True,
    )  # fmt: skip
    run("sample", "--config", str(CONFIG), "--model", str(MODEL), "--prompts", str(edits), "--seed", "0",
        "--sampler", "ode", "--group-size", "4", "--num-prompts", "16", "--out", str(tmp_path / "samples"))  # fmt: skip
    scores = run("score", "--in", str(tmp_path / "samples"), "--reward", "geneval_shapes_strict",
                 "--reward", "edit_preservation=0", "--out", str(tmp_path / "rewards"))  # fmt: skip
    # the RL start point edits sometimes, not always (20.3% of these 64; 17.2% of the demo's 256 held-out
    # results), and keeps the rest of the source (0.965 here; 0.933 after 50 pretraining steps)
    strict = scores["reward.geneval_shapes_strict/mean"]
    assert 0.1 <= strict <= 0.4, strict
    assert strict * 64 == round(strict * 64)  # a share of 0/1 successes
    assert scores["reward.edit_preservation/mean"] > 0.95, scores


def test_make_demo_edit_model_builds_what_is_committed(tmp_path: Path) -> None:
    commands = plan("demo-edit-model", f"EDIT_MODEL_RUN={tmp_path}")
    pretrain = next(shlex.split(c) for c in commands if " pretrain " in c)
    flag = {a: b for a, b in itertools.pairwise(pretrain) if a.startswith("--")}
    card = json.loads((MODEL / "omnirl_model.json").read_text())
    made = card["details"]["pretrain"]
    assert card["family"] == "flux_kontext" and card["size"] == "tiny" and made["previous"] is None
    assert made["data"]["rows"] == 2048
    for name in ("steps", "vae_steps", "vae_encoder_steps", "text_length", "seed"):
        value = made["config"][name]
        assert float(flag["--" + name.replace("_", "-")]) == value, name
    assert f"diff -r {tmp_path}/model recipes/models/demo-edit " in "\n".join(commands)


def test_make_demo_edit_plans_rl_on_the_committed_model(tmp_path: Path) -> None:
    commands = plan("demo-edit", f"EDIT_RUN={tmp_path / 'run'}", "EDIT_ITERATIONS=2")
    assert not any(" pretrain " in c or " init-model " in c for c in commands)
    updates = [c for c in commands if " update " in c]
    assert len(updates) == 2 and all("--model recipes/models/demo-edit " in c for c in updates)
    assert all("demo_edit.yaml" in c for c in updates)
    evals = [c for c in commands if " sample " in c and "/eval/samples" in c]
    assert len(evals) == 3 and all("heldout/edits.jsonl" in c and "--sampler ode" in c for c in evals)
    assert any(c.strip().startswith(".venv/bin/omnirl report") for c in commands)
