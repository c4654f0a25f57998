"""Hostile HTTP against a real ``vlmq serve`` (small caps, no worker needed): oversized uploads, a 2 GB declared
Content-Length, malformed multipart, a client trickling bytes, ids with path separators, 10,000-deep JSON. Each
gets a clear OpenAI-shaped error, and the server stays up and answering."""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from serveproc import ServeProcess, serve_settings

from vlmq import apikeys, keys

pytestmark = [pytest.mark.timeout(120)]
CAP = 1 << 20  # VLMQ_SERVE_MAX_FILE_BYTES and VLMQ_SERVE_MAX_BODY_BYTES here


@pytest.fixture(scope="module")
def served(redis_url: str, s3_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    client = redis.Redis.from_url(redis_url)
    key = apikeys.create(client, "acme", "hostile")
    serve = ServeProcess(serve_settings(redis_url, s3_server.url, "hostile"),
                         tmp_path_factory.mktemp("hostile") / "serve.log", VLMQ_SERVE_MAX_FILE_BYTES=str(CAP),
                         VLMQ_SERVE_MAX_BODY_BYTES=str(CAP), VLMQ_SERVE_READ_TIMEOUT="1",
                         VLMQ_SERVE_BODY_TIMEOUT="3", VLMQ_SERVE_MAX_FILE_LINES="100",
                         VLMQ_SERVE_CHAT_TIMEOUT="1", VLMQ_MAX_QUEUE_DEPTH="1")  # no worker: nothing is served
    try:
        serve.wait_ready()
        yield serve.url, key
        assert serve.alive(), serve.log()[-4000:]
    finally:
        serve.stop()
        client.delete(keys.api_keys())
        client.close()


def raw(url: str, head: str, body: bytes = b"", *, trickle: float = 0.0) -> tuple[int, dict]:
    """Send a hand-made request; the status and the JSON error of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        try:
            if trickle:
                for byte in body:
                    if select.select([s], [], [], 0)[0]:  # answered already: stop sending, read it
                        break
                    s.sendall(bytes([byte]))
                    time.sleep(trickle)
            else:
                s.sendall(body)
        except OSError:  # the server answered and closed before taking all of it: what a cap should do
            pass
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2] or b"{}")


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def head(method: str, path: str, key: str, length: int | str, kind: str = "application/json") -> str:
    return (f"{method} {path} HTTP/1.1\nHost: x\nAuthorization: Bearer {key}\nContent-Type: {kind}\n"
            f"Content-Length: {length}\n")


def still_up(url: str) -> None:
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200


def test_a_2gb_declared_content_length_is_refused_before_its_body(served: tuple[str, str]) -> None:
    url, key = served
    started = time.monotonic()
    status, error = raw(url, head("POST", "/v1/files", key, 2 << 30, "multipart/form-data; boundary=b"), b"x" * 1000)
    assert status == 413 and error["error"]["code"] == "request_too_large" and time.monotonic() - started < 5
    status, error = raw(url, head("POST", "/v1/chat/completions", key, 2 << 30), b"{")
    assert status == 413
    still_up(url)


def test_an_oversized_upload_is_refused_413_and_a_file_of_too_many_lines_400(served: tuple[str, str]) -> None:
    url, key = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as refused:  # within the envelope's slack: read, then refused
            client.files.create(file=("big.jsonl", b"x" * (CAP + 1000)), purpose="batch")
        assert refused.value.status_code == 413 and refused.value.code == "file_too_large"
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("many.jsonl", b"{}\n" * 101), purpose="batch")
        assert refused.value.code == "too_many_lines"
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
        assert refused.value.param == "purpose"
        assert client.files.list().data == []  # nothing refused was kept
    chunks = (b"x" * 65536 for _ in range(40))  # no Content-Length: stopped at the cap as it streams
    answer = httpx.post(f"{url}/v1/chat/completions", content=chunks, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 413
    still_up(url)


@pytest.mark.parametrize("kind,body", [
    ("multipart/form-data; boundary=zzz", b"--zzz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nno end"),
    ("multipart/form-data; boundary=zzz", b"garbage without any boundary at all"),
    ("multipart/form-data", b"--x\r\n\r\n--x--\r\n"),
    ("multipart/form-data; boundary=zzz", b"--zzz\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
     b"batch\r\n--zzz\r\nContent-Disposition: form-data; name=\"evil\"\r\n\r\n1\r\n--zzz--\r\n"),
])
def test_malformed_multipart_is_refused_400(served: tuple[str, str], kind: str, body: bytes) -> None:
    url, key = served
    status, error = raw(url, head("POST", "/v1/files", key, len(body), kind), body)
    assert status == 400 and set(error["error"]) == {"message", "type", "param", "code"}, error
    still_up(url)


def test_a_client_trickling_bytes_is_cut_off_and_others_are_served_meanwhile(served: tuple[str, str]) -> None:
    url, key = served
    outcome: list[int] = []
    slow = threading.Thread(target=lambda: outcome.append(raw(url, head("POST", "/v1/chat/completions", key, 400),
                                                              b" " * 400, trickle=0.3)[0]))
    stalled = threading.Thread(target=lambda: outcome.append(raw(url, head("POST", "/v1/chat/completions", key,
                                                                           400), b"{")[0]))
    slow.start()
    stalled.start()
    for _ in range(5):
        started = time.monotonic()
        still_up(url)
        assert time.monotonic() - started < 1
        time.sleep(0.2)
    slow.join(30)
    stalled.join(30)
    assert outcome == [408, 408]
    still_up(url)


@pytest.mark.parametrize("path", ["/v1/files/..%2F..%2Fetc%2Fpasswd", "/v1/files/file-..%2F..%2Fx/content",
                                  "/v1/files/file-globex.0123456789abcdef0123456789abcdef",
                                  "/v1/files/file-acme.batch_0123%2F..%2Fx.output/content",
                                  "/v1/batches/..%2Facme.batch_0123456789abcdef0123456789abcdef",
                                  "/v1/batches/acme.batch_0123456789abcdef0123456789abcdef%00", "/v1/files/%00",
                                  "/v1/batches/" + "a" * 5000])
def test_ids_that_are_not_ids_are_404(served: tuple[str, str], path: str) -> None:
    url, key = served
    answer = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.text
    still_up(url)


@pytest.mark.parametrize("body", ["[" * 10_000 + "]" * 10_000, '{"a":' * 10_000 + "1" + "}" * 10_000,
                                  '{"messages": ' + "[" * 10_000, "\xff\xfe not utf-8", "[]", "not json"])
def test_deep_huge_or_broken_json_is_refused_400(served: tuple[str, str], body: str) -> None:
    url, key = served
    data = body.encode("latin-1") if body.startswith("\xff") else body.encode()
    for path in ("/v1/chat/completions", "/v1/batches"):
        answer = httpx.post(f"{url}{path}", content=data, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_json", answer.text
    still_up(url)


def test_a_bad_key_is_refused_before_its_body_is_read(served: tuple[str, str]) -> None:
    url, _ = served
    status, error = raw(url, head("POST", "/v1/chat/completions", "vlmq-nope", 1000), b"{")
    assert status == 401 and error["error"]["type"] == "authentication_error"
    still_up(url)


def test_a_chat_past_its_timeout_is_504_and_a_full_queue_429_with_retry_after(served: tuple[str, str]) -> None:
    import base64
    import io

    from PIL import Image

    url, key = served
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buf, "PNG")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(buf.getvalue()).decode()}},
               {"type": "text", "text": "How many shapes?"}]
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        def ask() -> None:
            client.chat.completions.create(model="tiny-shapes", messages=[{"role": "user", "content": content}],
                                           max_tokens=2)

        with pytest.raises(openai.InternalServerError) as late:  # no worker here: the job waits, then is cancelled
            ask()
        assert late.value.status_code == 504 and late.value.code == "timeout"
        with pytest.raises(openai.RateLimitError) as full:  # the cancelled job's message still fills the queue
            ask()
        assert full.value.code == "queue_full" and full.value.response.headers["retry-after"].isdigit()
    still_up(url)


def test_metrics_count_requests_by_route_and_status(served: tuple[str, str], tmp_path: Path) -> None:
    url, key = served
    httpx.get(f"{url}/v1/files/nope", headers={"Authorization": f"Bearer {key}"})
    text = httpx.get(f"{url}/metrics").text
    assert 'vlmq_serve_requests_total{method="GET",route="/v1/files/{id}",status="404"}' in text
    assert 'vlmq_serve_request_seconds_bucket{le="0.005",route="/v1/files/{id}"}' in text
