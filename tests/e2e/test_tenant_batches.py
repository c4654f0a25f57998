"""Batches of two tenants on one pool, where the object store enforces IAM (``iams3``) and Redis the ACL users.

A tenant writes its own batch hash, job list and job records, so everything a finalizer reads from them is
checked (issue 36 item 1): no other tenant's job is ever copied into its files, and one finalization reads no more
than the batch can hold. A tenant's credentials, limited by the object-store policy ``vlmq acl`` prints, reach
its batch files (item 8). One real worker, as the worker user with the bucket's credentials, serves both.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import iams3
import pytest
from test_tenants import make_users, png, with_user
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import acl, keys
from vlmq.client import Client
from vlmq.settings import Settings
from vlmq.wire import MessageWriter, list_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TENANTS = ("acme", "bob")
STORAGE = f"s3://{iams3.BUCKET}/pool"


@dataclass
class Pool:
    settings: Settings  # untenanted: the default Redis user and the bucket's credentials
    urls: dict[str, str]  # tenant -> broker URL with its ACL user
    creds: dict[str, dict[str, str]]  # principal -> AWS_* variables
    worker: WorkerProcess
    admin: Any

    def client(self, tenant: str | None) -> Client:
        if tenant is None:
            with iams3.signing_as(self.creds[iams3.FULL]):
                return Client(settings=self.settings)
        settings = dataclasses.replace(self.settings, broker_url=self.urls[tenant], tenant=tenant)
        with iams3.signing_as(self.creds[tenant]):
            return Client(settings=settings)

    def raw(self, tenant: str) -> Any:
        import redis

        return redis.Redis.from_url(self.urls[tenant])

    def env(self, tenant: str) -> dict[str, str]:
        """What a tenant's shell holds: its broker URL and tenant id, and its object-store credentials."""
        settings = dataclasses.replace(self.settings, broker_url=self.urls[tenant], tenant=tenant)
        return {**os.environ, **settings.to_env(), **self.creds[tenant]}


def printed_policy(tenant: str) -> dict[str, Any]:
    """The object-store policy ``vlmq acl --tenant`` prints after the tenant's ACL user."""
    done = subprocess.run([sys.executable, "-m", "vlmq.cli", "acl", "--tenant", tenant], capture_output=True,
                          text=True, check=True, env={**os.environ, "VLMQ_STORAGE_URL": STORAGE})
    return dict(json.loads(done.stdout.split("# object-store policy for the tenant's credentials:\n", 1)[1]))


@pytest.fixture(scope="module")
def pool(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    import redis

    server, creds = iams3.start({t: printed_policy(t) for t in TENANTS})
    admin = redis.Redis.from_url(redis_url)
    admin.flushdb()
    users, passwords = make_users(admin, TENANTS)
    settings = Settings(broker_url=redis_url, storage_url=STORAGE, s3_endpoint_url=server.url,
                        cost_classes=TINY_CLASSES)
    worker_url = with_user(redis_url, acl.WORKER_USER, passwords[acl.WORKER_USER])
    worker = WorkerProcess(dataclasses.replace(settings, broker_url=worker_url),
                           tmp_path_factory.mktemp("tenant-batches") / "worker.log", "--name", "batches-worker",
                           env=creds[iams3.FULL])
    urls = {t: with_user(redis_url, acl.tenant_user(t), passwords[acl.tenant_user(t)]) for t in TENANTS}
    try:
        worker.wait_ready()
        yield Pool(settings, urls, creds, worker, admin)
    finally:
        worker.stop()
        admin.execute_command("ACL", "DELUSER", *users)
        admin.close()
        server.stop()


def forged_job(acme: Client, batch_id: str) -> tuple[str, dict[str, str]]:
    """A job record of acme's naming ``batch_id``, written with acme's credentials alone (not yet published)."""
    template = acme.submit(png((0, 250, 250)), "What colour is the image?", max_new_tokens=4)
    template.result(timeout=300)
    job_id = keys.tenant_job_id("acme", uuid.uuid4().hex)
    record = {**template.info(), "id": job_id, "status": "queued", "batch_id": batch_id, "custom_id": "mine"}
    record = {k: v for k, v in record.items() if not k.endswith("_at") or k in ("created_at", "queued_at")}
    acme.redis.hset(keys.job(job_id), mapping=record)
    acme.redis.expire(keys.job(job_id), 600)
    return job_id, record


def publish(acme: Client, job_id: str, record: dict[str, str]) -> None:
    """The job's message, published as the SDK does (``vlmq.wire``) with acme's credentials."""
    priority = int(record["priority"])
    acme.redis.lpush(list_for(record["queue"], priority), MessageWriter().message(job_id, record["queue"], priority))


def forge_batch(raw: Any, total: int, *listed: str) -> str:
    """A batch of acme's in progress, its hash and job list written with acme's credentials."""
    batch_id = keys.new_batch_id("acme", uuid.uuid4().hex)
    raw.hset(keys.batch(batch_id), mapping={"id": batch_id, "status": "in_progress", "total": total})
    raw.expire(keys.batch(batch_id), 600)
    for start in range(0, len(listed), 10_000):
        raw.rpush(keys.batch_jobs(batch_id), *listed[start:start + 10_000])
    raw.expire(keys.batch_jobs(batch_id), 600)
    return batch_id


def finalized_files(pool: Pool, batch_id: str) -> bytes:
    """The batch's output and error files as the operator reads them, once acme's client sees it ended."""
    with pool.client("acme") as acme:
        assert acme.batch(batch_id).wait(timeout=120)["status"] == "completed"
    with pool.client(None) as operator:
        return b"".join(operator.storage.get(keys.batch_object(batch_id, name)) for name in ("output.jsonl",
                                                                                            "errors.jsonl"))


def test_a_forged_batch_list_never_copies_another_tenants_job_into_the_files(pool: Pool) -> None:
    with pool.client("bob") as bob:
        secret = bob.submit(png((250, 0, 0)), "What colour is the image?", max_new_tokens=6)
        secret.result(timeout=300)
    raw = pool.raw("acme")
    try:
        batch_id = forge_batch(raw, 1, secret.id)  # bob's job id in acme's own list: acme's ACL allows the write
    finally:
        raw.close()
    with pool.client("acme") as acme:
        job_id, record = forged_job(acme, batch_id)
        publish(acme, job_id, record)  # an ordinary job of acme's whose record names that batch
        acme.job(job_id).result(timeout=300)
    files = finalized_files(pool, batch_id)
    assert secret.id.encode() not in files and b"bob" not in files
    assert pool.worker.alive()


def test_one_finalization_reads_no_more_than_its_batch_holds(pool: Pool) -> None:
    raw = pool.raw("acme")
    try:
        with pool.client("acme") as acme:
            job_id, record = forged_job(acme, "")
            filler = [keys.tenant_job_id("acme", uuid.uuid4().hex) for _ in range(100_000)]
            batch_id = forge_batch(raw, 1, job_id, *filler)  # total 1, a list of 100,001
            acme.redis.hset(keys.job(job_id), "batch_id", batch_id)
            reads = pool.admin.info("commandstats")["cmdstat_hgetall"]["calls"]
            publish(acme, job_id, record)
            acme.job(job_id).result(timeout=300)
    finally:
        raw.close()
    files = finalized_files(pool, batch_id)
    assert pool.admin.info("commandstats")["cmdstat_hgetall"]["calls"] - reads < 1000  # not one per listed id
    assert [json.loads(line)["custom_id"] for line in files.splitlines()] == ["mine"]


def test_a_tenant_downloads_its_batch_files_with_the_policy_vlmq_acl_prints(pool: Pool, tmp_path: Path) -> None:
    image = "data:image/png;base64," + base64.b64encode(png((0, 0, 250))).decode()
    content = [{"type": "text", "text": "What colour is the image?"},
               {"type": "image_url", "image_url": {"url": image}}]
    body = {"model": "tiny-shapes", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": body}) + "\n" for i in range(2)))

    def vlmq(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "vlmq.cli", "batch", *args], capture_output=True, text=True,
                              env=pool.env("acme"), timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    batch_id = vlmq("submit", str(path)).split()[0]
    assert batch_id.startswith("acme.batch_")
    vlmq("wait", batch_id)
    vlmq("download", batch_id, "--output-dir", str(tmp_path))
    output = (tmp_path / f"{batch_id}_output.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["req-0", "req-1"]
    assert (tmp_path / f"{batch_id}_errors.jsonl").read_text() == ""
