"""The rollout manager's async producer (``train_async.py``) and its window.

At most ``capacity`` groups are in flight or buffered. A group frees its slot the moment it leaves for
good - taken by the trainer, dropped as stale (also while a take is still waiting, and when a new version
makes buffered groups stale), filtered out, or lost - so the window refills even when every group in it
turned stale at once (``K = 0``, or an activation slower than a training step).

Concurrency: everything runs on the actor's event loop except :meth:`ProducerWindow.dropped`, which the
buffer calls from any thread with its lock held and which hands the release over to the loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from miles_disagg.rollout.buffer import BufferClosed
from miles_disagg.rollout.generate import RequestLost
from miles_disagg.samples import Group

log = logging.getLogger(__name__)


class ProducerWindow:
    """Keeps ``capacity`` groups' worth of generation going: each round reserves ``round_size`` slots,
    makes groups with ``make_groups`` and puts them with ``put``; the slots of groups that do not
    arrive (filtered out, lost, failed) go back at once. The first failure stops production and is
    raised to the trainer by :meth:`raise_failure`."""

    def __init__(self, capacity: int, counters: dict[str, int]):
        self.capacity = capacity
        self.counters = counters  # the manager's request counters: a lost group counts in "lost_groups"
        self.in_window = 0  # groups drawn and not yet taken, dropped, filtered out or lost
        self.failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Event | None = None
        self._producer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    def attach(self) -> None:
        """Bind to the running event loop (before the buffer may report drops)."""
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Event()

    def start(self, round_size: int, make_groups: Callable[[], Awaitable[list[Group]]],
              put: Callable[[Group], None]) -> None:
        """Begin producing (once; later calls do nothing)."""
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce_forever(round_size, make_groups, put))

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def release(self, n: int) -> None:
        """``n`` groups left the window (in the event loop's thread)."""
        if self._producer is None or n == 0:
            return
        self.in_window -= n
        self._room.set()

    def dropped(self, n: int) -> None:
        """The buffer dropped ``n`` stale groups (any thread, buffer lock held)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.release, n)

    def stop(self) -> None:
        for task in [self._producer, *self._tasks]:
            if task is not None:
                task.cancel()

    async def _produce_forever(self, size: int, make_groups, put) -> None:
        try:
            while self.failure is None:  # after a failure, take() reports it; stop generating
                while self.in_window + size > self.capacity:
                    self._room.clear()
                    await self._room.wait()
                if self.failure is not None:
                    break
                self.in_window += size
                self._spawn(self._fill(size, make_groups, put))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the trainer by take()
            self.failure = exc
            raise

    async def _fill(self, reserved: int, make_groups, put) -> None:
        """Generate ``reserved`` groups' worth into the buffer; free the slots of those that do not arrive."""
        arrived = 0
        try:
            for group in await make_groups():
                put(group)
                arrived += 1
        except asyncio.CancelledError:
            raise
        except RequestLost:
            self.counters["lost_groups"] = self.counters.get("lost_groups", 0) + 1
        except BufferClosed:
            return
        except BaseException as exc:
            log.exception("rollout group failed")
            self.failure = exc
        self.release(reserved - arrived)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
