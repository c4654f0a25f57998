"""Storage: the same behaviour over file:// and a real S3-compatible server."""
from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vlmq.storage import FileStorage, ObjectTooLarge, S3Storage, Storage, open_storage


@pytest.fixture(params=["file", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return open_storage(f"file://{tmp_path / 'store'}")
    server = request.getfixturevalue("s3_server")
    return open_storage(request.getfixturevalue("s3_storage_url"), endpoint_url=server.url)


def test_put_get_exists_delete(storage: Storage) -> None:
    assert not storage.exists("inputs/abc")
    storage.put("inputs/abc", b"\x00\x01")
    assert storage.exists("inputs/abc") and storage.get("inputs/abc") == b"\x00\x01"
    storage.put("inputs/abc", b"new")
    assert storage.get("inputs/abc") == b"new"
    storage.delete("inputs/abc")
    assert not storage.exists("inputs/abc")
    with pytest.raises(KeyError):
        storage.get("inputs/abc")


def test_an_address_holds_its_content_only_when_the_store_vouches_for_the_bytes(storage: Storage) -> None:
    # issue 36 item 4: "an object exists at inputs/<sha256(X)>" does not mean it holds X
    x, y = b"the bytes of X", b"the bytes of Y"
    key = f"inputs/{hashlib.sha256(x).hexdigest()}"
    assert not storage.holds(key, hashlib.sha256(x).hexdigest())
    storage.put(key, y)  # anyone who can write the bucket
    assert storage.exists(key) and not storage.holds(key, hashlib.sha256(x).hexdigest())
    storage.put_addressed(key, x)
    assert storage.holds(key, hashlib.sha256(x).hexdigest()) and storage.get(key) == x
    storage.put(key, x)  # the right bytes without a checksum the store keeps: S3 cannot vouch, so written again
    assert storage.holds(key, hashlib.sha256(x).hexdigest()) is isinstance(storage, FileStorage)


def test_put_if_absent_lets_exactly_one_writer_win(storage: Storage) -> None:
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: storage.put_if_absent("results/j.json", b"%d" % i), range(8)))
    assert wins.count(True) == 1
    assert storage.get("results/j.json") == b"%d" % wins.index(True)


def test_read_uri_reads_objects_of_this_store_only_and_caps_their_size(storage: Storage) -> None:
    storage.put("inputs/img", b"12345")
    uri = f"{storage.url}/inputs/img"
    assert storage.read_uri(uri, max_bytes=5) == b"12345"
    with pytest.raises(ObjectTooLarge, match="the limit is 4"):
        storage.read_uri(uri, max_bytes=4)
    with pytest.raises(KeyError):
        storage.read_uri(f"{storage.url}/inputs/missing", max_bytes=5)
    scheme, rest = storage.url.split("://", 1)
    elsewhere = [f"{scheme}://{rest}-other/inputs/img", f"{storage.url}/../x/inputs/img",
                 "s3://another-bucket/inputs/img" if scheme == "file" else "file:///tmp/inputs/img"]
    for outside in elsewhere:
        with pytest.raises(ValueError, match="not in this pool's storage"):
            storage.read_uri(outside, max_bytes=5)


def test_list_older_lists_the_objects_under_a_prefix_written_before_a_time(storage: Storage) -> None:
    names = ["inputs/a", "inputs/b", "inputs/c", "inputs/d", "inputs/sub/e"]
    for name in names + ["results/j.json", "kv/m/h", "inputs-not/x"]:
        storage.put(name, b"x")
    if isinstance(storage, S3Storage):
        storage.page_size = 2  # three ListObjectsV2 pages, and a name no key can have, which is left out
        storage.client.put_object(Bucket=storage.bucket, Key=f"{storage.prefix}/inputs//odd", Body=b"x")
    assert sorted(storage.list_older("inputs/", time.time() + 5)) == names
    assert list(storage.list_older("inputs/", time.time() - 3600)) == []
    assert list(storage.list_older("missing/", time.time() + 5)) == []
    for bad in ("inputs", "/inputs/", "../inputs/"):
        with pytest.raises(ValueError):
            list(storage.list_older(bad, time.time()))


def test_list_older_goes_by_file_modification_time(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path)
    storage.put("results/old.json", b"x")
    storage.put("results/new.json", b"x")
    os.utime(tmp_path / "results/old.json", (time.time() - 7200, time.time() - 7200))
    assert list(storage.list_older("results/", time.time() - 3600)) == ["results/old.json"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "."])
def test_bad_keys_are_refused(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError):
        storage.put(key, b"x")


def test_urls_open_the_right_backend(tmp_path: Path) -> None:
    assert isinstance(open_storage(f"file://{tmp_path}"), FileStorage)
    s3 = open_storage("s3://bucket/some/prefix", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s3, S3Storage) and s3.bucket == "bucket" and s3.prefix == "some/prefix"
    with pytest.raises(ValueError):
        open_storage("http://example.com/x")


def test_an_address_a_tenant_may_not_head_is_written_again_and_other_errors_surface() -> None:
    # S3 answers 403, not 404, for an absent key to credentials without s3:ListBucket (a tenant's), which no
    # server here reproduces for absent keys alone: botocore's Stubber answers as S3 does (a stub, said so)
    import boto3
    from botocore.stub import Stubber

    from vlmq.errors import BackendError

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    storage = S3Storage("b", "p", client=client)
    with Stubber(client) as stub:
        stub.add_client_error("head_object", "403", "Forbidden", 403)
        assert storage.holds("inputs/ab", "ab" * 32) is False
        stub.add_client_error("head_object", "InternalError", "boom", 500)
        with pytest.raises(BackendError, match="boom"):
            storage.holds("inputs/ab", "ab" * 32)
