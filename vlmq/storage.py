"""Object storage behind one interface: ``s3://bucket/prefix`` (boto3) and ``file:///dir``.

Inputs are content-addressed (``inputs/<sha256>``); results are written once
(``put_if_absent``: a conditional put on S3, an atomic hard link on files).
"""
from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from vlmq.errors import BackendError


class Storage(ABC):
    """Minimal object store used for inputs, results and archived KV."""

    url: str

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

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object if present."""


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad storage key {key!r}")
    return key


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
            os.fsync(f.fileno())
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

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3Storage(Storage):
    """Objects in an S3-compatible bucket under a key prefix."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, client: Any = None) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"})
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

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return bytes(self._call("get_object", Key=self._key(key))["Body"].read())
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise KeyError(key) from None
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

    def delete(self, key: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("delete_object", Key=self._key(key))
        except ClientError as e:
            raise BackendError(f"object store {self.url} failed deleting {key}: {e}") from e


def open_storage(url: str, endpoint_url: str | None = None) -> Storage:
    """Open ``s3://bucket/prefix`` or ``file:///dir``.

    Args:
        url: the storage URL.
        endpoint_url: S3-compatible endpoint (ignored for ``file://``).

    Raises:
        ValueError: for any other scheme.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileStorage(unquote(parsed.netloc + parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"s3 URL needs a bucket: {url!r}")
        return S3Storage(parsed.netloc, parsed.path, endpoint_url=endpoint_url)
    raise ValueError(f"storage URL must be s3://bucket/prefix or file:///dir, got {url!r}")


def split_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into (bucket, key)."""
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")
