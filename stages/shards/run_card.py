"""A run folder as a Hugging Face dataset: its dataset card, RUN/README.md.

A run folder holds the shard sets of each iteration K at `it<K>/<kind>` (samples, rewards, logprobs,
advantages, ...) and those of its held-out evaluation at `it<K>/eval/<kind>`. The kinds have different
columns, so `datasets` cannot read the folder as one table. The card's YAML front matter names one config
per kind (`eval_<kind>` for the evaluation's) with one split per iteration (`it<K>`) whose data files are
that set's shards, so `load_dataset(RUN, "samples", split="it0")` reads a local run and the Hub's dataset
viewer reads a run uploaded with `huggingface_hub.upload_folder`.

Every shard set written into a run folder rewrites the card once its manifest exists
(`ShardSetWriter.finalize`), so it lists complete sets only, whichever driver ran the stage (make,
Snakemake, Slurm, a hand-typed command, `omnirl online`). A README.md without `MARKER` is the user's and
is never touched. Stages finishing at once (make -j) may each write the card; each one re-reads the
folder after writing and writes again until the card it wrote is the folder's, so the last one standing
leaves a complete card, without a lock file.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.shards.atomic import atomic_write_bytes
from stages.shards.manifest import MANIFEST_NAME, read_manifest

logger = logging.getLogger(__name__)

ITER_DIR = re.compile(r"^it(\d+)$")  # RUN/it<K>: iteration K's shard sets and policy
EVAL_DIR = "eval"  # RUN/it<K>/eval/{samples,rewards}: the held-out evaluation of iteration K's policy
CARD_NAME = "README.md"
MARKER = "<!-- omnirl run card: rewritten as the run grows; delete this line to keep your edits -->"
KIND_ORDER = ("samples", "rewards", "logprobs", "advantages")  # the stages' order; other kinds follow
_SHARD_INDEX = re.compile(r"-\d+-of-")


def run_folder(out_dir: Path) -> Path | None:
    """The run folder a shard set at `out_dir` belongs to (RUN for RUN/it<K>/<kind> and
    RUN/it<K>/eval/<kind>), or None when it is not in a run folder's layout."""
    path = Path(os.path.abspath(out_dir))
    if ITER_DIR.match(path.parent.name):
        return path.parent.parent
    if path.parent.name == EVAL_DIR and ITER_DIR.match(path.parent.parent.name):
        return path.parent.parent.parent
    return None


def card_configs(run: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The card's `configs` and the kinds it leaves out. Per kind of complete shard set, one split per
    iteration holding it, each split's `path` a glob of exactly the shards its manifest lists
    (`train-*-of-00004.parquet`). `datasets` reads every config of a folder or repo with the one builder
    its first config's files call for, so only the sets in that config's format are listed; the kinds
    with sets in another format (--format webdataset beside Parquet) are left out, by name."""
    splits: dict[str, list[tuple[int, str, str]]] = {}  # kind → (iteration, shard glob, format)
    for manifest in [*run.glob(f"it*/*/{MANIFEST_NAME}"), *run.glob(f"it*/{EVAL_DIR}/*/{MANIFEST_NAME}")]:
        shard_set = manifest.parent
        rel = shard_set.relative_to(run).parts
        found = ITER_DIR.match(rel[0])
        if found is None or (len(rel) == 2 and rel[1] == EVAL_DIR):
            continue
        try:
            read = read_manifest(shard_set)
        except (UserInputError, OSError):  # being rewritten (--overwrite) or damaged: not a complete set
            continue
        if not read.shards:
            continue
        name = rel[-1] if len(rel) == 2 else f"{EVAL_DIR}_{rel[-1]}"
        pattern = _SHARD_INDEX.sub("-*-of-", read.shards[0].file, count=1)
        splits.setdefault(name, []).append((int(found.group(1)), "/".join((*rel, pattern)), read.format))

    def order(name: str) -> tuple[bool, int, str]:
        kind = name.removeprefix(f"{EVAL_DIR}_")
        return name != kind, KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER), kind

    configs: list[dict[str, Any]] = []
    left_out = []
    listed = None  # the format of the listed sets: the first kind's in order that has one
    for name in sorted(splits, key=order):
        sets = sorted(splits[name])
        formats = {fmt for *_, fmt in sets}
        if listed is None and len(formats) == 1:
            listed = next(iter(formats))
        if formats != {listed}:
            left_out.append(name)
            continue
        files = [{"split": f"it{k}", "path": path} for k, path, _ in sets]
        configs.append(
            {"config_name": name, "data_files": files, **({"default": True} if not configs else {})}
        )
    return configs, left_out


def render_card(run: Path) -> str:
    """RUN/README.md's text: the YAML front matter (`card_configs`), `MARKER` and how to load it."""
    import yaml

    configs, left_out = card_configs(run)
    names = ", ".join(c["config_name"] for c in configs)
    front = yaml.safe_dump({"configs": configs}, sort_keys=False, allow_unicode=True)
    other = (
        f" Not listed: {', '.join(left_out)}, in another shard format than these (`datasets` reads one "
        "format per folder or repo; load such a set from its own folder)."
        if left_out
        else ""
    )
    example = ""
    if configs:
        name, split = configs[0]["config_name"], configs[0]["data_files"][0]["split"]
        example = (
            "```python\nfrom datasets import load_dataset\n\n"
            f'data = load_dataset("{run.name}", "{name}", split="{split}")  # the folder, or its Hub repo id\n'
            "```\n\n"
        )
    return (
        f"---\n{front}---\n{MARKER}\n\n# {run.name}\n\n"
        "An omnirl run: one config per kind of shard set, one split per iteration (`it<K>`), the held-out "
        f"evaluation's sets as `eval_<kind>`. Configs: {names}.{other}\n\n{example}"
        "Each set's `_manifest.json` holds its producing command, configuration, lineage and column shapes.\n"
    )


def update_card(out_dir: Path) -> Path | None:
    """Rewrite the dataset card of the run folder holding the finished shard set `out_dir`; returns its
    path, or None when `out_dir` is in no run folder or the folder's README.md is the user's."""
    run = run_folder(out_dir)
    if run is None:
        return None
    card = run / CARD_NAME
    while True:
        if card.is_file() and MARKER not in card.read_text(encoding="utf-8", errors="replace"):
            logger.info("%s is not omnirl's dataset card; left as it is", card)
            return None
        text = render_card(run)
        atomic_write_bytes(card, text.encode())
        if render_card(run) == text:  # no other set finished meanwhile: the card is the folder's
            return card
