"""GroupCommit: items submitted within the linger go to one write, each submitter gets its own result."""

from __future__ import annotations

import asyncio

import pytest

from gateway.group_commit import GroupCommit


class _Writer:
    """Records every batch; answers each item with (item, batch number)."""

    def __init__(self, fail_on: int | None = None, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.fail_on, self.delay_s = fail_on, delay_s

    async def __call__(self, items: list[int]) -> list[tuple[int, int]]:
        self.batches.append(list(items))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_on in items:
            raise ValueError(f"cannot write {self.fail_on}")
        return [(item, len(self.batches)) for item in items]


def test_items_within_the_linger_share_one_write_and_each_gets_its_own_result() -> None:
    async def main():
        writer = _Writer()
        batch = GroupCommit(writer, linger_s=0.05, max_items=100)
        first = asyncio.create_task(batch.submit(1))
        await asyncio.sleep(0.01)
        rest = [asyncio.create_task(batch.submit(i)) for i in (2, 3)]
        await asyncio.sleep(0)
        assert writer.batches == [] and batch.queued == 3  # nothing written before the linger ends
        assert await asyncio.gather(first, *rest) == [(1, 1), (2, 1), (3, 1)]
        assert writer.batches == [[1, 2, 3]]
        assert await batch.submit(4) == (4, 2)  # the next item starts the next batch
        assert writer.batches == [[1, 2, 3], [4]]
    asyncio.run(main())


def test_a_full_batch_is_written_at_once_and_the_rest_waits_for_its_own() -> None:
    async def main():
        writer = _Writer()
        batch = GroupCommit(writer, linger_s=30.0, max_items=3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.gather(*(batch.submit(i) for i in range(3))) == [(0, 1), (1, 1), (2, 1)]
        assert loop.time() - started < 1.0  # did not wait for the 30 s linger
        late = asyncio.create_task(batch.submit(9))
        await asyncio.sleep(0.05)
        assert not late.done() and batch.queued == 1
        await batch.drain()  # writes what is queued without waiting out the linger
        assert late.result() == (9, 2) and writer.batches == [[0, 1, 2], [9]]
    asyncio.run(main())


def test_a_failed_write_raises_in_every_submitter_of_that_batch_only() -> None:
    async def main():
        writer = _Writer(fail_on=2)
        batch = GroupCommit(writer, linger_s=0.01, max_items=100)
        results = await asyncio.gather(*(batch.submit(i) for i in (1, 2, 3)), return_exceptions=True)
        assert all(isinstance(r, ValueError) and "cannot write 2" in str(r) for r in results)
        assert await batch.submit(4) == (4, 2)
    asyncio.run(main())


def test_a_cancelled_submitter_leaves_its_item_in_the_batch() -> None:
    async def main():
        writer = _Writer(delay_s=0.05)
        batch = GroupCommit(writer, linger_s=0.02, max_items=100)
        gone = asyncio.create_task(batch.submit(1))
        kept = asyncio.create_task(batch.submit(2))
        await asyncio.sleep(0.03)  # the batch is being written
        gone.cancel()
        assert await kept == (2, 1)
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert writer.batches == [[1, 2]]
        cancelled_early = asyncio.create_task(batch.submit(3))
        await asyncio.sleep(0)
        cancelled_early.cancel()  # cancelled while still queued: written all the same
        await batch.drain()
        assert writer.batches == [[1, 2], [3]]
    asyncio.run(main())


def test_with_no_linger_an_idle_writer_writes_at_once_and_what_comes_meanwhile_goes_next() -> None:
    async def main():
        writer = _Writer(delay_s=0.05)
        batch = GroupCommit(writer, linger_s=0.0, max_items=3)
        first = asyncio.create_task(batch.submit(0))
        await asyncio.sleep(0.01)
        assert writer.batches == [[0]]  # nothing was in flight: written without waiting
        rest = [asyncio.create_task(batch.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        assert writer.batches == [[0]] and batch.queued == 2  # the first write is still in flight
        assert await first == (0, 1)
        assert await asyncio.gather(*rest) == [(1, 2), (2, 2)]  # together, once it returned
        burst = [asyncio.create_task(batch.submit(i)) for i in range(10, 17)]
        await asyncio.sleep(0.01)
        assert writer.batches[2:] == [[10], [11, 12, 13], [14, 15, 16]]  # a full queue does not wait
        await batch.drain()
        assert all(t.done() for t in burst) and writer.batches[2:] == [[10], [11, 12, 13], [14, 15, 16]]
    asyncio.run(main())


def test_drain_writes_the_queue_and_waits_for_writes_in_flight() -> None:
    async def main():
        writer = _Writer(delay_s=0.05)
        batch = GroupCommit(writer, linger_s=0.0, max_items=100)
        pending = [asyncio.create_task(batch.submit(i)) for i in range(3)]
        await asyncio.sleep(0)
        await batch.drain()
        assert all(task.done() for task in pending)
        assert writer.batches == [[0], [1, 2]]
    asyncio.run(main())


def test_max_items_must_be_positive() -> None:
    with pytest.raises(ValueError):
        GroupCommit(_Writer(), linger_s=0.1, max_items=0)
