"""Fetched images in other buckets: ``s3://bucket/key`` read through the storage client (``vlmq.remote``).

The bucket must be listed in ``VLMQ_IMAGE_FETCH_ALLOW`` (``s3://bucket``) and must not be the pool's own (whose
objects are read as inputs, under the tenant rules). The endpoint and credentials are the pool's
(``VLMQ_S3_ENDPOINT_URL``, the usual AWS variables); no address guard applies, the operator chose that endpoint.
botocore retries 5xx answers and timeouts itself; ``VLMQ_IMAGE_FETCH_TIMEOUT`` bounds each socket wait.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from vlmq.fetch import FetchError, Response
from vlmq.settings import Settings
from vlmq.storage import split_uri


def allowed_buckets(settings: Settings) -> frozenset[str]:
    """The buckets ``VLMQ_IMAGE_FETCH_ALLOW`` lists (``s3://bucket`` entries)."""
    entries = settings.image_fetch_allow.replace(",", " ").split()
    return frozenset(e[5:].strip("/") for e in entries if e[:5].lower() == "s3://")


def in_pool_bucket(url: str, settings: Settings) -> bool:
    """Whether ``s3://bucket/...`` names the pool's own bucket (read as inputs, never fetched)."""
    pool = urlsplit(settings.storage_url)
    return pool.scheme == "s3" and pool.netloc == split_uri(url)[0]


def _bucket_and_key(url: str, settings: Settings) -> tuple[str, str]:
    bucket, key = split_uri(url)
    if not bucket or not key:
        raise FetchError("fetch_refused", f"{url[:120]!r} must name a bucket and a key (s3://bucket/key)")
    if in_pool_bucket(url, settings):  # a forged record: the SDK reads the pool's bucket as inputs
        raise FetchError("fetch_refused", f"{url[:120]!r} is in the pool's own bucket but outside its storage "
                         f"({settings.storage_url}); pool objects are read only under the pool's prefix")
    if bucket not in allowed_buckets(settings):
        raise FetchError("fetch_refused", f"bucket {bucket!r} is not in VLMQ_IMAGE_FETCH_ALLOW; the operator lists "
                         "the buckets images may be fetched from (s3://bucket)")
    return bucket, key


def _client(settings: Settings) -> Any:
    import boto3
    from botocore.config import Config

    timeout = settings.image_fetch_timeout
    config = Config(connect_timeout=min(5.0, timeout), read_timeout=timeout,
                    retries={"max_attempts": 1 + settings.image_fetch_retries, "mode": "standard"})
    return boto3.client("s3", endpoint_url=settings.s3_endpoint_url, config=config)


def s3_get(url: str, settings: Settings, max_bytes: int, first_bytes: int | None = None) -> Response:
    """GET ``s3://bucket/key`` (its first ``first_bytes`` when given) as a :class:`vlmq.fetch.Response`.

    Raises:
        FetchError: ``fetch_refused`` (bucket not allowed, or the pool's own), ``fetch_failed`` (no such key,
            access denied, the store failing), ``fetch_timeout``, ``fetch_too_large``.
    """
    from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

    bucket, key = _bucket_and_key(url, settings)
    extra = {"Range": f"bytes=0-{first_bytes - 1}"} if first_bytes else {}
    try:
        answer = _client(settings).get_object(Bucket=bucket, Key=key, **extra)
        with answer["Body"] as body:
            if not first_bytes and answer.get("ContentLength", 0) > max_bytes:
                raise FetchError("fetch_too_large", f"{url[:120]!r} is {answer['ContentLength']} bytes, over the "
                                 f"limit of {max_bytes} (VLMQ_MAX_IMAGE_BYTES)")
            data = bytes(body.read(max_bytes + 1))
    except ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        raise FetchError("fetch_failed", f"cannot read {url[:120]!r}: {e}", retryable=status >= 500) from None
    except (ConnectTimeoutError, ReadTimeoutError) as e:
        raise FetchError("fetch_timeout", f"{url[:120]!r}: {e}", retryable=True) from None
    except (BotoCoreError, OSError) as e:
        raise FetchError("fetch_failed", f"cannot read {url[:120]!r}: {e}", retryable=True) from None
    if len(data) > max_bytes:
        raise FetchError("fetch_too_large", f"{url[:120]!r} is over the limit of {max_bytes} bytes")
    headers = {"etag": answer.get("ETag", ""), "content-range": answer.get("ContentRange", "")}
    return Response(206 if headers["content-range"] else 200, headers, data, url)
