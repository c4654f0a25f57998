"""Two tenants on one pool: real Valkey with the ACL users ``vlmq.acl`` generates, moto S3, one real worker.

The worker runs as the ACL worker user and serves both tenants; each tenant's producers connect as
that tenant's ACL user. What a tenant is refused, and how:

* through its own client (``Client(tenant=...)``): another tenant's job id is ``JobNotFound``, before
  Redis is asked; an ``s3://`` input outside its prefix is ``InvalidRequest(bad_image_source)``;
* through any code holding its credentials (an untenanted client, raw commands): Redis refuses
  (``NOPERM``), which the SDK raises as ``BackendError``;
* through a forged record naming another tenant's input: the worker fails that job with ``bad_input_key``.

Object-store isolation of results is the store's policy (``vlmq.acl.tenant_s3_policy``): moto does not
check IAM, so it is not tested here.
"""
from __future__ import annotations

import dataclasses
import io
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from PIL import Image
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import acl, keys
from vlmq.client import Client
from vlmq.errors import BackendError, InvalidRequest, JobFailed, JobNotFound
from vlmq.jobs import Job, JobStatus
from vlmq.settings import Settings
from vlmq.wire import MessageWriter, list_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TENANTS = ("acme", "bob")
BUCKET, PREFIX = "vlmq-test", "tenants"


def png(colour: tuple[int, int, int], size: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return buf.getvalue()


def with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


def make_users(admin: Any, tenants: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """The ACL users ``vlmq acl`` generates for ``tenants`` and the workers, with fresh passwords."""
    users = {acl.tenant_user(t): acl.tenant_rules(t) for t in tenants} | {acl.WORKER_USER: acl.worker_rules()}
    passwords = {user: acl.new_password() for user in users}
    for user, rules in users.items():
        admin.execute_command("ACL", "SETUSER", *acl.setuser_args(user, passwords[user], rules))
    return list(users), passwords


@dataclass
class Pool:
    settings: Settings  # untenanted, the default (full-access) user
    urls: dict[str, str]  # tenant -> broker URL with its ACL user
    worker: WorkerProcess
    admin: Any  # redis.Redis as the default user

    def client(self, tenant: str, *, scoped: bool = True) -> Client:
        """A tenant's client; ``scoped=False`` holds the tenant's credentials without telling the SDK the tenant."""
        settings = dataclasses.replace(self.settings, broker_url=self.urls[tenant], tenant=tenant if scoped else "")
        return Client(settings=settings)

    def raw(self, tenant: str) -> Any:
        """A plain Redis connection with the tenant's credentials."""
        import redis

        return redis.Redis.from_url(self.urls[tenant])


@pytest.fixture(scope="module")
def pool(redis_url: str, s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    import redis

    admin = redis.Redis.from_url(redis_url)
    admin.flushdb()
    users, passwords = make_users(admin, TENANTS)
    settings = Settings(broker_url=redis_url, storage_url=f"s3://{BUCKET}/{PREFIX}", s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES)
    worker_url = with_user(redis_url, acl.WORKER_USER, passwords[acl.WORKER_USER])
    # the worker alone holds the archive key: its archive takes part in test_tenant_cache's isolation
    worker = WorkerProcess(dataclasses.replace(settings, broker_url=worker_url, kv_archive_key="k" * 32),
                           tmp_path_factory.mktemp("tenants") / "worker.log", "--name", "tenants-worker")
    urls = {t: with_user(redis_url, acl.tenant_user(t), passwords[acl.tenant_user(t)]) for t in TENANTS}
    try:
        worker.wait_ready()
        yield Pool(settings, urls, worker, admin)
    finally:
        worker.stop()
        admin.execute_command("ACL", "DELUSER", *users)
        admin.close()


def acl_refusals(admin: Any) -> list[dict[str, Any]]:
    return [{(k.decode() if isinstance(k, bytes) else k): v for k, v in dict(entry).items()}
            for entry in admin.execute_command("ACL", "LOG")]


def test_each_tenants_jobs_finish_under_its_own_ids_keys_and_prefix(pool: Pool) -> None:
    pool.admin.execute_command("ACL", "LOG", "RESET")
    jobs: dict[str, list[Job]] = {}
    for i, tenant in enumerate(TENANTS):
        with pool.client(tenant) as client:
            jobs[tenant] = [client.submit(png((200, 40 * i, 40 * k)), "What colour is the image?", max_new_tokens=6,
                                          idempotency_key=f"order-{k}") for k in range(2)]
            results = [job.result(timeout=300) for job in jobs[tenant]]
            for job, result in zip(jobs[tenant], results, strict=True):
                assert re.fullmatch(keys.JOB_ID_RE, job.id) and job.id.startswith(f"{tenant}.")
                assert result.job_id == job.id and result.worker == "tenants-worker"
                assert job.info()["input_key"].startswith(f"t/{tenant}/inputs/")
                assert client.storage.exists(f"t/{tenant}/results/{job.id}.json")
                assert job.deliveries() == []  # its webhook attempts are readable with its own credentials
    with Client(settings=pool.settings) as operator:
        listed = operator.storage.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/t/")
    stored = {o["Key"] for o in listed["Contents"]}
    for tenant, own in jobs.items():
        assert {f"{PREFIX}/t/{tenant}/results/{job.id}.json" for job in own} <= stored
    # neither the worker nor a tenant's own work needed anything its ACL user lacks (redis-py would hide a
    # refused CLIENT SETINFO; the ACL log would not)
    assert acl_refusals(pool.admin) == []
    assert pool.worker.alive()


def test_a_tenant_is_refused_the_other_tenants_record_status_result_and_cancel(pool: Pool) -> None:
    with pool.client("bob") as bob:
        finished = bob.submit(png((0, 0, 250)), "What colour is the image?", max_new_tokens=4)
        finished.result(timeout=300)
        ids = [finished.id, bob.submit(png((0, 250, 0)), "Describe the image.", max_new_tokens=4).id]
    with pool.client("acme") as acme:  # the tenant's own client: not its job
        for job_id in ids:
            with pytest.raises(JobNotFound, match="tenant 'acme'"):
                acme.job(job_id)
            handle = Job(acme.store, job_id)
            for call in (handle.info, handle.status, lambda h=handle: h.result(timeout=1), handle.cancel,
                         handle.deliveries):
                with pytest.raises(JobNotFound):
                    call()
    with pool.client("acme", scoped=False) as acme:  # the tenant's credentials without the SDK's check: Redis refuses
        for job_id in ids:
            handle = Job(acme.store, job_id)
            for call in (handle.info, handle.status, lambda h=handle: h.result(timeout=1), handle.cancel,
                         handle.deliveries):
                with pytest.raises(BackendError, match="NOPERM|[Nn]o permissions"):
                    call()
    with pool.client("bob") as bob:  # nothing the refused calls tried happened
        assert bob.job(ids[0]).status() is JobStatus.FINISHED
        assert bob.job(ids[1]).result(timeout=300).job_id == ids[1]


def test_idempotency_keys_are_per_tenant(pool: Pool) -> None:
    with pool.client("bob") as bob:
        bobs = bob.submit(png((10, 10, 10)), "How many shapes?", max_new_tokens=4, idempotency_key="invoice-9")
    with pool.client("acme") as acme:
        # the same key with another request is acme's own fresh job: neither bob's job nor a conflict that
        # would tell acme the key is in use
        mine = acme.submit(png((90, 90, 90)), "How many shapes?", max_new_tokens=4, idempotency_key="invoice-9")
        assert mine.id != bobs.id and mine.id.startswith("acme.")
        again = acme.submit(png((90, 90, 90)), "How many shapes?", max_new_tokens=4, idempotency_key="invoice-9")
        assert again.id == mine.id  # acme's key, bound to acme's first request
        with pytest.raises(InvalidRequest) as err:
            acme.submit(png((20, 20, 20)), "Other question?", max_new_tokens=4, idempotency_key="invoice-9")
        assert err.value.code == "idempotency_conflict" and bobs.id not in str(err.value)
        assert mine.result(timeout=300).job_id == mine.id
    raw = pool.raw("acme")
    try:
        with pytest.raises(Exception, match="NOPERM|[Nn]o permissions"):
            raw.get(keys.idempotency("invoice-9", "bob"))
    finally:
        raw.close()
    with pool.client("acme", scoped=False) as acme, pytest.raises(BackendError, match="NOPERM|[Nn]o permissions"):
        acme.submit(png((10, 10, 10)), "How many shapes?", max_new_tokens=4, idempotency_key="invoice-9")


def test_a_tenant_cannot_submit_an_input_from_outside_its_prefix(pool: Pool) -> None:
    with pool.client("bob") as bob:
        bobs = bob.submit(png((1, 2, 3)), "What colour is the image?", max_new_tokens=4)
        bob_input = bobs.info()["input_key"]
        bob.storage.put("t/bob/private/photo.png", png((4, 5, 6)))
    with pool.client("acme") as acme:
        foreign = [f"s3://{BUCKET}/{PREFIX}/{bob_input}", f"s3://{BUCKET}/{PREFIX}/t/bob/private/photo.png",
                   f"s3://{BUCKET}/{PREFIX}/t/acme/../bob/private/photo.png", f"s3://{BUCKET}/{PREFIX}/private.png"]
        for uri in foreign:
            with pytest.raises(InvalidRequest) as err:
                acme.submit(uri, "What colour is the image?")
            assert err.value.code == "bad_image_source", uri
        acme.storage.put("t/acme/private/photo.png", png((7, 8, 9)))
        own = acme.submit(f"s3://{BUCKET}/{PREFIX}/t/acme/private/photo.png", "What colour is the image?",
                          max_new_tokens=4)
        assert own.result(timeout=300).job_id == own.id
        assert own.info()["input_key"].startswith("t/acme/inputs/")


def test_a_forged_record_cannot_make_the_worker_serve_another_tenants_input(pool: Pool) -> None:
    with pool.client("bob") as bob:
        bob_input = bob.submit(png((250, 250, 0)), "What colour is the image?", max_new_tokens=4).info()["input_key"]
    with pool.client("acme") as acme:
        template = acme.submit(png((0, 250, 250)), "What colour is the image?", max_new_tokens=4)
        template.result(timeout=300)
        forged_id = keys.tenant_job_id("acme", uuid.uuid4().hex)
        record = {**template.info(), "id": forged_id, "status": "queued", "input_key": bob_input}
        record = {k: v for k, v in record.items() if not k.endswith("_at") or k in ("created_at", "queued_at")}
        acme.redis.hset(keys.job(forged_id), mapping=record)  # the tenant's credentials allow its own records
        acme.redis.expire(keys.job(forged_id), 600)
        priority = int(record["priority"])  # published as the SDK does (vlmq.wire), with the tenant's credentials
        acme.redis.lpush(list_for(record["queue"], priority), MessageWriter().message(forged_id, record["queue"],
                                                                                      priority))
        with pytest.raises(JobFailed) as err:
            acme.job(forged_id).result(timeout=300)
        assert err.value.error_type == "bad_input_key" and not err.value.retryable
        assert not acme.storage.exists(keys.result_object(forged_id))
        after = acme.submit(png((0, 250, 250)), "What colour is the image?", max_new_tokens=4)
        assert after.result(timeout=300).job_id == after.id  # the worker carries on
    assert pool.worker.alive()


def test_a_tenants_credentials_cannot_scan_read_write_or_steal_anything_else(pool: Pool) -> None:
    import redis

    with pool.client("bob") as bob:
        bobs = bob.submit(png((3, 3, 3)), "What colour is the image?", max_new_tokens=4)
        bobs.result(timeout=300)
        # bob reads the route of his own input: the worker that served it holds it hot
        again = bob.submit(png((3, 3, 3)), "Is it dark?", max_new_tokens=4).info()["queue"]
        assert again == keys.worker_queue("tiny-shapes", again.split(".")[2], "tenants-worker")
    acme_route = keys.hot_input(keys.input_object("a" * 64, "acme"), "tiny-shapes")
    bobs_route = keys.hot_input(bobs.info()["input_key"], "tiny-shapes")
    with pool.client("acme") as acme:
        own = acme.submit(png((5, 5, 5)), "What colour is the image?", max_new_tokens=4)
        queue = own.info()["queue"]
    raw = pool.raw("acme")
    refused = [
        lambda: raw.scan(0), lambda: raw.keys("*"), lambda: raw.hgetall(keys.job(bobs.id)),
        lambda: raw.hset(keys.job(bobs.id), "status", "canceled"), lambda: raw.delete(keys.job(bobs.id)),
        lambda: raw.set(keys.canceled(bobs.id), 1), lambda: raw.lrange(queue, 0, -1), lambda: raw.rpop(queue),
        lambda: raw.hgetall("unacked"), lambda: raw.sadd("_kombu.binding." + queue, "x"),
        lambda: raw.eval("return redis.call('HGETALL', KEYS[1])", 1, keys.job(bobs.id)),
        lambda: raw.eval(f"return redis.call('HGETALL', '{keys.job(bobs.id)}')", 0),
        lambda: raw.lpush(keys.done(bobs.id), "finished"), lambda: raw.config_get("*"),
        lambda: raw.execute_command("ACL", "LIST"), lambda: raw.flushdb(),
        lambda: raw.set(acme_route, "elsewhere xs"), lambda: raw.get(bobs_route),  # routes: read own, forge none
    ]
    try:
        for call in refused:  # NoPermissionError; a script's own refusal is a ResponseError that says why
            with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|[Nn]o permissions"):
                call()
        assert raw.hgetall(keys.job(own.id))[b"status"]  # its own record stays readable
        assert raw.llen(queue) >= 0 and raw.get(acme_route) is None
    finally:
        raw.close()
    with pool.client("bob") as bob:
        assert bob.job(bobs.id).result(timeout=60).job_id == bobs.id


def test_an_untenanted_client_works_as_before_and_reaches_every_job(pool: Pool) -> None:
    with pool.client("acme") as acme:
        tenant_job = acme.submit(png((60, 60, 60)), "What colour is the image?", max_new_tokens=4)
    with Client(settings=pool.settings) as client:
        assert client.tenant is None
        job = client.submit(png((60, 60, 60)), "What colour is the image?", max_new_tokens=4, idempotency_key="k1")
        assert re.fullmatch("[0-9a-f]{32}", job.id)
        assert job.info()["input_key"].startswith("inputs/")
        assert client.submit(png((60, 60, 60)), "What colour is the image?", max_new_tokens=4,
                             idempotency_key="k1").id == job.id
        assert job.result(timeout=300).job_id == job.id
        assert client.storage.exists(f"results/{job.id}.json")
        assert pool.admin.exists(keys.idempotency("k1"))  # untenanted keys keep their names
        assert client.job(tenant_job.id).result(timeout=300).job_id == tenant_job.id  # the operator sees all
