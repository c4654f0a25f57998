"""Storage: the same behaviour over file:// and a real S3-compatible server."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vlmq.storage import FileStorage, S3Storage, Storage, open_storage


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


def test_put_if_absent_lets_exactly_one_writer_win(storage: Storage) -> None:
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: storage.put_if_absent("results/j.json", b"%d" % i), range(8)))
    assert wins.count(True) == 1
    assert storage.get("results/j.json") == b"%d" % wins.index(True)


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
