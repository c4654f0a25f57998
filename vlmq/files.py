"""Files (OpenAI's Files API) in the pool's object store: uploads for batches and each batch's result files.

Usage::

    obj = files.create(storage, "acme", fileobj, "requests.jsonl", "batch")   # -> OpenAI FileObject dict
    files.retrieve(storage, "acme", obj["id"]); files.content(storage, "acme", obj["id"])  # chunks of bytes
    files.list_files(storage, "acme", after=None, limit=20); files.delete(storage, "acme", obj["id"])

An upload is ``file-[<tenant>.]<32 hex>``: its bytes at ``keys.file_object`` and its description (filename,
purpose, bytes, created_at) beside them (``keys.file_meta``), written after the bytes, so a File is listed only
once whole. A batch's result files are ``file-<batch id>.output|errors`` (``keys.batch_file_id``), described from
the object itself. Every call takes the caller's tenant and answers ``FileNotFound`` for an id of another tenant,
exactly as for one that does not exist. Nothing here holds a File whole in memory.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any

from vlmq import keys
from vlmq.errors import JobNotFound
from vlmq.storage import Storage

PURPOSES = ("batch",)  # what may be uploaded (the rest of OpenAI's purposes serve features vlmq has not)


class FileNotFound(JobNotFound):
    """No such File for this tenant (never uploaded, deleted, another tenant's, or not an id)."""


def new_file_id(tenant: str | None) -> str:
    """A new upload's id."""
    return f"file-{keys.tenant_job_id(tenant, uuid.uuid4().hex)}"


def _checked(tenant: str | None, file_id: str) -> str:
    if not keys.file_id_allowed(file_id, tenant):
        raise FileNotFound(f"no file {file_id[:80]!r}")
    return file_id


def create(storage: Storage, tenant: str | None, f: IO[bytes], filename: str, purpose: str,
           size: int) -> dict[str, Any]:
    """Store an upload (``size``: its byte count, as the caller read it) and return its FileObject."""
    file_id = new_file_id(tenant)
    storage.put_file(keys.file_object(file_id), f)
    obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
           "purpose": purpose, "status": "processed", "status_details": None}
    storage.put(keys.file_meta(file_id), json.dumps(obj).encode())
    return obj


def _batch_file(file_id: str) -> bool:
    return file_id.endswith((".output", ".errors"))


def retrieve(storage: Storage, tenant: str | None, file_id: str) -> dict[str, Any]:
    """A File's FileObject.

    Raises:
        FileNotFound: no such File of this tenant.
    """
    key = keys.file_object(_checked(tenant, file_id))
    if not _batch_file(file_id):
        try:
            return dict(json.loads(storage.get(keys.file_meta(file_id))))
        except KeyError:
            raise FileNotFound(f"no file {file_id!r}") from None
    info = next((o for o in storage.list_objects(key) if o.key == key), None)
    if info is None:  # the batch has not ended yet, or its files were deleted
        raise FileNotFound(f"no file {file_id!r} (a batch's result files exist once it has ended)")
    name = "output.jsonl" if file_id.endswith(".output") else "errors.jsonl"
    return {"id": file_id, "object": "file", "bytes": info.size, "created_at": int(info.modified),
            "filename": name, "purpose": "batch_output", "status": "processed", "status_details": None}


def content(storage: Storage, tenant: str | None, file_id: str) -> Iterator[bytes]:
    """A File's bytes, a chunk at a time.

    Raises:
        FileNotFound: no such File of this tenant (raised before the first chunk).
    """
    retrieve(storage, tenant, file_id)  # an upload whose description is not yet written is not a File yet
    try:
        return storage.iter_bytes(keys.file_object(file_id))
    except KeyError:
        raise FileNotFound(f"no file {file_id!r}") from None


def delete(storage: Storage, tenant: str | None, file_id: str) -> dict[str, Any]:
    """Delete a File; returns OpenAI's deletion object.

    Raises:
        FileNotFound: no such File of this tenant.
    """
    retrieve(storage, tenant, file_id)
    if not _batch_file(file_id):
        storage.delete(keys.file_meta(file_id))
    storage.delete(keys.file_object(file_id))
    return {"id": file_id, "object": "file", "deleted": True}


def list_files(storage: Storage, tenant: str | None, *, after: str | None, limit: int,
               purpose: str | None = None) -> dict[str, Any]:
    """A page of the tenant's uploads (newest first, ``after`` a File id of the previous page), as OpenAI's list."""
    found = []
    for info in storage.list_objects(keys.files_prefix(tenant)):
        if info.key.endswith(".json"):
            obj = json.loads(storage.get(info.key))
            if purpose is None or obj["purpose"] == purpose:
                found.append(obj)
    found.sort(key=lambda o: (-o["created_at"], o["id"]))
    if after:
        ids = [o["id"] for o in found]
        found = found[ids.index(after) + 1:] if after in ids else []
    page = found[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit}
