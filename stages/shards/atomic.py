"""Durable, atomic file output: write a hidden temp file, fsync it, rename it into place.

A reader (or a resumed run) therefore never sees a half-written file under its final name. The
sha256 of the bytes is computed while they are written, on a background thread so that hashing
and disk writes overlap with encoding.

Writer locks (`hold_lock`): a file locked with flock(2) by the process writing something, holding
that process's pid and host. The kernel drops the lock when the process ends, however it ends (a
kill -9 too), so a lock left by a dead writer is free and the next writer takes it over; the file
only names the holder while it lives.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import queue
import shutil
import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

_SMALL = 1 << 16
_BATCH = 1 << 20


def fsync_dir(path: Path) -> None:
    """Persist a directory entry change (rename, unlink) on POSIX file systems."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A hidden sibling temp name unique to this process and call."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def remove_stale_temps(path: Path) -> None:
    """Remove temp files a killed writer of `path` left behind."""
    for p in path.parent.glob(f".{path.name}.tmp-*"):
        p.unlink(missing_ok=True)


class _Worker(threading.Thread):
    """Applies `fn` to every buffer put on its queue, in order; remembers the first error."""

    def __init__(self, fn, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.queue: queue.Queue = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        while (data := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self._fn(data)
                except BaseException as e:
                    self.error = e


class HashingSink:
    """A write-only file object that hashes and writes its input on two background threads.

    hashlib and file writes release the GIL, so hashing, disk writes and the caller's encoding
    overlap. Small writes are coalesced; large ones are handed over as they are, so callers must
    not mutate a buffer after passing it to `write`.
    """

    def __init__(self, f) -> None:
        self._hash = hashlib.sha256()
        self._workers = (
            _Worker(self._hash.update, "omnirl-shard-hash"),
            _Worker(f.write, "omnirl-shard-write"),
        )
        self._pending = bytearray()
        self.bytes = 0
        self.sha256 = ""
        self.closed = False

    def _put(self, data) -> None:
        for w in self._workers:
            if w.error is not None:
                raise w.error
            w.queue.put(data)

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.bytes += n
        if n < _SMALL:
            self._pending += data
            if len(self._pending) >= _BATCH:
                self._put(bytes(self._pending))
                self._pending.clear()
        else:
            if self._pending:
                self._put(bytes(self._pending))
                self._pending.clear()
            self._put(data)
        return n

    def flush(self) -> None:
        """No-op: data reaches the file in `finish`."""

    def tell(self) -> int:
        return self.bytes

    def close(self) -> None:
        """No-op: the owner commits or aborts the file, not the encoder."""

    def _stop(self) -> None:
        for w in self._workers:
            w.queue.put(None)
        for w in self._workers:
            w.join()

    def finish(self) -> str:
        """Write what is pending, wait for the background threads and return the hex sha256."""
        if self._pending:
            self._put(bytes(self._pending))
            self._pending.clear()
        self._stop()
        for w in self._workers:
            if w.error is not None:
                raise w.error
        return self._hash.hexdigest()

    def abort(self) -> None:
        """Stop the background threads without raising."""
        self._stop()


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[HashingSink]:
    """Yield a sink; on clean exit the data is fsynced and renamed to `path`.

    After the block, `sink.bytes` and `sink.sha256` describe the committed file. On an exception
    the temp file is removed and `path` is untouched.
    """
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            sink = HashingSink(f)
            try:
                yield sink
                sink.sha256 = sink.finish()
            except BaseException:
                sink.abort()
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data` (temp file + fsync + os.replace + fsync of the dir)."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished directory `tmp` at `out`, replacing a directory there in one step.

    Where the OS cannot swap two directories atomically, the old one is renamed aside first;
    `recover_dir` undoes a crash between the two renames.
    """
    if not out.exists():
        os.replace(tmp, out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp)
    else:
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    fsync_dir(out.parent)


def recover_dir(out: Path) -> None:
    """Clean up after a writer of directory `out` that was killed: remove its half-written temp
    directories, and put back the previous `out` if the kill fell between `replace_dir`'s renames."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in sorted(out.parent.glob(f".{out.name}.old-*")):
        if out.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.replace(p, out)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


_HELD: dict[Path, tuple[int, int]] = {}  # the locks this process holds: path → (fd, pid that took it)


def hold_lock(path: Path, what: str) -> dict | None:
    """Take the writer lock `path` for this process (`what` it writes is recorded with its pid and
    host); None once held, also when this process holds it already. When another live process holds
    it, returns that holder's record ({"pid", "host", "what", "since"}; empty while it is being taken)."""
    key = path.absolute()
    if key in _HELD and _HELD[key][1] == os.getpid():
        return None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            return holder
        try:  # its holder may have removed it between our open and flock: lock the file at `path`
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "what": what,
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _HELD[key] = (fd, os.getpid())
    return None


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def lock_holder(path: Path) -> dict | None:
    """The record of the live process holding lock `path` (by `hold_lock`), or None when it is free
    or this process holds it."""
    if _HELD.get(path.absolute(), (-1, -1))[1] == os.getpid():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)
    return None


def release_lock(path: Path) -> None:
    """Remove and unlock a lock this process holds; a lock it does not hold is left alone. A child
    that inherited the lock's descriptor (fork) never releases its parent's lock."""
    key = path.absolute()
    fd, owner = _HELD.get(key, (-1, -1))
    if owner != os.getpid():
        return
    del _HELD[key]
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)


def remove_free_locks(paths: list[Path]) -> None:
    """Release the locks among `paths` this process holds, and remove those no live process holds
    (left by a killed writer); a lock another live process holds stays."""
    for path in paths:
        release_lock(path)
        if path.exists() and hold_lock(path, "cleanup") is None:
            release_lock(path)


@atexit.register
def _release_all() -> None:
    for path in list(_HELD):
        release_lock(path)
