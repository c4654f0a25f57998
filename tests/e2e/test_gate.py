"""The message gate's decisions on single messages (the worker-level barrage is test_hostile_queue.py)."""
from __future__ import annotations

import base64
import bz2
import json
import zlib
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from test_hostile_queue import QUEUE, bz2_bomb, envelope, msgpack_envelope, raw

from vlmq import keys
from vlmq.queue import make_celery
from vlmq.settings import Settings
from vlmq.workers import broker
from vlmq.workers.gate import DEAD_LETTER_MAX, DEAD_LETTER_RAW_BYTES, DEAD_LETTER_TTL, Gate, dead_letters


def iso(seconds_from_now: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds_from_now)).isoformat()


def test_the_sdks_envelopes_pass_in_json_and_msgpack() -> None:
    for message in (envelope(), msgpack_envelope("a" * 32)):
        passed, reason = Gate().check(QUEUE, raw(message))
        assert passed == message and reason == ""


def test_a_near_eta_and_a_future_expiry_pass_a_far_eta_does_not() -> None:
    gate = Gate(max_eta_ahead_s=60)
    assert gate.check(QUEUE, raw(envelope(headers={"eta": iso(30), "expires": iso(600)})))[1] == ""
    assert gate.check(QUEUE, raw(envelope(headers={"eta": iso(120)})))[1].startswith("eta_too_far:")


def test_compression_passes_only_when_configured_and_within_its_cap() -> None:
    body = json.dumps([["b" * 32], {}, {}]).encode()
    small = envelope(headers={"compression": "application/x-gzip"})
    small["body"] = base64.b64encode(zlib.compress(body)).decode()
    assert Gate().check(QUEUE, raw(small))[1].startswith("compressed: compression 'application/x-gzip' is not")
    assert Gate(max_decompressed_bytes=1024).check(QUEUE, raw(small))[1] == ""
    bomb = envelope(body=bz2_bomb(50), headers={"compression": "application/x-bz2"})
    assert Gate(max_decompressed_bytes=1024).check(QUEUE, raw(bomb))[1] == \
        "compressed: decompresses to more than 1024 bytes"
    brotli = envelope(body=bz2.compress(body), headers={"compression": "application/x-brotli"})
    assert Gate(max_decompressed_bytes=1024).check(QUEUE, raw(brotli))[1].startswith("compressed: compression")


def test_dead_letters_are_bounded_and_expire(redis_client: Any) -> None:
    gate = Gate()
    for i in range(DEAD_LETTER_MAX + 5):
        gate.dead_letter(redis_client, QUEUE, f"bad_body: #{i}", b"x" * (DEAD_LETTER_RAW_BYTES + 10))
    letters = dead_letters(redis_client, QUEUE)
    assert len(letters) == DEAD_LETTER_MAX and letters[0]["reason"] == f"bad_body: #{DEAD_LETTER_MAX + 4}"
    assert letters[0]["raw"] == b"x" * DEAD_LETTER_RAW_BYTES and letters[0]["size"] == DEAD_LETTER_RAW_BYTES + 10
    assert 0 < redis_client.ttl(keys.dead_letter(QUEUE)) <= DEAD_LETTER_TTL


def test_a_message_that_breaks_the_consumer_is_dead_lettered_and_acked(redis_url: str, redis_client: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_celery(Settings(broker_url=redis_url))
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        redis_client.lpush(QUEUE, raw(envelope()))  # passes the gate; Celery's side then raises on it
        _, message, state, tag = redis_client.execute_command(*broker.pop_command([QUEUE]))
        assert state == b"recorded" and redis_client.hexists(keys.UNACKED, tag)

        def deliver(*_: object) -> None:
            raise ValueError("not enough values to unpack (expected 3, got 1)")

        monkeypatch.setattr(channel.connection, "_deliver", deliver)
        broker._admit(channel, Gate(), QUEUE, message, state.decode(), tag.decode())  # must not raise
    [letter] = dead_letters(redis_client, QUEUE)
    assert letter["reason"] == "consumer_error: ValueError: not enough values to unpack (expected 3, got 1)"
    assert letter["raw"] == message and not redis_client.hexists(keys.UNACKED, tag)
    assert redis_client.zscore(keys.UNACKED_INDEX, tag) is None
