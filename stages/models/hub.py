"""Where weights live: a local path, or a Hub id that the local Hugging Face cache holds.

`--model`, `--adapter` and reward checkpoints accept `org/name` or `org/name@revision` (a branch, tag or
commit). Nothing is downloaded: the id is looked up offline in the hub cache (`HF_HOME` /
`HF_HUB_CACHE`) by huggingface_hub's own `snapshot_download(local_files_only=True)`, and the snapshot
folder it names (`models--org--name/snapshots/<commit>/`) is what loads and what a run's content
digest hashes. A path that exists always wins over an id of the same spelling, and a value spelled as
a path (`spelled_as_path`: ./x, ../x, /x, ~/x, or under an existing local folder) is never an id: a
missing one is "no such folder/file".
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from stages.errors import UserInputError

REPO_FOLDER = "models--"
SNAPSHOTS = "snapshots"


def spelled_as_path(text: str | Path) -> bool:
    """Whether `text` can only mean a local path: it exists, starts with ./, ../, / or ~ (as the user
    typed it: pass the raw string, `Path` drops a leading ./), or its first component is an existing
    local folder (`models/sd3-tin` beside models/), so a typo is never looked up as a Hub id."""
    text = str(text)
    if text.startswith(("./", "../", "~")) or os.path.isabs(text) or text in (".", ".."):
        return True
    path = Path(text).expanduser()
    return path.exists() or (len(path.parts) > 1 and Path(path.parts[0]).is_dir())


def no_such_path(option: str, text: str | Path, hint: str = "") -> UserInputError:
    """The one-line error for a missing local path `text` given to `option`, naming the closest entry
    of its folder when there is one (`models/sd3-tiny` for `models/sd3-tin`); `hint` is added."""
    path = Path(text).expanduser()
    folder = path.parent
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    close = difflib.get_close_matches(path.name, names, n=1)
    nearby = f"; did you mean {folder / close[0]}?" if close else ""
    return UserInputError(f"{option} {text}: no such folder/file{nearby}{hint}")


def split_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of an `org/name[@revision]` spelling; None when `text` is not one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo, at, revision = str(text).partition("@")
    if (at and not revision) or repo.count("/") != 1 or repo.startswith((".", "~")):
        return None
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, revision or None


def cached_snapshot(repo: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo` at `revision` (default: the cached `main`) in the local hub cache,
    or None when the cache does not hold it. Offline: never opens a connection."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except (OSError, ValueError):  # LocalEntryNotFoundError is a FileNotFoundError
        return None


def download_hint(repo: str, revision: str | None) -> str:
    """The command that puts `repo` (at `revision`) into the local cache."""
    return f"`hf download {repo}" + (f" --revision {revision}`" if revision else "`")


def locate(value: str | Path, option: str) -> Path:
    """The folder (or file) `value` (as typed) names: itself when it exists, else the cached snapshot of
    the Hub id it spells. A missing path (`spelled_as_path`), or a Hub id the cache does not hold, is a
    one-line `UserInputError` (the latter saying how to fetch it); a missing bare name is returned for
    the loader to report. `option` names it (--model)."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    if spelled_as_path(value):
        raise no_such_path(option, value)
    hub = split_hub_id(str(value))
    if hub is None:  # a bare name (`sd3-tiny`): the loader says what is missing
        return path
    snapshot = cached_snapshot(*hub)
    if snapshot is None:
        from huggingface_hub import constants

        raise UserInputError(
            f"{option} {value}: no such folder/file, and the Hub id is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); fetch it with {download_hint(*hub)} (omnirl never downloads) or "
            "pass a local folder"
        )
    return snapshot


def hub_origin(path: str | Path) -> dict[str, str] | None:
    """{"id": "org/name", "revision": commit} when `path` is a snapshot folder of the hub cache layout
    (`.../models--org--name/snapshots/<commit>`), else None."""
    folder = Path(os.path.abspath(path))
    repo = folder.parent.parent.name
    if folder.parent.name != SNAPSHOTS or not repo.startswith(REPO_FOLDER):
        return None
    return {"id": repo[len(REPO_FOLDER) :].replace("--", "/", 1), "revision": folder.name}


def base_model_record(path: str | Path) -> dict[str, str]:
    """How an adapter names its base model: the absolute folder (`base_model`), plus the Hub id and
    revision (`base_model_id`, `base_model_revision`) when the folder is a hub-cache snapshot."""
    record = {"base_model": os.path.abspath(path)}
    origin = hub_origin(path)
    if origin:
        record.update(base_model_id=origin["id"], base_model_revision=origin["revision"])
    return record
