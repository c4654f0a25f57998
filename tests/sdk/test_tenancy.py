"""Tenant ids, tenant-scoped names and the generated ACL, against a real Valkey and file storage (no worker).

The end-to-end proof with two tenants, their ACL users and a real worker is tests/e2e/test_tenants.py.
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from PIL import Image

from vlmq import acl, functions, keys
from vlmq.client import Client
from vlmq.errors import BackendError, InvalidRequest, JobNotFound
from vlmq.jobs import Job, JobStatus
from vlmq.settings import Settings

HEX = uuid.UUID(int=0xABC).hex
SHA = "ab" * 32


def png(colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("tenant", ["acme", "a", "acme-2", "0x", "a" * 32])
def test_valid_tenant_ids(tenant: str) -> None:
    assert keys.check_tenant(tenant) == tenant
    assert keys.tenant_of(keys.tenant_job_id(tenant, HEX)) == tenant
    assert re.fullmatch(keys.JOB_ID_RE, f"{tenant}.{HEX}")


@pytest.mark.parametrize("tenant", ["", "Acme", "-acme", "ac.me", "ac/me", "ac*", "a" * 33, "acme ", "é"])
def test_invalid_tenant_ids_are_refused_by_the_settings_and_the_client(tenant: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenant id"):
        keys.check_tenant(tenant)
    if tenant:
        with pytest.raises(ValueError, match="VLMQ_TENANT"):
            Settings.from_env({"VLMQ_TENANT": tenant})
        with pytest.raises(ValueError, match="VLMQ_TENANT"):
            Client("redis://127.0.0.1:1/0", f"file://{tmp_path}", tenant=tenant)


def test_names_of_a_tenants_job_and_of_an_untenanted_one() -> None:
    job_id = keys.tenant_job_id("acme", HEX)
    assert job_id == f"acme.{HEX}" and keys.tenant_job_id(None, HEX) == HEX and keys.tenant_of(HEX) is None
    assert keys.job(job_id) == f"vlmq:job:acme.{HEX}" and keys.idempotency("k", "acme") == "vlmq:idem:acme.k"
    assert keys.idempotency("k") == "vlmq:idem:k"
    assert keys.result_object(job_id) == f"t/acme/results/acme.{HEX}.json"
    assert keys.result_object(HEX) == f"results/{HEX}.json"
    assert keys.input_object(SHA, "acme") == f"t/acme/inputs/{SHA}" and keys.input_object(SHA) == f"inputs/{SHA}"


@pytest.mark.parametrize(("job_id", "key", "allowed"), [
    (f"acme.{HEX}", f"t/acme/inputs/{SHA}", True),
    (HEX, f"inputs/{SHA}", True),
    (f"acme.{HEX}", f"t/bob/inputs/{SHA}", False),     # another tenant's input
    (f"acme.{HEX}", f"inputs/{SHA}", False),           # the untenanted area
    (HEX, f"t/acme/inputs/{SHA}", False),              # an untenanted job reading a tenant's input
    (f"acme.{HEX}", f"t/acme-2/inputs/{SHA}", False),  # a tenant whose id starts with this one's
    (f"acme.{HEX}", f"t/acme/results/acme.{HEX}.json", False),
    (f"acme.{HEX}", f"t/acme/inputs/../../t/bob/inputs/{SHA}", False),
    (f"acme.{HEX}", f"t/acme/inputs/{SHA}\n", False),
    (HEX, "inputs/short", False),
])
def test_a_job_reads_only_an_input_of_its_own_tenant(job_id: str, key: str, allowed: bool) -> None:
    assert keys.input_key_allowed(job_id, key) is allowed


def test_a_job_names_only_a_batch_of_its_own_tenant_and_a_batch_lists_only_its_tenants_jobs() -> None:
    own, untenanted, batch = f"acme.{HEX}", HEX, f"acme.batch_{HEX}"
    assert keys.batch_id_allowed(own, batch) and keys.batch_id_allowed(untenanted, f"batch_{HEX}")
    refused = {own: [f"bob.batch_{HEX}", f"batch_{HEX}", f"acme-2.batch_{HEX}", batch + "x", batch + "\n", None],
               untenanted: [batch]}
    assert [(j, b) for j, ids in refused.items() for b in ids if keys.batch_id_allowed(j, b)] == []
    assert keys.batch_member_allowed(batch, own) and keys.batch_member_allowed(f"batch_{HEX}", untenanted)
    others = (f"bob.{HEX}", HEX, f"acme-2.{HEX}", "acme.x", None)
    assert [j for j in others if keys.batch_member_allowed(batch, j)] == []
    assert not keys.batch_member_allowed(f"batch_{HEX}", own)


@pytest.fixture
def acl_users(redis_client: Any) -> Iterator[Any]:
    users = [acl.tenant_user("acme"), acl.WORKER_USER]
    redis_client.execute_command("ACL", "SETUSER", *acl.setuser_args(users[0], "pw", acl.tenant_rules("acme")))
    redis_client.execute_command("ACL", "SETUSER", *acl.setuser_args(users[1], "pw", acl.worker_rules()))
    yield redis_client
    redis_client.execute_command("ACL", "DELUSER", *users)


def allowed(redis_client: Any, user: str, *command: str) -> bool:
    reply = redis_client.execute_command("ACL", "DRYRUN", user, *command)
    return reply in (b"OK", "OK")


def test_the_tenant_acl_allows_its_own_keys_and_the_queues_only(acl_users: Any) -> None:
    user, own, other = acl.tenant_user("acme"), f"acme.{HEX}", f"acme-2.{HEX}"
    queue = keys.queue("tiny-shapes", "xs") + ":5"
    yes = [("HGETALL", keys.job(own)), ("HSET", keys.job(own), "a", "b"), ("BLMOVE", keys.done(own), keys.done(own),
           "LEFT", "RIGHT", "1"), ("SET", keys.idempotency("k", "acme"), "v", "NX", "GET"), ("LPUSH", queue, "m"),
           ("LLEN", queue), ("FCALL", functions.function_name("transition"), "3", keys.job(own), keys.done(own),
                             keys.canceled(own)), ("PING",),
           ("FCALL", functions.function_name("enqueue"), "5", keys.job(own), queue, keys.wake(queue),
            keys.hot_input(keys.input_object(SHA, "acme"), "m"), keys.idempotency("k", "acme"))]
    no = [("HGETALL", keys.job(other)), ("HGETALL", keys.job(HEX)), ("GET", keys.idempotency("k", "acme-2")),
          ("GET", keys.idempotency("acme")), ("LRANGE", queue, "0", "-1"), ("RPOP", queue), ("SCAN", "0"),
          ("KEYS", "*"), ("LPUSH", keys.job(own) + "x", "m"), ("HSET", queue, "a", "b"),
          ("SADD", "_kombu.binding.x", "m"), ("HGETALL", "unacked"), ("FLUSHDB",), ("CONFIG", "GET", "*"),
          ("EVAL", "return 1", "1", keys.job(other)), ("SUBSCRIBE", "x"),
          ("FCALL", functions.function_name("transition"), "1", keys.job(other)),
          # no code of its own (issue 36 item 2): no script, no function loaded or replaced
          ("EVAL", "return 1", "2", keys.job(own), keys.canceled(own)), ("EVAL", "return 1", "0"),
          ("EVALSHA", "0" * 40, "0"), ("SCRIPT", "LOAD", "return 1"), ("FUNCTION", "LOAD", "#!lua name=x\n"),
          ("FUNCTION", "DELETE", functions.library()[0]), ("FUNCTION", "FLUSH"), ("FUNCTION", "RESTORE", "x"),
          ("FUNCTION", "KILL"), ("SCRIPT", "KILL")]
    assert [c for c in yes if not allowed(acl_users, user, *c)] == []
    assert [c for c in no if allowed(acl_users, user, *c)] == []


def test_the_worker_acl_reaches_vlmq_and_kombu_keys_but_no_admin_command(acl_users: Any) -> None:
    yes = [("HGETALL", keys.job(f"acme.{HEX}")), ("HGETALL", keys.job(HEX)), ("BRPOP", "vlmq.m.xs", "vlmq.m.xs:3", "1"),
           ("ZADD", "unacked_index", "1", "t"), ("SADD", "_kombu.binding.vlmq.m.xs", "m"), ("PSUBSCRIBE", "x*"),
           ("EVALSHA", "0" * 40, "1", "unacked_mutex"), ("DEL", "w@h.celery.pidbox:3")]
    no = [("GET", "other-app:key"), ("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "SET", "x", "y"), ("ACL", "LIST"),
          ("SHUTDOWN",), ("DEBUG", "SLEEP", "0")]
    assert [c for c in yes if not allowed(acl_users, acl.WORKER_USER, *c)] == []
    assert [c for c in no if allowed(acl_users, acl.WORKER_USER, *c)] == []


def test_a_tenant_runs_vlmqs_functions_and_no_code_of_its_own(acl_users: Any, redis_url: str,
                                                              tmp_path: Path) -> None:
    import redis

    parts = urlsplit(redis_url)
    url = urlunsplit(parts._replace(netloc=f"{acl.tenant_user('acme')}:pw@{parts.hostname}:{parts.port}"))
    raw = redis.Redis.from_url(url)
    try:
        # what held the server busy past its BUSY threshold and stopped workers: refused before it runs
        refused = [lambda: raw.eval("return 1", 0), lambda: raw.eval("while true do end", 0),
                   lambda: raw.script_load("return 1"), lambda: raw.function_flush(),
                   lambda: raw.function_delete(functions.library()[0]),
                   lambda: raw.function_load(functions.library()[1].replace("return cur", "return 'x'"), replace=True)]
        for call in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
    finally:
        raw.close()
    functions.load(acl_users)  # what a worker does when it starts
    with Client(url, f"file://{tmp_path}", tenant="acme") as client:  # submit and cancel: vlmq's own functions
        job = client.submit(png(), "What colour?", idempotency_key="k")
        assert job.cancel() and job.status() is JobStatus.CANCELED


@pytest.fixture
def tenant_client(redis_client: Any, redis_url: str, tmp_path: Path) -> Iterator[Client]:
    with Client(redis_url, f"file://{tmp_path / 'store'}", tenant="acme") as client:
        yield client


def test_a_tenants_client_names_everything_under_its_tenant(tenant_client: Client) -> None:
    job = tenant_client.submit(png(), "What colour?", idempotency_key="order-1")
    info = job.info()
    assert re.fullmatch(keys.JOB_ID_RE, job.id) and job.id.startswith("acme.")
    assert info["input_key"].startswith("t/acme/inputs/") and tenant_client.storage.exists(info["input_key"])
    assert tenant_client.redis.get(keys.idempotency("order-1", "acme")).decode().startswith(job.id)
    assert not tenant_client.redis.exists(keys.idempotency("order-1"))
    assert tenant_client.submit(png(), "What colour?", idempotency_key="order-1").id == job.id


def test_a_tenants_client_refuses_other_job_ids_before_asking_redis(tenant_client: Client) -> None:
    with Client(tenant_client.settings.broker_url, tenant_client.storage.url) as untenanted:
        foreign = [untenanted.submit(png(), "What colour?").id, tenant_client.submit(png(), "Hi?").id.replace(
            "acme.", "bob.")]
    for job_id in foreign + [f"acme-2.{HEX}", "acme", f"xacme.{HEX}"]:
        with pytest.raises(JobNotFound, match="tenant 'acme'"):
            tenant_client.job(job_id)
        with pytest.raises(JobNotFound):
            Job(tenant_client.store, job_id).cancel()
    assert untenanted.tenant is None


def test_a_tenants_storage_uris_must_lie_under_its_prefix(redis_client: Any, redis_url: str,
                                                          s3_storage_url: str, s3_server: Any) -> None:
    # s3:// URIs are read with the pool's credentials, so the prefix check is what keeps tenants apart
    # (a file:// URL is a local path the producer could read itself)
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        tenant="acme")
    with Client(settings=settings) as tenant_client:
        _submit_outside_the_prefix(tenant_client)


def _submit_outside_the_prefix(tenant_client: Client) -> None:
    root = tenant_client.storage.url
    tenant_client.storage.put("t/acme/uploads/a.png", png())
    tenant_client.storage.put("t/bob/uploads/b.png", png())
    tenant_client.storage.put("uploads/c.png", png())
    assert tenant_client.submit(f"{root}/t/acme/uploads/a.png", "What colour?").info()["input_key"].startswith(
        "t/acme/inputs/")
    for uri in (f"{root}/t/bob/uploads/b.png", f"{root}/uploads/c.png", f"{root}/t/acme-2/x.png"):
        with pytest.raises(InvalidRequest, match="outside tenant 'acme'") as err:
            tenant_client.submit(uri, "What colour?")
        assert err.value.code == "bad_image_source"


def test_a_refused_command_is_a_backend_error_that_hides_the_password(acl_users: Any, redis_url: str,
                                                                      tmp_path: Path) -> None:
    parts = urlsplit(redis_url)
    url = urlunsplit(parts._replace(netloc=f"{acl.tenant_user('acme')}:pw@{parts.hostname}:{parts.port}"))
    with Client(url, f"file://{tmp_path}") as client:  # acme's credentials, no tenant: Redis refuses
        with pytest.raises(BackendError, match="NOPERM|[Nn]o permissions") as err:
            client.job(HEX)
    assert ":pw@" not in str(err.value) and ":***@" in str(err.value)


def test_vlmq_acl_prints_the_users_and_the_tenants_storage_policy(tmp_path: Path) -> None:
    def run(*args: str) -> str:
        env = {"VLMQ_STORAGE_URL": "s3://bucket/pool", "PATH": ""}
        done = subprocess.run([sys.executable, "-m", "vlmq.cli", "acl", *args], capture_output=True, text=True,
                              env=env, check=True)
        return done.stdout

    tenant = run("--tenant", "acme", "--password", "secret")
    assert tenant.startswith("ACL SETUSER vlmq-tenant-acme reset on >secret ")
    assert "~vlmq:job:acme.* " in tenant and "'(~vlmq.*.* +lpush +llen)'" in tenant
    assert '"arn:aws:s3:::bucket/pool/t/acme/inputs/*"' in tenant
    assert run("--worker", "--acl-file", "--password", "w").startswith("user vlmq-worker reset on >w resetchannels &*")
    assert run("--tenant", "acme") != run("--tenant", "acme")  # a fresh random password each time
    bad = subprocess.run([sys.executable, "-m", "vlmq.cli", "acl", "--tenant", "Acme"], capture_output=True, text=True)
    assert bad.returncode == 2 and "tenant id" in bad.stderr
