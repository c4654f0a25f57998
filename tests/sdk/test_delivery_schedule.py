"""The retry schedule of ``vlmq.delivery``: jittered steps, a receiver's ``Retry-After``, and the end of it."""
from __future__ import annotations

import pytest

from vlmq.delivery import JITTER, DeliveryContext, _next_delay
from vlmq.settings import Settings


@pytest.fixture
def ctx() -> DeliveryContext:
    settings = Settings(webhook_retry_schedule="10,100")
    return DeliveryContext(settings, redis=None, storage=None, secrets=[])  # type: ignore[arg-type]


def test_each_retry_waits_its_step_with_jitter_and_the_schedule_ends(ctx: DeliveryContext) -> None:
    for attempt, step in ((1, 10.0), (2, 100.0)):
        delay = _next_delay(ctx, attempt, "")
        assert delay is not None and step * (1 - JITTER) <= delay <= step * (1 + JITTER)
    assert _next_delay(ctx, 3, "") is None


def test_retry_after_lengthens_a_retry_up_to_the_longest_step(ctx: DeliveryContext) -> None:
    assert _next_delay(ctx, 1, "50") == 50.0
    assert _next_delay(ctx, 1, "86400") == 100.0  # a receiver cannot park its events past the schedule
    assert _next_delay(ctx, 3, "50") is None  # nor buy more attempts
    delay = _next_delay(ctx, 1, "soon")  # not seconds: ignored
    assert delay is not None and delay <= 10 * (1 + JITTER)
