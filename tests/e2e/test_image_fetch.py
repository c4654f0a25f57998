"""Images by ``https://`` URL: priced at submit from a ranged read, fetched by the worker through the address guard.

A real TLS image server runs on loopback (its certificate from a private CA the settings trust); loopback is
allow-listed through ``VLMQ_IMAGE_FETCH_NETWORKS`` where a test needs it. Names other than ``localhost`` are
answered by a stub resolver (no real lookup, and never a connection to a non-loopback address: every
connection the fetch makes is recorded and checked).
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from imageserver import ImageServer, Route
from PIL import Image
from test_jobrunner import EchoBackend
from test_webhook_https import LOCAL, Pem, make_cert, server_context
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import keys, remote, remote_s3
from vlmq.client import Client
from vlmq.errors import InvalidRequest, JobFailed
from vlmq.fetch import FetchError
from vlmq.images import ImageLimits
from vlmq.settings import Settings
from vlmq.workers.backends.base import GenOutput, GenRequest
from vlmq.workers.batcher import Batcher
from vlmq.workers.jobrunner import WorkerContext, run_job

pytestmark = pytest.mark.timeout(120)
LOOPBACK = "127.0.0.1/32 ::1/128"
ALLOW = "localhost *.example.test"
NAMES = {"cdn.example.test": LOCAL, "private.example.test": "10.1.2.3", "meta.example.test": "169.254.169.254",
         "six.example.test": "::1", "nat64.example.test": "64:ff9b::a9fe:a9fe"}


def jpeg(size: tuple[int, int] = (96, 64), colour: tuple[int, int, int] = (30, 120, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def stub_resolver(host: str, port: int, *_: Any) -> list[Any]:
    """``getaddrinfo`` for the test names (``localhost`` resolved for real); any other name does not resolve."""
    if host == "localhost":
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    if host not in NAMES:
        raise socket.gaierror(f"{host}: no such name here")
    family = socket.AF_INET6 if ":" in NAMES[host] else socket.AF_INET
    return [(family, socket.SOCK_STREAM, 6, "", (NAMES[host], port))]


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pem]:
    folder = tmp_path_factory.mktemp("tls")
    ca, ca_cert, ca_key = make_cert(folder, "ca", [], ca=True)
    names = ["localhost", "127.0.0.1", *NAMES]
    return {"ca": ca, "good": make_cert(folder, "good", names, (ca_cert, ca_key))[0]}


@pytest.fixture
def server(pems: dict[str, Pem]) -> Iterator[ImageServer]:
    s = ImageServer(LOCAL, server_context(pems["good"], []))
    yield s
    s.stop()


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every address a fetch connects to (the real ``socket.create_connection`` still makes the connection)."""
    made: list[str] = []
    real = socket.create_connection

    def recording(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        made.append(address[0])
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", recording)
    return made


def make_settings(redis_url: str, tmp_path: Path, pems: dict[str, Pem], **extra: Any) -> Settings:
    base = {"broker_url": redis_url, "storage_url": f"file://{tmp_path}/store", "image_fetch_allow": ALLOW,
            "image_fetch_networks": LOOPBACK, "image_fetch_ca_file": str(pems["ca"].cert),
            "image_fetch_timeout": 2.0, "image_fetch_retries": 1, "max_attempts": 2}
    return Settings(**(base | extra))


@pytest.fixture
def settings(redis_url: str, redis_client: Any, tmp_path: Path, pems: dict[str, Pem]) -> Settings:
    return make_settings(redis_url, tmp_path, pems)


def worker(client: Client, settings: Settings) -> WorkerContext:
    return WorkerContext(settings, client.redis, client.storage, Batcher(EchoBackend(), 4), "tiny-shapes", "unit",
                         resolver=stub_resolver)


def job_error(job: Any) -> JobFailed:
    with pytest.raises(JobFailed) as failure:
        job.result(timeout=5)
    return failure.value


# --- submit: a ranged read prices the image, nothing is uploaded -------------------------------------------------

def test_submit_reads_only_the_header_and_the_worker_fetches_the_bytes(settings: Settings, server: ImageServer,
                                                                      connections: list[str]) -> None:
    image = jpeg((640, 480)) + b"\0" * 200_000  # trailing bytes past the header: never read at submit
    server.routes["/a.jpg"] = Route(image)
    with Client(settings=settings) as client:
        job = client.submit(server.url("/a.jpg"), "hello", max_new_tokens=3)
        record = client.store.read(job.id)
        assert server.requests == [("/a.jpg", f"bytes=0-{remote.FIRST_BYTES - 1}")]
        fetches = json.loads(record["fetches"])
        assert list(fetches) == [record["input_key"]] and not client.storage.exists(record["input_key"])
        priced = json.loads(fetches[record["input_key"]])
        assert (priced["size"], priced["width"], priced["height"]) == (len(image), 640, 480)
        uploaded = client.submit(image, "hello", max_new_tokens=3)  # the same image, its bytes sent
        assert record["vision_tokens"] == client.store.read(uploaded.id)["vision_tokens"]
        run_job(worker(client, settings), job.id)
        assert job.result(timeout=5).text == "echo: hello"
        assert server.requests[-1] == ("/a.jpg", "")  # the worker's one full GET
        assert set(connections) == {LOCAL}


def test_a_batch_file_line_may_name_an_https_image(settings: Settings, server: ImageServer, tmp_path: Path) -> None:
    server.routes["/b.jpg"] = Route(jpeg((200, 100)))

    def line(custom_id: str, url: str) -> str:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hello"}]
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "tiny-shapes", "max_tokens": 3,
                                    "messages": [{"role": "user", "content": content}]}}) + "\n"

    path = tmp_path / "requests.jsonl"
    path.write_text(line("fetched", server.url("/b.jpg")) + line("elsewhere", "https://nowhere.invalid/x.jpg"))
    with Client(settings=settings) as client:
        batch = client.submit_batch(path)
        [refused] = batch.rejected()
        assert (refused["custom_id"], refused["response"]["body"]["error"]["code"]) == ("elsewhere", "fetch_refused")
        [job_id] = [j.decode() for j in client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
        record = client.store.read(job_id)
        assert json.loads(record["fetches"]) and not client.storage.exists(json.loads(record["input_keys"])[0])
        run_job(worker(client, settings), job_id)
        assert server.requests[-1] == ("/b.jpg", "")  # the worker's one full GET
        assert batch.wait(timeout=10)["request_counts"] == {"total": 2, "completed": 1, "failed": 1, "cancelled": 0,
                                                            "rejected": 1}


def test_a_server_that_ignores_range_is_read_whole_up_to_the_cap(settings: Settings, server: ImageServer) -> None:
    image = jpeg()
    server.routes["/whole.jpg"] = Route(image, honour_range=False)
    d = remote.price(server.url("/whole.jpg"), settings, ImageLimits())
    assert (d.size, d.head_len, d.width, d.height) == (len(image), len(image), 96, 64)
    server.routes["/big.jpg"] = Route(image + b"\0" * 5000, honour_range=False)
    with pytest.raises(InvalidRequest) as refused:
        remote.price(server.url("/big.jpg"), settings, ImageLimits(max_bytes=len(image)))
    assert refused.value.code == "fetch_too_large"


def test_a_header_past_the_first_read_is_read_again_with_a_longer_range(settings: Settings,
                                                                         server: ImageServer) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (50, 40)).save(buf, "JPEG", exif=b"Exif\0\0" + b"MM\0*\0\0\0\x08\0\0" + b"\0" * 60_000,
                                    comment=b"c" * 60_000)
    server.routes["/deep.jpg"] = Route(buf.getvalue())
    d = remote.price(server.url("/deep.jpg"), settings, ImageLimits())
    assert (d.width, d.height) == (50, 40)
    ranges = [r for _, r in server.requests]
    assert ranges[0] == f"bytes=0-{remote.FIRST_BYTES - 1}" and len(ranges) == 2 and ranges[1] != ranges[0]


@pytest.mark.parametrize(("url", "code"), [
    ("https://elsewhere.test/a.jpg", "fetch_refused"),  # not in VLMQ_IMAGE_FETCH_ALLOW
    ("https://private.example.test/a.jpg", "fetch_refused"),  # allowed name, resolves to 10/8
    ("https://meta.example.test/a.jpg", "fetch_refused"),  # resolves to 169.254.169.254
    ("https://six.example.test/a.jpg", "fetch_refused"),  # resolves to ::1 (not allow-listed here)
    ("https://nat64.example.test/a.jpg", "fetch_refused"),  # the metadata address through NAT64
    ("http://cdn.example.test/a.jpg", "fetch_refused"),  # https only
    ("https://user:pw@cdn.example.test/a.jpg", "fetch_refused"),
])
def test_submit_refuses_what_the_guard_or_the_allow_list_refuses(redis_url: str, redis_client: Any, tmp_path: Path,
                                                                 pems: dict[str, Pem], connections: list[str],
                                                                 url: str, code: str) -> None:
    settings = make_settings(redis_url, tmp_path, pems, image_fetch_networks="")
    with pytest.raises(InvalidRequest) as refused:
        remote.price(url, settings, ImageLimits(), stub_resolver)
    assert refused.value.code == code
    assert connections == []


def test_loopback_is_refused_unless_allow_listed(redis_url: str, redis_client: Any, tmp_path: Path,
                                                 pems: dict[str, Pem], server: ImageServer,
                                                 connections: list[str]) -> None:
    server.routes["/a.jpg"] = Route(jpeg())
    settings = make_settings(redis_url, tmp_path, pems, image_fetch_networks="")
    with Client(settings=settings) as client, pytest.raises(InvalidRequest) as refused:
        client.submit(server.url("/a.jpg"), "hello", max_new_tokens=3)
    assert refused.value.code == "fetch_refused" and "loopback" in str(refused.value)
    assert connections == [] and server.requests == []
    for literal in ("https://127.0.0.1/a.jpg", "https://[::1]/a.jpg", "https://10.0.0.1/a.jpg",
                    "https://169.254.169.254/latest/meta-data"):
        settings = make_settings(redis_url, tmp_path, pems, image_fetch_networks="",
                                 image_fetch_allow="127.0.0.1 [::1] ::1 10.0.0.1 169.254.169.254")
        with pytest.raises(InvalidRequest) as refused:
            remote.price(literal, settings, ImageLimits(), stub_resolver)
        assert refused.value.code == "fetch_refused", literal
    assert connections == []


def test_nothing_is_fetched_by_default_and_other_buckets_are_refused(redis_url: str, redis_client: Any,
                                                                     tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}/store")
    with Client(settings=settings) as client:
        for url in ("https://images.example.com/a.jpg", "s3://someone-elses-bucket/a.jpg"):
            with pytest.raises(InvalidRequest) as refused:
                client.submit(url, "hello", max_new_tokens=3)
            assert refused.value.code == "fetch_refused", url


def test_a_non_image_body_is_refused_at_submit(settings: Settings, server: ImageServer) -> None:
    server.routes["/page"] = Route(b"<html><body>not an image</body></html>")
    with pytest.raises(InvalidRequest) as refused:
        remote.price(server.url("/page"), settings, ImageLimits())
    assert refused.value.code == "not_an_image"


class SizesBackend(EchoBackend):
    """Answers with the sizes of the images it was handed, in order."""

    @staticmethod
    def _one(r: GenRequest) -> GenOutput | Exception:
        images = r.images or (r.image,)
        return GenOutput(",".join(f"{i.width}x{i.height}" for i in images), [1], "length", 7, len(images))


def test_a_chat_mixes_fetched_and_uploaded_images_in_order(settings: Settings, server: ImageServer) -> None:
    server.routes["/first.jpg"] = Route(jpeg((96, 64)))
    small = io.BytesIO()
    Image.new("RGB", (48, 32), (9, 9, 9)).save(small, "PNG")
    inline = f"data:image/png;base64,{base64.b64encode(small.getvalue()).decode()}"
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": server.url("/first.jpg")}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": inline}}, {"type": "text", "text": "compare"}]}]
    with Client(settings=settings) as client:
        job = client.submit(messages=messages, max_new_tokens=3)
        record = client.store.read(job.id)
        input_keys = json.loads(record["input_keys"])
        assert list(json.loads(record["fetches"])) == input_keys[:1]  # only the first is fetched
        assert not client.storage.exists(input_keys[0]) and client.storage.exists(input_keys[1])
        ctx = WorkerContext(settings, client.redis, client.storage, Batcher(SizesBackend(), 4), "tiny-shapes", "unit")
        run_job(ctx, job.id)
        assert job.result(timeout=5).text == "96x64,48x32"


# --- the worker's fetch: every hop checked, caps, changed bytes --------------------------------------------------

def submitted(client: Client, server: ImageServer, path: str, body: bytes) -> Any:
    server.routes[path] = Route(body)
    return client.submit(server.url(path), "hello", max_new_tokens=3)


def test_a_redirect_chain_is_followed_with_every_hop_checked(settings: Settings, server: ImageServer,
                                                            connections: list[str]) -> None:
    image = jpeg()
    with Client(settings=settings) as client:
        job = submitted(client, server, "/r.jpg", image)
        server.routes["/r.jpg"] = Route(status=302, location=server.url("/hop1", "cdn.example.test"))
        server.routes["/hop1"] = Route(status=301, location="/final.jpg")
        server.routes["/final.jpg"] = Route(image)
        run_job(worker(client, settings), job.id)
        assert job.result(timeout=5).text == "echo: hello"
        assert [p for p, _ in server.requests[-3:]] == ["/r.jpg", "/hop1", "/final.jpg"]
    assert set(connections) == {LOCAL}


@pytest.mark.parametrize(("target", "code"), [
    ("https://private.example.test/x.jpg", "fetch_refused"),  # a chain that ends at a private address
    ("https://meta.example.test/latest/meta-data", "fetch_refused"),
    ("https://elsewhere.test/x.jpg", "fetch_refused"),  # a host the allow list lacks
    ("http://cdn.example.test/x.jpg", "fetch_refused"),  # a downgrade to http
])
def test_a_redirect_to_a_forbidden_target_fails_the_job(settings: Settings, server: ImageServer,
                                                        connections: list[str], target: str, code: str) -> None:
    with Client(settings=settings) as client:
        job = submitted(client, server, "/r.jpg", jpeg())
        server.routes["/r.jpg"] = Route(status=302, location=server.url("/hop1", "cdn.example.test"))
        server.routes["/hop1"] = Route(status=307, location=target)
        run_job(worker(client, settings), job.id)
        error = job_error(job)
    assert error.error_type == code and not error.retryable
    assert set(connections) == {LOCAL}  # the forbidden address was never dialled


def test_too_many_redirects_fail(settings: Settings, server: ImageServer) -> None:
    with Client(settings=settings) as client:
        job = submitted(client, server, "/loop", jpeg())
        server.routes["/loop"] = Route(status=302, location="/loop")
        run_job(worker(client, settings), job.id)
        assert job_error(job).error_type == "fetch_failed"
    assert len([p for p, _ in server.requests if p == "/loop"]) == 1 + 4  # submit, then 1 + 3 redirects


def test_a_body_over_the_cap_is_cut(settings: Settings, server: ImageServer) -> None:
    image = jpeg()
    with Client(settings=settings) as client:
        job = submitted(client, server, "/grow.jpg", image)
        server.routes["/grow.jpg"] = Route(image + b"\0" * (settings.max_image_bytes + 1))
        run_job(worker(client, settings), job.id)
        assert job_error(job).error_type == "fetch_too_large"


def test_a_trickling_server_is_cut_by_the_total_time_cap(settings: Settings, server: ImageServer) -> None:
    image = jpeg()
    with Client(settings=settings) as client:
        job = submitted(client, server, "/slow.jpg", image)
        server.routes["/slow.jpg"] = Route(image, trickle=0.05)  # a byte every 50 ms: each read is quick
        run_job(worker(client, settings), job.id)
        error = job_error(job)
    assert error.error_type == "fetch_timeout" and error.retryable
    assert server.requests.count(("/slow.jpg", "")) == 1 + settings.image_fetch_retries  # a timeout is retried


def test_5xx_answers_are_retried(settings: Settings, server: ImageServer) -> None:
    with Client(settings=settings) as client:
        job = submitted(client, server, "/busy.jpg", jpeg())
        server.routes["/busy.jpg"].fail_first = 1
        run_job(worker(client, settings), job.id)
        assert job.result(timeout=5).text == "echo: hello"
        job = submitted(client, server, "/down.jpg", jpeg())
        server.routes["/down.jpg"].fail_first = 10
        run_job(worker(client, settings), job.id)
        error = job_error(job)
    assert error.error_type == "fetch_failed" and error.retryable


@pytest.mark.parametrize("change", ["other_size", "same_size", "not_an_image"])
def test_bytes_that_changed_after_pricing_fail_the_job(settings: Settings, server: ImageServer, change: str) -> None:
    image = jpeg((96, 64))
    later = {"other_size": jpeg((128, 64)), "not_an_image": b"<html>" + b" " * (len(image) - 6),
             "same_size": image[:2] + bytes(b ^ 0xFF for b in image[2:40]) + image[40:]}[change]
    with Client(settings=settings) as client:
        job = submitted(client, server, "/c.jpg?X-Amz-Signature=secret", image)  # a presigned URL's query
        server.routes["/c.jpg?X-Amz-Signature=secret"] = Route(later)
        run_job(worker(client, settings), job.id)
        error = job_error(job)
    assert error.error_type == "fetch_changed" and not error.retryable
    assert "/c.jpg" in error.message and "secret" not in error.message  # the signature stays out of messages


def test_a_forged_fetch_entry_is_refused_by_the_worker(settings: Settings, server: ImageServer,
                                                       connections: list[str]) -> None:
    with Client(settings=settings) as client:
        job = submitted(client, server, "/a.jpg", jpeg())
        record = client.store.read(job.id)
        fetches = json.loads(record["fetches"])
        entry = json.loads(fetches[record["input_key"]])
        entry["url"] = "https://meta.example.test/latest/meta-data"
        fetches[record["input_key"]] = json.dumps(entry)
        client.redis.hset(keys.job(job.id), "fetches", json.dumps(fetches))
        run_job(worker(client, settings), job.id)
        assert job_error(job).error_type == "bad_record"
    assert connections == [LOCAL]  # the submit's ranged read only


# --- a real worker process: a fetched image answers as the same image does as a data: URL ------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_worker_answers_a_fetched_image_as_it_answers_a_data_url(redis_url: str, redis_client: Any,
                                                                         tmp_path: Path, pems: dict[str, Pem],
                                                                         server: ImageServer) -> None:
    from inputs import scene_png

    image = scene_png(4)
    server.routes["/scene.png"] = Route(image)
    settings = make_settings(redis_url, tmp_path, pems, cost_classes=TINY_CLASSES)
    question = "How many shapes are there?"
    with Client(settings=settings) as client:
        fetched = client.submit(server.url("/scene.png"), question, max_new_tokens=16)
        worker_process = WorkerProcess(settings, tmp_path / "worker.log")
        try:
            worker_process.wait_ready()
            a = fetched.result(timeout=300)
            inline = client.submit(f"data:image/png;base64,{base64.b64encode(image).decode()}", question,
                                   max_new_tokens=16)
            b = inline.result(timeout=300)
            encoded = client.cache_stats()["models"]["tiny-shapes"]["counters"]["encoded_images"]
        finally:
            worker_process.stop()
    assert a.token_ids == b.token_ids and a.text == b.text
    assert encoded == 1  # the uploaded copy hit the cache the fetched image filled (pixel hashes, not addresses)
    assert ("/scene.png", "") in server.requests  # the worker fetched it
    assert hashlib.sha256(image).hexdigest() != keys.input_sha256(client.store.read(fetched.id)["input_key"])


# --- s3:// objects in other buckets the operator allows -------------------------------------------------------

OTHER = "vlmq-test-images"  # a bucket beside the pool's


@pytest.fixture
def s3_settings(redis_url: str, redis_client: Any, s3_server: Any, s3_storage_url: str) -> Iterator[Settings]:
    import boto3

    boto3.client("s3", endpoint_url=s3_server.url).create_bucket(Bucket=OTHER)
    yield Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                   image_fetch_allow=f"s3://{OTHER}", image_fetch_timeout=5.0)


def put_other(settings: Settings, key: str, data: bytes) -> str:
    import boto3

    boto3.client("s3", endpoint_url=settings.s3_endpoint_url).put_object(Bucket=OTHER, Key=key, Body=data)
    return f"s3://{OTHER}/{key}"


def test_an_object_in_an_allowed_bucket_is_priced_from_a_range_and_fetched_by_the_worker(
        s3_settings: Settings) -> None:
    image = jpeg((640, 480)) + b"\0" * 300_000
    uri = put_other(s3_settings, "photos/a.jpg", image)
    with Client(settings=s3_settings) as client:
        job = client.submit(uri, "hello", max_new_tokens=3)
        record = client.store.read(job.id)
        priced = json.loads(json.loads(record["fetches"])[record["input_key"]])
        assert (priced["size"], priced["head_len"]) == (len(image), remote.FIRST_BYTES)  # a ranged read
        assert not client.storage.exists(record["input_key"])  # nothing copied into the pool
        run_job(worker(client, s3_settings), job.id)
        assert job.result(timeout=5).text == "echo: hello"
        changed = client.submit(put_other(s3_settings, "photos/b.jpg", jpeg((64, 64))), "hello", max_new_tokens=3)
        put_other(s3_settings, "photos/b.jpg", jpeg((80, 64)))  # replaced after pricing
        run_job(worker(client, s3_settings), changed.id)
        assert job_error(changed).error_type == "fetch_changed"


def test_other_buckets_and_the_pools_own_bucket_outside_its_prefix_are_refused(s3_settings: Settings) -> None:
    import boto3

    boto3.client("s3", endpoint_url=s3_settings.s3_endpoint_url).create_bucket(Bucket="vlmq-not-allowed")
    pool_bucket = s3_settings.storage_url[5:].split("/")[0]
    with Client(settings=s3_settings) as client:
        for uri in ("s3://vlmq-not-allowed/a.jpg", f"s3://{OTHER}"):
            with pytest.raises(InvalidRequest) as refused:
                client.submit(uri, "hello", max_new_tokens=3)
            assert refused.value.code == "fetch_refused", uri
        with pytest.raises(InvalidRequest) as outside:  # the pool's own bucket is read as inputs, never fetched
            client.submit(f"s3://{pool_bucket}/elsewhere/a.jpg", "hello", max_new_tokens=3)
        assert outside.value.code == "bad_image_source"
        with pytest.raises(FetchError) as forged:  # what a worker does with a forged record naming it
            remote_s3.s3_get(f"s3://{pool_bucket}/elsewhere/a.jpg", s3_settings, 1000)
        assert forged.value.code == "fetch_refused"
        with pytest.raises(InvalidRequest) as missing:
            client.submit(f"s3://{OTHER}/no-such.jpg", "hello", max_new_tokens=3)
        assert missing.value.code == "fetch_failed"
