"""Object storage behind one interface: ``s3://bucket/prefix`` (boto3) and ``file:///dir``.

Inputs are content-addressed (``inputs/<sha256>``) and written with ``put_addressed``, unless the store vouches
that the address already holds them (``holds``: S3's SHA-256 checksum, or the file's hash); workers check the
hash again on reading. Results are written once (``put_if_absent``: a conditional put on S3, an atomic hard
link on files).
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

from vlmq.errors import BackendError

CHUNK_BYTES = 1 << 20  # what put_file and iter_bytes hold at a time


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object, as a listing reports it."""

    key: str
    size: int  # bytes
    modified: float  # seconds since the epoch (last write)


class Storage(ABC):
    """Minimal object store used for inputs, results and archived KV."""

    url: str

    @abstractmethod
    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order (the KV archive's bound, cache stats)."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store ``data`` only if ``key`` is free. Returns True if this call wrote it."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the object's bytes. Raises KeyError if there is none."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""

    def put_addressed(self, key: str, data: bytes) -> None:
        """Store a content-addressed object (an input) so that :meth:`holds` can vouch for it later."""
        self.put(key, data)

    @abstractmethod
    def holds(self, key: str, sha256: str) -> bool:
        """Whether ``key`` holds exactly the bytes whose SHA-256 is ``sha256`` (hex), as the store vouches.

        Anyone with write access may have put other bytes under a content address, so "an object exists" does
        not prove it holds its content; False sends the caller to write it again.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object if present."""

    @abstractmethod
    def put_file(self, key: str, f: IO[bytes]) -> None:
        """Store a binary file's bytes under ``key``, read a chunk at a time (S3: a multipart upload)."""

    @abstractmethod
    def iter_bytes(self, key: str, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The object's bytes, a chunk at a time. Raises KeyError (before the first chunk) if there is none."""

    def list_older(self, prefix: str, before: float) -> Iterator[str]:
        """Keys under ``prefix`` (e.g. ``inputs/``) of objects last written before ``before``.

        Objects whose names this interface refuses as keys (``a//b``, written by other tools) are left out.

        Args:
            prefix: a key prefix ending in ``/``.
            before: a timestamp (seconds since the epoch); newer objects are left out.

        Raises:
            ValueError: a bad prefix.
            BackendError: the store failed.
        """
        for obj in self.list_objects(_check_prefix(prefix)):
            if obj.modified < before and _is_key(obj.key):
                yield obj.key

    @abstractmethod
    def key_of(self, uri: str) -> str:
        """The key of the object a URI names in this store.

        Raises:
            ValueError: the URI names no object in this store (another bucket, prefix or folder).
        """

    @abstractmethod
    def get_capped(self, key: str, max_bytes: int) -> bytes:
        """Return the object's bytes, reading at most ``max_bytes + 1`` of them.

        Raises:
            KeyError: no such object.
            ObjectTooLarge: the object holds more than ``max_bytes`` bytes.
        """

    def presigned_url(self, key: str, expires: int) -> str | None:
        """A URL that reads the object without credentials for ``expires`` seconds (None where the store has none)."""
        return None

    def read_uri(self, uri: str, max_bytes: int) -> bytes:
        """Read the object a URI names in this store (``s3://bucket/prefix/key``, ``file:///dir/key``).

        Args:
            uri: the object's URI.
            max_bytes: most bytes accepted; a larger object is refused without reading it all.

        Raises:
            ValueError: the URI is not in this store.
            KeyError: no such object.
            ObjectTooLarge: the object holds more than ``max_bytes`` bytes.
            BackendError: the store failed.
        """
        return self.get_capped(self.key_of(uri), max_bytes)


class ObjectTooLarge(ValueError):
    """A stored object is larger than the caller accepts.

    Attributes:
        size: its size in bytes, or None where the store did not say.
    """

    def __init__(self, key: str, size: int | None, max_bytes: int) -> None:
        super().__init__(f"{key} has {'more than ' if size is None else ''}{size or max_bytes} bytes; "
                         f"the limit is {max_bytes}")
        self.size = size


def _chunks(f: Any, size: int) -> Iterator[bytes]:
    """A binary file's bytes, ``size`` at a time; the file is closed at the end (or when the reader stops)."""
    with f:
        while block := f.read(size):
            yield bytes(block)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad storage key {key!r}")
    return key


def _is_key(key: str) -> bool:
    try:
        return bool(_check_key(key))
    except ValueError:
        return False


def _check_prefix(prefix: str) -> str:
    if not prefix.endswith("/"):
        raise ValueError(f"a key prefix ends with '/', got {prefix!r}")
    _check_key(prefix[:-1])
    return prefix


def _key_in_store(uri: str, store_url: str, key: str | None) -> str:
    try:
        return _check_key(key or "")
    except ValueError:
        raise ValueError(f"{uri} is not in this pool's storage ({store_url})") from None


class FileStorage(Storage):
    """Objects as files under a local directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _write_temp(self, key: str, data: bytes) -> Path:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fdatasync(f.fileno())  # the data (and the size needed to read it back) is on disk
        return Path(tmp)

    def put(self, key: str, data: bytes) -> None:
        os.replace(self._write_temp(key, data), self._path(key))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        tmp = self._write_temp(key, data)
        try:
            os.link(tmp, self._path(key))  # atomic: fails if the name exists
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def holds(self, key: str, sha256: str) -> bool:
        digest = hashlib.sha256()
        try:
            with self._path(key).open("rb") as f:
                while chunk := f.read(64 << 10):  # read(n) allocates n bytes, however small the file
                    digest.update(chunk)
        except (FileNotFoundError, IsADirectoryError):
            return False
        return digest.hexdigest() == sha256

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def put_file(self, key: str, f: IO[bytes]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(f, out, CHUNK_BYTES)
            out.flush()
            os.fdatasync(out.fileno())
        os.replace(tmp, path)

    def iter_bytes(self, key: str, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        try:
            f = self._path(key).open("rb")
        except FileNotFoundError:
            raise KeyError(key) from None
        return _chunks(f, chunk)

    def list_older(self, prefix: str, before: float) -> Iterator[str]:
        # its own walk, not list_objects: it streams (no sort) and keeps the temp files of a crashed put
        top = self.root / _check_prefix(prefix)
        for folder, _, files in os.walk(top):
            for name in files:
                path = Path(folder) / name
                try:
                    if path.stat().st_mtime < before:
                        yield path.relative_to(self.root).as_posix()
                except FileNotFoundError:  # deleted or replaced since the walk listed it
                    continue

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return
        found = []
        for path in base.rglob("*"):
            key = path.relative_to(self.root).as_posix()
            if key.startswith(prefix) and not path.name.startswith(".tmp-") and path.is_file():
                st = path.stat()
                found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        yield from sorted(found, key=lambda o: o.key)  # in key order, as S3 lists

    def key_of(self, uri: str) -> str:
        parsed = urlparse(uri)
        path = Path(unquote(parsed.netloc + parsed.path))
        inside = parsed.scheme == "file" and path.is_relative_to(self.root)
        return _key_in_store(uri, self.url, path.relative_to(self.root).as_posix() if inside else None)

    def get_capped(self, key: str, max_bytes: int) -> bytes:
        try:
            with self._path(key).open("rb") as f:
                data = f.read(max_bytes + 1)
        except (FileNotFoundError, IsADirectoryError):
            raise KeyError(key) from None
        if len(data) > max_bytes:
            raise ObjectTooLarge(key, None, max_bytes)
        return data


class S3Storage(Storage):
    """Objects in an S3-compatible bucket under a key prefix."""

    page_size = 1000  # keys per ListObjectsV2 call (S3's own maximum)

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, client: Any = None,
                 timeout: float = 30.0) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        # ``timeout`` bounds each socket wait, so a frozen store fails a call in about 3 x timeout (botocore's
        # retries) instead of hanging: workers retry it within VLMQ_STORAGE_RETRY, then hand the job back
        config = Config(connect_timeout=min(5.0, timeout), read_timeout=timeout,
                        retries={"max_attempts": 3, "mode": "standard"})
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url, config=config)

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, method: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except ClientError:
            raise
        except BotoCoreError as e:
            raise BackendError(f"object store {self.url} failed: {e}") from e

    def put(self, key: str, data: bytes) -> None:
        self._put(key, data)

    def _put(self, key: str, data: bytes, **extra: Any) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("put_object", Key=self._key(key), Body=data, **extra)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise FileExistsError(key) from e
            raise BackendError(f"object store {self.url} refused {key}: {e}") from e

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self._put(key, data, IfNoneMatch="*")
            return True
        except FileExistsError:
            return False

    def _get_object(self, key: str) -> Any:
        from botocore.exceptions import ClientError

        try:
            return self._call("get_object", Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise KeyError(key) from None
            raise BackendError(f"object store {self.url} failed reading {key}: {e}") from e

    def get(self, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError

        body = self._get_object(key)["Body"]
        try:
            return bytes(body.read())
        except (BotoCoreError, OSError) as e:  # the store froze or went away mid-body
            raise BackendError(f"object store {self.url} failed reading {key}: {e}") from e

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call("head_object", Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return False
            raise BackendError(f"object store {self.url} failed: {e}") from e

    def put_addressed(self, key: str, data: bytes) -> None:
        # S3 checks the SHA-256 checksum against the bytes it receives and keeps it with the object
        self._put(key, data, ChecksumAlgorithm="SHA256")

    def holds(self, key: str, sha256: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            head = self._call("head_object", Key=self._key(key), ChecksumMode="ENABLED")
        except ClientError as e:
            # 403 too: S3 answers it for an absent key to a caller without s3:ListBucket (a tenant's credentials),
            # and moto 5.2.6 checks HEAD as an action of its own; unproven, so written again (a write that is not
            # allowed either then fails loudly)
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound", "403", "Forbidden",
                                                           "AccessDenied"):
                return False
            raise BackendError(f"object store {self.url} failed: {e}") from e
        # absent where the object was written without it (or by a store that keeps none): written again
        return bool(head.get("ChecksumSHA256") == base64.b64encode(bytes.fromhex(sha256)).decode())

    def put_file(self, key: str, f: IO[bytes]) -> None:
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        config = TransferConfig(multipart_chunksize=8 * CHUNK_BYTES, max_concurrency=4)
        try:
            self.client.upload_fileobj(f, self.bucket, self._key(key), Config=config)
        except (BotoCoreError, ClientError) as e:
            raise BackendError(f"object store {self.url} failed writing {key}: {e}") from e

    def iter_bytes(self, key: str, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        body = self._get_object(key)["Body"]
        return _chunks(body, chunk)

    def delete(self, key: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("delete_object", Key=self._key(key))
        except ClientError as e:
            raise BackendError(f"object store {self.url} failed deleting {key}: {e}") from e

    def presigned_url(self, key: str, expires: int) -> str | None:
        return str(self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket,
                                                                            "Key": self._key(key)},
                                                      ExpiresIn=expires))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        head = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=head + prefix, PaginationConfig={"PageSize": self.page_size}):
                for obj in page.get("Contents", ()):
                    yield ObjectInfo(obj["Key"][len(head):], int(obj["Size"]), obj["LastModified"].timestamp())
        except (BotoCoreError, ClientError) as e:
            raise BackendError(f"object store {self.url} failed listing {prefix}: {e}") from e

    def key_of(self, uri: str) -> str:
        bucket, key = split_uri(uri)
        head = f"{self.prefix}/" if self.prefix else ""
        inside = urlparse(uri).scheme == "s3" and bucket == self.bucket and key.startswith(head)
        return _key_in_store(uri, self.url, key[len(head):] if inside else None)

    def get_capped(self, key: str, max_bytes: int) -> bytes:
        response = self._get_object(key)
        with response["Body"] as body:
            size = response.get("ContentLength")
            if size is not None and size > max_bytes:
                raise ObjectTooLarge(key, size, max_bytes)
            data = bytes(body.read(max_bytes + 1))
        if len(data) > max_bytes:
            raise ObjectTooLarge(key, None, max_bytes)
        return data


def open_storage(url: str, endpoint_url: str | None = None, timeout: float = 30.0) -> Storage:
    """Open ``s3://bucket/prefix`` or ``file:///dir``.

    Args:
        url: the storage URL.
        endpoint_url: S3-compatible endpoint (ignored for ``file://``).
        timeout: seconds an S3 call waits on its socket before it fails (ignored for ``file://``).

    Raises:
        ValueError: for any other scheme.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileStorage(unquote(parsed.netloc + parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"s3 URL needs a bucket: {url!r}")
        return S3Storage(parsed.netloc, parsed.path, endpoint_url=endpoint_url, timeout=timeout)
    raise ValueError(f"storage URL must be s3://bucket/prefix or file:///dir, got {url!r}")


def split_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into (bucket, key)."""
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")
