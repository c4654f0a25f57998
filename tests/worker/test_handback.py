"""Owed attempts (workers/handback.py) with a real Valkey: an attempt a hand-back could not take off stays owed
until Redis has taken it off, so a caller that waits for ``pending() == 0`` sees the record already paid."""
from __future__ import annotations

import threading
import time
from typing import Any

from vlmq import keys
from vlmq.workers.handback import OwedAttempts


class HeldRedis:
    """The real client, whose ``eval`` waits for the test's go (a payment in flight)."""

    def __init__(self, real: Any) -> None:
        self.real, self.go, self.entered = real, threading.Event(), threading.Event()

    def eval(self, *args: Any) -> Any:
        self.entered.set()
        assert self.go.wait(10)
        return self.real.eval(*args)


def test_an_attempt_stays_owed_until_redis_has_taken_it_off(redis_client: Any) -> None:
    redis_client.hset(keys.job("j1"), "attempts", 1)
    redis_client.expire(keys.job("j1"), 60)
    held = HeldRedis(redis_client)
    owed = OwedAttempts(held)
    owed.add("j1")
    assert held.entered.wait(10)  # the payer thread is taking it off
    assert owed.pending() == 1  # not yet paid: a waiter must not read the record now
    held.go.set()
    deadline = time.monotonic() + 10
    while owed.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert owed.pending() == 0
    assert redis_client.hget(keys.job("j1"), "attempts") == b"0"
