"""A bounded, preallocated shared-memory ring that moves batches of tensors between processes.

The parent creates a `Ring` and passes it to its workers as a `Process` argument (spawn context:
workers load diffusers models, so fork is unsafe). Each field owns one tensor
`[slots, rows, *shape]` moved to shared memory once; only slot indices and a small meta dict travel
through the two queues (`free` and `full`), so no shared-memory segment is created per message.
`put` blocks while every slot is in flight, which bounds memory and gives backpressure.

Sizes. A batch may hold fewer rows than a slot, and a field may declare `ragged` dimensions whose
size is a maximum: each message carries its tensors' actual shapes, so one ring moves batches whose
sizes change from message to message (e.g. a MixGRPO window that shrinks across iterations: K
stored steps, up to the largest window).

Lifetimes. The storage belongs to the ring, not to a producer, so a producer may exit right after
its last `put` (a fresh tensor sent through a queue would vanish with its producer). With torch's
default `file_descriptor` sharing strategy the segment is unlinked as soon as it is created and
lives only while some process holds its descriptor or mapping: it is released when every process
has dropped the ring, and a crash leaves nothing behind to clean up.

Failures. A consumer should loop on `get(timeout=...)` and check its workers' liveness between
timeouts. A process killed inside a queue operation may leave that queue's lock held, and one
killed between taking a free slot and publishing it loses that slot: treat a dead worker as fatal
for the ring. Meta is pickled through a pipe; keep it small (ids, strings, a few PNG bytes), since
a producer blocks at exit until the consumer has read what it sent.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

_SENTINEL = None  # sent on both queues by close(); every receiver puts it back for the next one


class RingClosed(Exception):
    """The ring was closed: `get` raises it once the items put before `close` are drained."""


@dataclass(frozen=True)
class Field:
    """One tensor field of a slot: every row has `shape` and `dtype`; a slot holds up to `rows` rows.

    `ragged` lists the dimensions of `shape` (0-based, rows not counted) whose size is a maximum: a
    batch may be shorter there, and `get` returns it with the size it was put with.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ragged: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Field {self.name!r}: negative dimension in shape {shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"Field {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        ragged = tuple(sorted({int(d) for d in self.ragged}))
        if any(not 0 <= d < len(shape) for d in ragged):
            raise ValueError(f"Field {self.name!r}: ragged dimensions {ragged} are not dimensions of {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ragged", ragged)

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether one row of this `shape` fits: equal sizes, or at most the size in ragged dimensions."""
        return len(shape) == len(self.shape) and all(
            got <= want if d in self.ragged else got == want
            for d, (got, want) in enumerate(zip(shape, self.shape))
        )


class Ring:
    """K preallocated slots of `rows` rows per field, shared with spawned processes.

    Create it in the parent, hand it to children as a `Process` argument (its queues can only be
    pickled while a process is being started), then `put` in producers and `get` in consumers.
    """

    def __init__(self, fields: Sequence[Field], *, slots: int, rows: int, ctx: Any = None) -> None:
        fields = tuple(fields)
        names = [f.name for f in fields]
        if not fields:
            raise ValueError("Ring: needs at least one Field")
        if len(set(names)) != len(names):
            raise ValueError(f"Ring: duplicate field names in {names}")
        if slots < 1 or rows < 1:
            raise ValueError(f"Ring: slots and rows must be >= 1, got slots={slots}, rows={rows}")
        ctx = ctx if ctx is not None else mp.get_context("spawn")
        self.fields = fields
        self.slots = slots
        self.rows = rows
        self._buffers = {
            f.name: torch.empty((slots, rows, *f.shape), dtype=f.dtype).share_memory_() for f in fields
        }
        self._free = ctx.Queue()
        self._full = ctx.Queue()
        self._closed = ctx.Value("b", 0)
        for i in range(slots):
            self._free.put(i)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory held by the slot tensors."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def closed(self) -> bool:
        """Whether any process has called `close`."""
        return bool(self._closed.value)

    def put(
        self, batch: Mapping[str, torch.Tensor], meta: dict | None = None, *, timeout: float | None = None
    ) -> None:
        """Copy `batch` (each field `[n, *shape]`, n <= rows, ragged dims at most their size) into a free
        slot and publish it with `meta`.

        Blocks while no slot is free. Raises ValueError on a malformed batch or meta, TimeoutError
        when no slot frees up within `timeout` seconds, RingClosed after `close`.
        """
        self._check(batch, meta)
        if self.closed:
            raise RingClosed("Ring.put: the ring is closed")
        sizes = {name: tuple(batch[name].shape) for name in self._buffers}
        idx = self._receive(self._free, timeout, "a free slot")
        try:
            for name, buf in self._buffers.items():
                buf[(idx, *map(slice, sizes[name]))].copy_(batch[name])
        except BaseException:
            self._free.put(idx)
            raise
        self._full.put((idx, sizes, dict(meta or {})))

    def get(self, *, timeout: float | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """Take the oldest full slot: per field a clone of what was put (`[n, *shape]`, ragged dims as
        put), and its meta.

        The slot is freed before returning. Raises TimeoutError when nothing arrives within
        `timeout` seconds, RingClosed once the ring is closed and drained.
        """
        idx, sizes, meta = self._receive(self._full, timeout, "a full slot")
        try:
            batch = {
                name: buf[(idx, *map(slice, sizes[name]))].clone() for name, buf in self._buffers.items()
            }
        finally:
            self._free.put(idx)
        return batch, meta

    def close(self) -> None:
        """Wake every blocked `get` and `put` with RingClosed; later calls, from any process, do nothing."""
        with self._closed.get_lock():
            if self._closed.value:
                return
            self._closed.value = 1
        self._full.put(_SENTINEL)
        self._free.put(_SENTINEL)

    def abandon(self) -> None:
        """After `close`, once the other processes are gone: this process's exit no longer waits to
        flush what it put on the ring's queues (a full pipe nobody reads would hold it for ever)."""
        self._full.cancel_join_thread()
        self._free.cancel_join_thread()

    def _receive(self, q: Any, timeout: float | None, what: str) -> Any:
        try:
            item = q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"Ring: no {what} within {timeout} s") from None
        if item is _SENTINEL:
            q.put(_SENTINEL)
            raise RingClosed("Ring: the ring is closed")
        return item

    def _check(self, batch: Mapping[str, torch.Tensor], meta: dict | None) -> None:
        """Validate a batch against the fields: one row count n <= rows, shapes that fit, dtypes."""
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"Ring.put: meta must be a dict or None, got {type(meta).__name__}")
        tensors = [k for k, v in (meta or {}).items() if isinstance(v, torch.Tensor)]
        if tensors:
            raise ValueError(f"Ring.put: meta keys {tensors} hold tensors; declare them as Fields instead")
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"Ring.put: batch must be a mapping of field name to tensor, got {type(batch).__name__}"
            )
        unknown = sorted(set(batch) - set(self._buffers))
        missing = sorted(set(self._buffers) - set(batch))
        if unknown or missing:
            raise ValueError(
                f"Ring.put: unknown fields {unknown}, missing fields {missing}; "
                f"the ring holds {sorted(self._buffers)}"
            )
        n = None
        for f in self.fields:
            t = batch[f.name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"Ring.put: field {f.name!r} must be a tensor, got {type(t).__name__}")
            if t.dtype != f.dtype:
                raise ValueError(f"Ring.put: field {f.name!r} has dtype {t.dtype}, expected {f.dtype}")
            if t.dim() != 1 + len(f.shape) or not f.fits(tuple(t.shape[1:])):
                ragged = f" and dimensions {f.ragged} at most that size" if f.ragged else ""
                raise ValueError(
                    f"Ring.put: field {f.name!r} has shape {tuple(t.shape)}, "
                    f"expected (n, *{f.shape}) with n <= {self.rows}{ragged}"
                )
            if n is not None and t.shape[0] != n:
                raise ValueError(f"Ring.put: field {f.name!r} has {t.shape[0]} rows, other fields have {n}")
            n = t.shape[0]
        if n > self.rows:
            raise ValueError(f"Ring.put: batch has {n} rows, a slot holds at most {self.rows}")
