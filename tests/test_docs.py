"""The documentation: README's quickstart runs verbatim, links resolve, the CLI reference is current."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CLI = ROOT / "docs" / "cli.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def quickstart() -> str:
    """The fenced bash block between README's `<!-- quickstart -->` markers."""
    found = re.search(
        r"<!-- quickstart -->\n```bash\n(.*?)```\n<!-- /quickstart -->", README.read_text(), re.S
    )
    assert found, "README.md has no <!-- quickstart --> block"
    return found.group(1)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids of a markdown page (lower case, punctuation dropped, spaces as hyphens;
    a repeated heading gets -1, -2, ...), headings inside fenced code left out."""
    seen: dict[str, int] = {}
    ids: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.*)", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def test_readme_is_small_and_opens_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 10 * 1024
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_every_preset_is_listed() -> None:
    """Each preset is a row of README's table or, README being at its size limit, named in the presets
    column of docs/families.md's family table; neither names one that does not exist."""
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", README.read_text(), re.M))
    family_rows = [line.split("|") for line in (ROOT / "docs" / "families.md").read_text().splitlines()]
    named = {n for cells in family_rows if len(cells) == 8 for n in re.findall(r"`([a-z0-9_]+)`", cells[5])}
    presets = {p.stem for p in (ROOT / "recipes" / "configs").glob("*.yaml")}
    assert presets and rows <= presets and named <= presets
    assert rows | named == presets


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_cli_reference_is_generated_from_the_current_help() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_cli.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    text = (ROOT / "docs" / "cli.md").read_text()
    from omnirl_cli.commands import COMMANDS

    assert [m for m in re.findall(r"^## omnirl (\S+)$", text, re.M)] == [n for n, _ in COMMANDS]
    assert "--resolution" in text.split("## omnirl sample\n")[1].split("## omnirl score\n")[0]


def test_documented_options_exist() -> None:
    """Every `--option` written after `omnirl COMMAND` in README.md and docs/ is one of that command's
    options, as its --help (docs/cli.md) lists them."""
    help_of = dict(re.findall(r"^## omnirl (\S+)\n(.*?)(?=^## omnirl |\Z)", CLI.read_text(), re.S | re.M))
    names = "|".join(sorted(help_of, key=len, reverse=True))
    unknown = []
    for page in PAGES:
        if page == CLI:
            continue
        text = page.read_text().replace("\\\n", " ")
        for cmd, rest in re.findall(rf"omnirl ({names})(?![-\w])([^\n`|&;]*)", text):
            unknown += [
                f"{page.name}: omnirl {cmd} {o}"
                for o in re.findall(r"--[a-z0-9][\w-]*", rest)
                if o not in help_of[cmd]
            ]
    assert unknown == []


@pytest.mark.slow
def test_readme_quickstart_runs_verbatim(tmp_path: Path) -> None:
    """The quickstart block, as written, in an empty folder: a tiny model, one Flow-GRPO iteration, a report."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", quickstart()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    samples = json.loads((tmp_path / "run/it0/samples/_manifest.json").read_text())
    assert samples["num_rows"] == 8  # 2 prompts × -n 4
    rewards = json.loads((tmp_path / "run/it0/rewards/_manifest.json").read_text())
    assert rewards["num_rows"] == 8
    adapter = json.loads((tmp_path / "run/it1/policy/omnirl_adapter.json").read_text())
    assert adapter["step"] == 1
    assert (tmp_path / "run/it1/policy/pytorch_lora_weights.safetensors").stat().st_size > 0
    assert (tmp_path / "run/reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the replay reproduces the rollout (what the README says to expect)
    replay = json.loads((tmp_path / "run/it0/logprobs/_manifest.json").read_text())["extra"]
    assert (replay["rows_replayed"], replay["abs_delta_max"]) == (8, 0.0)
