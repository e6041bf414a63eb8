"""Durable, atomic file output: write a hidden temp file, fsync it, rename it into place.

A reader (or a resumed run) therefore never sees a half-written file under its final name. The
sha256 of the bytes is computed while they are written, on a background thread so that hashing
and disk writes overlap with encoding.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Iterator
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
