"""Redis ACL users for a pool with tenants, generated from ``vlmq.keys`` (Valkey / Redis 7 ACL syntax).

A tenant's user may enqueue (``LPUSH`` onto the queue lists; ``LLEN`` for the queue limits), read and
write its own job records, done lists, cancel flags and idempotency keys, and read the affinity routes of
its own inputs (``%R~``: never write one), nothing else: no other tenant's keys, no reading queue
contents, no ``SCAN``/``KEYS``, no kombu or admin keys, and no code of its own (``FCALL`` of vlmq's functions,
never ``EVAL`` or ``FUNCTION``). The queue
commands sit in a selector, so they apply to the queue lists only and the record commands to the
tenant's keys only. The worker user reaches every vlmq and kombu key but no admin or dangerous command.

``vlmq acl --tenant acme`` and ``vlmq acl --worker`` print the commands; docs/security.md explains them.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from vlmq import keys

WORKER_USER = "vlmq-worker"
# what redis-py sends on connecting (AUTH or HELLO, library name, SELECT for a /<db> URL) and PING
CONNECTION_COMMANDS = ["hello", "auth", "ping", "client|setinfo", "client|setname", "select"]
# what the SDK runs on its own keys: records (HSET/EXPIRE/HGETALL), idempotency (SET NX GET; GET/DEL inside the
# release function), waiting (BLMOVE on the done list), the transition function (HGET, SET, HSET, EXPIRE, RPUSH,
# EXISTS, HINCRBY), reading webhook delivery attempts (LRANGE, ``Job.deliveries()``), affinity routes of its
# own inputs (GET, inside the enqueue function) and batches (HGETALL/HSET on its batch hash, RPUSH/LRANGE on its
# job list, GET/SET/DEL on its finalizer lease; MULTI/EXEC around a batch's creation; ZADD/ZREMRANGEBYSCORE/
# ZREVRANGE on its batch index, ``GET /v1/batches``). Scripts only as FCALL of
# vlmq's own functions (``vlmq.functions``): no EVAL, no FUNCTION (a tenant runs no code of its own)
TENANT_COMMANDS = ["hgetall", "hget", "hmget", "hset", "hincrby", "exists", "expire", "get", "set", "del", "blmove",
                   "rpush", "lrange", "fcall", "multi", "exec", "discard", "zadd", "zremrangebyscore", "zrevrange"]
# publishing is one LPUSH per message (see vlmq.wire); LLEN for queue limits
QUEUE_COMMANDS = ["lpush", "llen"]
# the wake token after a publish (vlmq.keys.wake): a latency hint, harmless to trim
WAKE_COMMANDS = ["lpush", "ltrim", "expire"]


def tenant_user(tenant: str) -> str:
    """The Redis user name of a tenant's producers."""
    return f"vlmq-tenant-{keys.check_tenant(tenant)}"


def tenant_rules(tenant: str) -> list[str]:
    """ACL rules for a tenant's producers (after ``reset on >password``)."""
    commands = " ".join(f"+{c}" for c in QUEUE_COMMANDS)
    return ["resetchannels", "-@all", *(f"+{c}" for c in CONNECTION_COMMANDS + TENANT_COMMANDS),
            *(f"~{p}" for p in keys.tenant_key_patterns(tenant)),
            *(f"%R~{p}" for p in keys.tenant_read_patterns(tenant)),  # routes: readable, never forged
            f"(~{keys.queue_pattern()} {commands})",
            f"(~{keys.wake_pattern()} {' '.join(f'+{c}' for c in WAKE_COMMANDS)})",
            # the enqueue function (vlmq.affinity) declares the job's record, its queue list, the wake list, its
            # input's route and its idempotency key; each command inside it is checked against the rules above (the
            # route: GET only)
            f"(~{keys.job(keys.tenant_job_id(tenant, '*'))} ~{keys.queue_pattern()} ~{keys.wake_pattern()} "
            f"{' '.join(f'~{p}' for p in keys.tenant_read_patterns(tenant))} ~{keys.idempotency('*', tenant)} "
            "+fcall)"]


def worker_rules() -> list[str]:
    """ACL rules for workers: every vlmq and kombu key and pub/sub channel; no admin or dangerous command."""
    return ["resetchannels", "&*", *(f"~{p}" for p in keys.worker_key_patterns()),
            "+@all", "-@admin", "-@dangerous"]


def setuser_args(user: str, password: str, rules: list[str]) -> list[str]:
    """Arguments of ``ACL SETUSER`` (after the command name) that (re)create ``user`` from scratch."""
    return [user, "reset", "on", f">{password}", *rules]


def render(user: str, password: str, rules: list[str], *, acl_file: bool = False) -> str:
    """One user as a ``redis-cli`` command (``ACL SETUSER ...``) or as an ACL file line (``user ...``)."""
    args = setuser_args(user, password, rules)
    if acl_file:
        return " ".join(["user", *args])
    return " ".join(["ACL", "SETUSER", *(f"'{a}'" if " " in a else a for a in args)])


def new_password() -> str:
    """A random password for a new user."""
    return secrets.token_urlsafe(24)


def tenant_s3_policy(storage_url: str, tenant: str) -> dict[str, Any]:
    """An IAM-style policy for a tenant's object-store credentials (S3 and most S3-compatible stores).

    The tenant may write and read its inputs, read its results, and write and read its batches' output and
    error files (``Batch.download``; its own client finalizes a batch when it sees every request ended), under
    ``<prefix>/t/<tenant>/`` only. The object store enforces it, not vlmq.
    """
    bucket, _, prefix = storage_url.removeprefix("s3://").partition("/")
    head = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    own = f"arn:aws:s3:::{bucket}/{head}{keys.storage_prefix(keys.check_tenant(tenant))}"
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject"], "Resource": [f"{own}inputs/*"]},
        {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"{own}results/*"]},
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject"], "Resource": [f"{own}batches/*"]},
    ]}


def describe(tenant: str | None, password: str, *, acl_file: bool = False, storage_url: str | None = None) -> str:
    """What ``vlmq acl`` prints: the tenant's user (or the worker user) and, for ``s3://``, the tenant's policy."""
    if tenant is None:
        return render(WORKER_USER, password, worker_rules(), acl_file=acl_file)
    text = render(tenant_user(tenant), password, tenant_rules(tenant), acl_file=acl_file)
    if storage_url and storage_url.startswith("s3://"):
        policy = json.dumps(tenant_s3_policy(storage_url, tenant), indent=2)
        text += f"\n# object-store policy for the tenant's credentials:\n{policy}"
    return text
