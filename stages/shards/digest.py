"""Content identity of the files and folders a run reads: the sha256 of their bytes.

A run's identity must change when a model's weights, an adapter, a prompt file or a plugin's source
change, or a re-run would call stale output complete. Hashing a 40 GB pipeline folder takes tens of
seconds, so each file's digest is cached by (path, size, mtime, inode), as git's index does: a file
is read again only when one of those changed. The cache is a JSON file under
`$XDG_CACHE_HOME/omnirl` (default `~/.cache/omnirl`); an unwritable cache only costs the re-hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from stages.errors import UserInputError
from stages.shards.atomic import atomic_write_bytes, sha256_file

CACHE_FILE = "digests.json"
_CACHE_LIMIT = 50_000


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "omnirl" / CACHE_FILE


def _load_cache(path: Path) -> dict[str, list]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _files(root: Path) -> list[Path]:
    """Every regular file under `root` (symlinks followed), hidden entries skipped, in sorted order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return found


def content_digest(path: str | Path, what: str) -> str:
    """Hex sha256 naming the bytes of a file, or of every file in a folder with its relative path.

    `what` names the option in the error for a missing path (e.g. "--model").
    """
    root = Path(path)
    if not root.exists():
        raise UserInputError(f"{what} {root}: no such file or directory")
    cache_file = _cache_path()
    cache = _load_cache(cache_file)
    used: set[str] = set()
    changed = False

    def file_digest(p: Path) -> str:
        nonlocal changed
        st = p.stat()
        key = str(p.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        used.add(key)
        hit = cache.get(key)
        if isinstance(hit, list) and len(hit) == 4 and hit[:3] == stamp:
            return str(hit[3])
        digest = sha256_file(p)
        cache[key] = [*stamp, digest]
        changed = True
        return digest

    if root.is_file():
        result = file_digest(root)
    else:
        h = hashlib.sha256()
        for p in _files(root):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + file_digest(p).encode() + b"\n")
        result = h.hexdigest()
    if changed:
        if len(cache) > _CACHE_LIMIT:  # forget files of other runs rather than grow without bound
            cache = {k: v for k, v in cache.items() if k in used}
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cache_file, json.dumps(cache).encode())
        except OSError:
            pass
    return result
