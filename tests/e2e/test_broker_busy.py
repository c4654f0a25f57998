"""A broker that answers "not now" never stops a worker; one that refuses it for good stops it with a non-zero status;
a broker that lost the producers' function library gets it back from the workers.

Each test runs its own Valkey (``busy-reply-threshold`` lowered so a script makes it answer ``BUSY`` within 50 ms)
and one real worker as the ACL worker user ``vlmq acl --worker`` prints (issue 36 item 2).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_tenants import png, with_user
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import acl
from vlmq.client import Client
from vlmq.embedded import Server, start_valkey
from vlmq.errors import BackendError
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# a script that keeps the server busy for ARGV[1] microseconds (it reads TIME only, so it could be killed)
BUSY_SCRIPT = """
local t0 = redis.call('TIME')
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1]) then return 1 end
end
"""


@dataclasses.dataclass
class Broker:
    server: Server
    admin: Any
    settings: Settings  # untenanted, the default user
    worker_url: str


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    import redis

    server = start_valkey()
    admin = redis.Redis.from_url(server.url)
    try:
        admin.config_set("busy-reply-threshold", 50)
        password = acl.new_password()
        admin.execute_command("ACL", "SETUSER", *acl.setuser_args(acl.WORKER_USER, password, acl.worker_rules()))
        settings = Settings(broker_url=server.url, storage_url=f"file://{tmp_path / 'store'}",
                            cost_classes=TINY_CLASSES)
        yield Broker(server, admin, settings, with_user(server.url, acl.WORKER_USER, password))
    finally:
        admin.close()
        server.stop()


def start_worker(broker: Broker, log: Path) -> WorkerProcess:
    worker = WorkerProcess(dataclasses.replace(broker.settings, broker_url=broker.worker_url), log)
    worker.wait_ready()
    return worker


def test_a_busy_broker_never_stops_a_worker(broker: Broker, tmp_path: Path) -> None:
    worker = start_worker(broker, tmp_path / "worker.log")
    try:
        with Client(settings=broker.settings) as client:
            assert client.submit(png((200, 0, 0)), "What colour is the image?", max_new_tokens=4).result(timeout=120)
            for _ in range(8):  # every pop, lease renewal and heartbeat in these 8 s is answered BUSY
                broker.admin.eval(BUSY_SCRIPT, 0, 1_000_000)
                time.sleep(0.05)
            assert worker.alive(), worker.log()[-3000:]
            after = client.submit(png((0, 200, 0)), "What colour is the image?", max_new_tokens=4)
            assert after.result(timeout=120).job_id == after.id
        assert "BUSY" in worker.log() and "Unrecoverable error" not in worker.log()
    finally:
        worker.stop()


def test_a_worker_stopped_by_an_unrecoverable_error_exits_non_zero(broker: Broker, tmp_path: Path) -> None:
    worker = start_worker(broker, tmp_path / "worker.log")
    try:
        # the worker's user loses EVAL, which its pop needs: NOPERM is no "not now", the worker cannot go on
        broker.admin.execute_command("ACL", "SETUSER", acl.WORKER_USER, "-eval")
        assert worker.proc.wait(timeout=120) != 0, worker.log()[-3000:]
        assert "Unrecoverable error" in worker.log()
    finally:
        worker.stop()


def test_a_worker_loads_the_function_library_again_when_the_server_lost_it(broker: Broker, tmp_path: Path) -> None:
    password = acl.new_password()
    broker.admin.execute_command("ACL", "SETUSER", *acl.setuser_args(acl.tenant_user("acme"), password,
                                                                     acl.tenant_rules("acme")))
    tenant = dataclasses.replace(broker.settings, tenant="acme",
                                 broker_url=with_user(broker.server.url, acl.tenant_user("acme"), password))
    worker = start_worker(broker, tmp_path / "worker.log")
    try:
        broker.admin.function_flush()  # a restart without persistence, or an operator's FUNCTION FLUSH
        with Client(settings=tenant) as client:  # a tenant cannot load it: the worker does, within seconds
            deadline = time.monotonic() + 60
            while True:
                try:
                    job = client.submit(png((0, 0, 200)), "What colour is the image?", max_new_tokens=4)
                    break
                except BackendError as e:
                    assert "not loaded" in str(e) and time.monotonic() < deadline, e
                    time.sleep(0.5)
            assert job.result(timeout=120).job_id == job.id
    finally:
        worker.stop()
