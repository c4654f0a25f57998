"""The message gate's decisions on single messages (the worker-level barrage is test_hostile_queue.py)."""
from __future__ import annotations

import base64
import bz2
import json
import zlib
from datetime import datetime, timedelta, timezone

from test_hostile_queue import QUEUE, bz2_bomb, envelope, msgpack_envelope, raw

from vlmq.workers.gate import Gate


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
