"""The shared-memory ring moves tensor batches between spawned processes, bit-exact, with backpressure.

One spawned worker serves every cross-process test (spawn start-up costs a second or two), driven
by commands on a control queue; the crash test spawns its own short-lived child.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from stages.online.ring import Field, Ring, RingClosed

CTX = mp.get_context("spawn")
FIELDS = (
    Field("latents", (4, 8, 8), torch.float32),
    Field("step", (), torch.int64),
    Field("cond", (3, 5), torch.bfloat16),
)
RAGGED = (Field("latents", (5, 2, 3), torch.float32, ragged=(0,)), Field("k", (), torch.int64))
MIB4 = (1024, 1024)  # float32 rows of 4 MiB for the throughput measurement
STREAM_ITEMS = 96


def make_batch(seed: int, n: int) -> dict[str, torch.Tensor]:
    """A deterministic batch of n rows; producer and consumer regenerate it from the seed."""
    g = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(n, 4, 8, 8, generator=g),
        "step": torch.randint(-(2**62), 2**62, (n,), generator=g),
        "cond": torch.randn(n, 3, 5, generator=g).to(torch.bfloat16),
    }


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int64: torch.int64}[w.dtype]
        assert torch.equal(g.view(bits), w.view(bits)), k


def job_produce(ring: Ring, replies: Any, seeds: list[int], sizes: list[int]) -> None:
    for seed, n in zip(seeds, sizes):
        ring.put(make_batch(seed, n), {"seed": seed, "n": n, "id": f"s{seed}", "png": bytes([seed]) * 100})


def ragged_batch(seed: int, n: int, k: int) -> dict[str, torch.Tensor]:
    """n rows of k + 1 stored latents, as a window of k steps gives; regenerated from the seed."""
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(n, k + 1, 2, 3, generator=g), "k": torch.full((n,), k)}


def job_ragged(ring: Ring, replies: Any, windows: list[int]) -> None:
    for seed, k in enumerate(windows):
        ring.put(ragged_batch(seed, 3, k), {"k": k})


def job_backpressure(ring: Ring, replies: Any) -> None:
    for i in range(2):
        ring.put({"i": torch.tensor([i])})
        replies.put(("put", i))
    t0 = time.monotonic()
    try:
        ring.put({"i": torch.tensor([2])}, timeout=0.2)
    except TimeoutError:
        replies.put(("full", time.monotonic() - t0))
    for i in range(2, 5):
        ring.put({"i": torch.tensor([i])})
        replies.put(("put", i))


def job_close(ring: Ring, replies: Any) -> None:
    ring.put({"i": torch.tensor([7])})
    time.sleep(0.4)
    ring.close()


def job_stream(ring: Ring, replies: Any) -> None:
    x = torch.empty(1, *MIB4)
    for k in range(STREAM_ITEMS):
        x.fill_(k)
        ring.put({"x": x}, {"k": k})


JOBS = {
    "produce": job_produce,
    "ragged": job_ragged,
    "backpressure": job_backpressure,
    "close": job_close,
    "stream": job_stream,
}


def serve(rings: dict[str, Ring], commands: Any, replies: Any) -> None:
    """Worker loop: run (job, ring name, args) commands until None arrives."""
    torch.set_num_threads(1)
    while (cmd := commands.get()) is not None:
        job, name, args = cmd
        JOBS[job](rings[name], replies, *args)
        replies.put(("done", job))


def crash_after_one(ring: Ring, ack: Any) -> None:
    ring.put(make_batch(99, 2), {"last": True})
    ack.wait(30)
    os._exit(3)


class Worker:
    def __init__(self) -> None:
        self.rings = {
            "fields": Ring(FIELDS, slots=3, rows=4, ctx=CTX),
            "partial": Ring(FIELDS, slots=2, rows=4, ctx=CTX),
            "ragged": Ring(RAGGED, slots=2, rows=3, ctx=CTX),
            "backpressure": Ring([Field("i", (), torch.int64)], slots=2, rows=1, ctx=CTX),
            "close": Ring([Field("i", (), torch.int64)], slots=2, rows=1, ctx=CTX),
            "stream": Ring([Field("x", MIB4, torch.float32)], slots=4, rows=1, ctx=CTX),
        }
        self.commands = CTX.Queue()
        self.replies = CTX.Queue()
        self.proc = CTX.Process(target=serve, args=(self.rings, self.commands, self.replies), daemon=True)
        self.proc.start()

    def run(self, job: str, ring: str, *args: Any) -> Ring:
        self.commands.put((job, ring, args))
        return self.rings[ring]

    def reply(self, timeout: float = 30) -> Any:
        return self.replies.get(timeout=timeout)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.commands.put(None)
    w.proc.join(10)
    if w.proc.is_alive():
        w.proc.terminate()
    assert w.proc.exitcode == 0


def test_round_trip_through_child_is_bit_exact(worker: Worker) -> None:
    ring = worker.run("produce", "fields", [1, 2, 3, 4], [4, 4, 4, 4])
    for seed in [1, 2, 3, 4]:
        batch, meta = ring.get(timeout=30)
        assert meta == {"seed": seed, "n": 4, "id": f"s{seed}", "png": bytes([seed]) * 100}
        assert_bit_equal(batch, make_batch(seed, 4))
    assert worker.reply() == ("done", "produce")


def test_partial_batches_return_only_their_rows(worker: Worker) -> None:
    sizes = [1, 3, 4, 2, 1]
    ring = worker.run("produce", "partial", [10, 11, 12, 13, 14], sizes)
    for seed, n in zip([10, 11, 12, 13, 14], sizes):
        batch, meta = ring.get(timeout=30)
        assert meta["n"] == n
        assert batch["step"].shape == (n,) and batch["latents"].shape == (n, 4, 8, 8)
        assert_bit_equal(batch, make_batch(seed, n))
    assert worker.reply() == ("done", "produce")


def test_ragged_windows_that_shrink_and_grow_arrive_with_their_own_size(worker: Worker) -> None:
    windows = [4, 3, 1, 4, 2]  # a progressive window: shrinking near the end of its range, then back
    ring = worker.run("ragged", "ragged", windows)
    for seed, k in enumerate(windows):
        batch, meta = ring.get(timeout=30)
        assert meta == {"k": k}
        assert batch["latents"].shape == (3, k + 1, 2, 3) and batch["latents"].is_contiguous()
        assert_bit_equal(batch, ragged_batch(seed, 3, k))
    assert worker.reply() == ("done", "ragged")


def test_ragged_bounds() -> None:
    ring = Ring(RAGGED, slots=1, rows=3, ctx=CTX)
    with pytest.raises(ValueError, match="dimensions \\(0,\\) at most that size"):
        ring.put(ragged_batch(0, 3, 5))  # 6 stored latents: more than the 5 the field holds
    with pytest.raises(ValueError, match="'latents' has shape"):
        ring.put({"latents": torch.zeros(3, 2, 2, 2), "k": torch.zeros(3, dtype=torch.int64)})  # not ragged
    with pytest.raises(ValueError, match="ragged dimensions"):
        Field("x", (2, 3), torch.float32, ragged=(2,))
    ring.put(ragged_batch(1, 2, 0), timeout=5)
    assert_bit_equal(ring.get(timeout=5)[0], ragged_batch(1, 2, 0))


def test_backpressure_keeps_at_most_slots_in_flight(worker: Worker) -> None:
    ring = worker.run("backpressure", "backpressure")
    assert worker.reply() == ("put", 0)
    assert worker.reply() == ("put", 1)
    kind, waited = worker.reply()
    assert kind == "full" and waited >= 0.19  # a put with a timeout on a full ring gives up
    for got in range(1, 4):
        with pytest.raises(queue.Empty):  # the producer stays blocked while both slots are in flight
            worker.replies.get(timeout=0.2)
        assert ring.get(timeout=30)[0]["i"].tolist() == [got - 1]
        assert worker.reply() == ("put", got + 1)  # one get frees exactly one put
    assert [ring.get(timeout=30)[0]["i"].item() for _ in range(2)] == [3, 4]
    assert worker.reply() == ("done", "backpressure")


def test_close_from_child_drains_then_unblocks_get(worker: Worker) -> None:
    ring = worker.run("close", "close")
    batch, _ = ring.get(timeout=30)
    assert batch["i"].tolist() == [7]
    t0 = time.monotonic()
    with pytest.raises(RingClosed):
        ring.get(timeout=30)  # waits until the child closes, ~0.4 s later
    assert 0.1 < time.monotonic() - t0 < 20
    assert worker.reply() == ("done", "close")
    with pytest.raises(RingClosed):
        ring.get(timeout=1)
    with pytest.raises(RingClosed):
        ring.put({"i": torch.tensor([1])})
    ring.close()
    assert ring.closed


def test_close_unblocks_a_put_waiting_for_a_slot() -> None:
    ring = Ring([Field("i", (), torch.int64)], slots=1, rows=1, ctx=CTX)
    ring.put({"i": torch.tensor([0])})
    timer = threading.Timer(0.3, ring.close)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(RingClosed):
        ring.put({"i": torch.tensor([1])}, timeout=20)
    assert time.monotonic() - t0 > 0.2
    timer.join()
    assert ring.get(timeout=5)[0]["i"].tolist() == [0]  # what was put before close is still delivered
    with pytest.raises(RingClosed):
        ring.get(timeout=5)


@pytest.mark.parametrize(
    ("batch", "meta", "match"),
    [
        (
            {"latents": torch.zeros(2, 4, 8, 8), "step": torch.zeros(2, dtype=torch.int64)},
            None,
            "missing fields \\['cond'\\]",
        ),
        ({**make_batch(0, 2), "extra": torch.zeros(2)}, None, "unknown fields \\['extra'\\]"),
        ({**make_batch(0, 2), "latents": torch.zeros(2, 4, 8, 9)}, None, "'latents' has shape"),
        ({**make_batch(0, 2), "step": torch.zeros(2, 1, dtype=torch.int64)}, None, "'step' has shape"),
        ({**make_batch(0, 2), "cond": torch.zeros(2, 3, 5)}, None, "'cond' has dtype torch.float32"),
        ({**make_batch(0, 2), "step": torch.zeros(2, dtype=torch.int32)}, None, "'step' has dtype"),
        ({**make_batch(0, 2), "step": torch.zeros(3, dtype=torch.int64)}, None, "other fields have 2"),
        ({**make_batch(0, 2), "step": [1, 2]}, None, "must be a tensor"),
        (make_batch(0, 5), None, "at most 4"),
        (make_batch(0, 2), {"x": torch.zeros(1)}, "hold tensors"),
        (make_batch(0, 2), [1], "meta must be a dict"),
    ],
)
def test_malformed_batches_raise_and_keep_slots(batch: dict, meta: Any, match: str) -> None:
    ring = Ring(FIELDS, slots=2, rows=4, ctx=CTX)
    with pytest.raises(ValueError, match=match):
        ring.put(batch, meta)
    for seed in range(2):  # no slot was lost to the failed put
        ring.put(make_batch(seed, 3), timeout=5)
    with pytest.raises(TimeoutError):
        ring.put(make_batch(9, 1), timeout=0.05)
    assert_bit_equal(ring.get(timeout=5)[0], make_batch(0, 3))


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Ring([Field("a", (), torch.int64), Field("a", (2,), torch.int64)], slots=1, rows=1, ctx=CTX)
    with pytest.raises(ValueError, match="slots"):
        Ring(FIELDS, slots=0, rows=1, ctx=CTX)
    with pytest.raises(ValueError, match="negative"):
        Field("a", (2, -1), torch.float32)
    assert Ring(FIELDS, slots=3, rows=4, ctx=CTX).nbytes == 3 * 4 * (4 * 8 * 8 * 4 + 8 + 3 * 5 * 2)


def test_dead_producer_does_not_hang_consumer() -> None:
    ring = Ring(FIELDS, slots=2, rows=4, ctx=CTX)
    ack = CTX.Event()
    proc = CTX.Process(target=crash_after_one, args=(ring, ack), daemon=True)
    proc.start()
    try:
        batch, meta = ring.get(timeout=60)
        assert meta == {"last": True}
        assert_bit_equal(batch, make_batch(99, 2))
        ack.set()
        timeouts = 0
        while proc.is_alive():  # the liveness loop a driver runs between timeouts
            with pytest.raises(TimeoutError):
                ring.get(timeout=0.5)
            timeouts += 1
            assert timeouts < 40
        proc.join(5)
        assert proc.exitcode == 3
        with pytest.raises(TimeoutError):
            ring.get(timeout=0.5)
    finally:
        if proc.is_alive():
            proc.kill()


def test_stream_of_4mib_items_arrives_intact(worker: Worker) -> None:
    ring = worker.run("stream", "stream")
    batch, meta = ring.get(timeout=30)
    t0 = time.perf_counter()
    for k in range(1, STREAM_ITEMS):
        batch, meta = ring.get(timeout=30)
        assert meta == {"k": k}
        assert batch["x"][0, 0, 0].item() == k and batch["x"][0, -1, -1].item() == k
    elapsed = time.perf_counter() - t0
    assert torch.equal(batch["x"], torch.full((1, *MIB4), float(STREAM_ITEMS - 1)))
    mb_s = (STREAM_ITEMS - 1) * 4 * 2**20 / elapsed / 1e6
    print(f"\nring throughput: {mb_s:.0f} MB/s for 4 MiB items ({STREAM_ITEMS - 1} items, {elapsed:.2f} s)")
    assert worker.reply() == ("done", "stream")
