"""The kombu/Celery internals vlmq.workers.broker relies on exist, and an upgrade that moves one fails loudly."""
from __future__ import annotations

import importlib
import re
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from vlmq import keys
from vlmq.queue import make_celery
from vlmq.settings import Settings
from vlmq.workers import broker

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_every_internal_exists_in_the_installed_versions_and_the_pins_cover_them() -> None:
    broker.check_internals()
    text = PYPROJECT.read_text()
    for package in ("celery", "kombu"):
        pinned = re.search(rf'"{package}(?:\[redis\])?~=(\d+\.\d+)\.\d+"', text)
        assert pinned, f"{package} is not pinned with a compatible-release range in pyproject.toml"
        assert version(package).startswith(pinned[1] + "."), f"installed {package} {version(package)} is off the pin"


@pytest.mark.parametrize(("module", "path"), broker.INTERNALS, ids=[f"{m}.{p}" for m, p in broker.INTERNALS])
def test_a_missing_internal_is_named(monkeypatch: pytest.MonkeyPatch, module: str, path: str) -> None:
    owner: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if isinstance(owner, type):  # remove it where it is defined, base classes included, as an upgrade would
        for klass in owner.__mro__:
            if name in vars(klass):
                monkeypatch.delattr(klass, name)
    else:
        monkeypatch.delattr(owner, name)
    with pytest.raises(broker.BrokerContractError, match=re.escape(f"{module}.{path} is missing")):
        broker.check_internals()


@pytest.fixture()
def channel(redis_url: str) -> Any:
    app = make_celery(Settings(broker_url=redis_url))
    with app.connection_for_write() as conn:
        yield conn.default_channel


def test_a_real_channel_uses_the_key_layout_of_vlmq_keys(channel: Any) -> None:
    broker.check_channel(channel)
    assert channel.unacked_key == keys.UNACKED and channel.unacked_index_key == keys.UNACKED_INDEX
    assert [channel._q_for_pri("q", p) for p in channel.priority_steps] == keys.queue_lists("q")


def test_a_channel_laid_out_differently_is_refused_by_name(channel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "sep", "\x06\x16")  # kombu's default separator, not the one vlmq configures
    with pytest.raises(broker.BrokerContractError, match="priority list for step 1"):
        broker.check_channel(channel)
    monkeypatch.setattr(channel, "unacked_key", "other")
    with pytest.raises(broker.BrokerContractError, match="unacked_key"):
        broker.check_channel(channel)
    monkeypatch.delattr(channel, "_queue_cycle")
    with pytest.raises(broker.BrokerContractError, match="Channel._queue_cycle is missing"):
        broker.check_channel(channel)


def test_a_worker_queue_is_popped_before_the_shared_queue_at_each_priority(channel: Any) -> None:
    shared, own = keys.queue("m", "xs"), keys.worker_queue("m", "xs", "w1")
    channel._active_queues[:] = [shared, own]  # what basic_consume does (kombu's cycle order: shared first)
    channel._queue_cycle.update([shared, own])
    popped = broker.pop_keys(channel, {shared, own}, first=frozenset({own}))
    assert popped[:4] == [own, shared, keys.priority_list(own, 1), keys.priority_list(shared, 1)]
    assert broker.pop_keys(channel, {shared}, first=frozenset({own}))[:2] == [shared, keys.priority_list(shared, 1)]


def test_kombu_stores_the_routing_key_in_the_form_the_drain_script_rewrites(redis_url: str, redis_client: Any,
                                                                             tmp_path: Path) -> None:
    import io
    import json

    from PIL import Image

    from vlmq.client import Client
    from vlmq.queue import make_celery

    own = keys.worker_queue("tiny-shapes", "xs", "w1")
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, "PNG")
    with Client(redis_url, f"file://{tmp_path}") as client:
        app = make_celery(client.settings)  # kombu's own writer: restores of unacked messages write this form
        app.send_task("vlmq.run_job", args=["0" * 32], queue=own, declare=[])
        app.close()
    raw = redis_client.rpop(own).decode()
    assert f'"routing_key": {json.dumps(own)}' in raw


def test_a_channel_reads_a_not_now_reply_as_a_lost_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import redis
    from kombu.transport import redis as kombu_redis
    from test_broker_busy import BUSY_SCRIPT

    from vlmq.embedded import start_valkey

    monkeypatch.setattr(kombu_redis.Channel, "connection_class", kombu_redis.Channel.connection_class)  # restored
    broker.use_transient_as_lost()
    server = start_valkey()
    admin = redis.Redis.from_url(server.url)
    try:
        admin.config_set("busy-reply-threshold", 10)
        with make_celery(Settings(broker_url=server.url)).connection_for_write() as conn:
            connection = conn.default_channel.client.connection_pool.get_connection()  # the class kombu connects with
            busy = threading.Thread(target=admin.eval, args=(BUSY_SCRIPT, 0, 1_500_000))
            busy.start()
            time.sleep(0.3)
            connection.send_command("LPUSH", "q", "m")
            with pytest.raises(tuple(conn.connection_errors), match="BUSY"):
                connection.read_response()
            busy.join()
            connection.send_command("LPUSH", "q", "m")  # reconnects; an ordinary reply reads as before
            assert connection.read_response() == 1
    finally:
        admin.close()
        server.stop()
