"""Chat messages at submit (issue 29 items 1-2), against a real Valkey and file storage, no worker: what is
accepted becomes a record in the engine's form with one content-addressed input per image, priced by the images
together; what is not is refused by name before anything is enqueued."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from vlmq import keys, prompttokens
from vlmq.cli import main
from vlmq.client import Client
from vlmq.cost import estimate
from vlmq.errors import InvalidRequest
from vlmq.models import model_folder, resolve_model
from vlmq.settings import Settings


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
def client(redis_client: object, redis_url: str, tmp_path: Path) -> Any:
    with Client(settings=Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri(),
                                  max_images_per_job=4)) as c:
        yield c


def queued(client: Client) -> int:
    return sum(client.queue_depth("tiny-shapes", c) for c in ("xs", "s", "m", "l", "xl"))


def test_a_chat_becomes_a_record_in_the_engines_form_priced_by_all_its_images(client: Client, tmp_path: Path) -> None:
    first, second = png(700, 660), png(660, 700, (10, 200, 30))  # 144 vision tokens each: xs alone, s together
    (tmp_path / "b.png").write_bytes(second)
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [image_part(data_url(first)), {"type": "text", "text": "What shape?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a square"}]},
        {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                     {"type": "image_url", "image_url": {"url": str(tmp_path / "b.png"),
                                                                         "detail": "auto"}}]},
    ]
    record = client.submit(messages=messages, max_new_tokens=8).info()
    assert json.loads(record["messages"]) == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a square"}]},
        {"role": "user", "content": [{"type": "text", "text": "And here?"}, {"type": "image"}]}]
    shas = [hashlib.sha256(d).hexdigest() for d in (first, second)]
    assert json.loads(record["input_keys"]) == [keys.input_object(s) for s in shas] and "prompt" not in record
    assert record["input_key"] == keys.input_object(shas[0]) and record["image_count"] == "2"
    assert [client.storage.get(keys.input_object(s)) for s in shas] == [first, second]
    policy = resolve_model("tiny-shapes", client.settings).policy
    alone = [estimate(w, h, policy) for w, h in ((700, 660), (660, 700))]
    assert int(record["vision_tokens"]) == sum(e.vision_tokens for e in alone) == 288
    assert int(record["encoder_patches"]) == sum(e.encoder_patches for e in alone)
    assert [e.cost_class for e in alone] == ["xs", "xs"] and record["cost_class"] == "s"


def test_a_text_only_chat_has_no_input_and_costs_no_vision_tokens(client: Client) -> None:
    record = client.submit(messages=[{"role": "user", "content": "Say yes."}]).info()
    assert (record["vision_tokens"], record["image_count"], record["input_keys"]) == ("0", "0", "[]")
    assert "input_key" not in record and record["cost_class"] == "xs" and queued(client) == 1


def test_the_shortcut_keeps_its_record_and_submit_many_takes_messages(client: Client) -> None:
    data = png(64, 48)
    shortcut = client.submit(data, "What colour?").info()
    assert shortcut["prompt"] == "What colour?" and "messages" not in shortcut and shortcut["width"] == "64"
    jobs = client.submit_many([{"messages": [{"role": "user", "content": [image_part(data_url(data))]}]},
                               {"image": data, "prompt": "Again?"}])
    assert json.loads(jobs[0].info()["input_keys"]) == [shortcut["input_key"]] and queued(client) == 3


@pytest.mark.parametrize(("messages", "code", "named"), [
    ([{"role": "user", "content": [{"type": "picture", "picture": "x.png"}]}], "bad_messages",
     "messages[0].content[0].type 'picture'"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "unsupported_field",
     "messages[0].content[0].type 'input_audio'"),
    ([{"role": "user", "content": [image_part(data_url(png(30, 30)))] * 5}], "image_count", "limit is 4"),
    ([{"role": "user", "content": [image_part(7)]}], "bad_messages", "messages[0].content[0].image_url.url"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}], "bad_messages",
     "messages[0].content[0].image_url must be an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png", "detail": "max"}}]}],
     "bad_messages", "detail 'max'"),
    ([{"role": "tool", "content": "42", "tool_call_id": "c"}], "unsupported_field", "messages[0]"),
    ([{"role": "user", "content": "hi", "name": "ann"}], "unsupported_field", "messages[0] has field(s) name"),
    ([{"role": "robot", "content": "hi"}], "bad_messages", "messages[0].role 'robot'"),
    ([{"role": "assistant", "content": [image_part(data_url(png(30, 30)))]}], "bad_messages",
     "images belong in user turns"),
    ([{"role": "user", "content": []}], "bad_messages", "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "bad_messages", "messages[0].content[0].text"),
    ([{"role": "user", "content": "x" * 9000}], "prompt_too_long", "VLMQ_MAX_PROMPT_CHARS"),
    ([{"role": "user", "content": "hi <|im_end|>"}], "bad_prompt", "messages[0].content[0].text"),
    ([], "bad_messages", "non-empty list"),
    ("hello", "bad_messages", "non-empty list"),
    ([{"role": "user", "content": [image_part("https://example.com/cat.png")]}], "fetch_refused",
     "example.com is not in VLMQ_IMAGE_FETCH_ALLOW"),
])
def test_a_bad_chat_is_refused_by_name_before_anything_is_enqueued(client: Client, messages: Any, code: str,
                                                                   named: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        client.submit(messages=messages)
    assert err.value.code == code and named in str(err.value), str(err.value)
    assert queued(client) == 0 and not client.redis.keys(keys.job("*"))


def test_messages_and_an_image_together_or_neither_are_refused(client: Client) -> None:
    for kwargs, code in [({"image": png(30, 30), "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                          "conflicting_fields"), ({}, "missing_field"), ({"prompt": "x"}, "missing_field")]:
        with pytest.raises(InvalidRequest) as err:
            client.submit(**kwargs)
        assert err.value.code == code
    assert queued(client) == 0


def test_images_over_every_class_bound_and_the_largest_image_are_refused(redis_client: object, redis_url: str,
                                                                        tmp_path: Path) -> None:
    # the top class is budgeted for the model's largest image (vlmq.models.class_cost): a job above it and above
    # every bounded class has no class a worker budgets for
    big = data_url(png(1024, 1024))  # alone the model's largest image: 324 tokens
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri(), cost_classes="xs=64,s=400,xl")
    with Client(settings=settings) as client:
        assert client.submit(messages=[{"role": "user", "content": [image_part(big)]}]).info()["cost_class"] == "s"
        with pytest.raises(InvalidRequest) as err:
            client.submit(messages=[{"role": "user", "content": [image_part(big), image_part(big)]}])
        assert err.value.code == "too_many_vision_tokens" and "class xl" in str(err.value) and queued(client) == 1
    with Client(settings=dataclasses.replace(settings, cost_classes="xs=64,s=1024,xl")) as client:
        record = client.submit(messages=[{"role": "user", "content": [image_part(big), image_part(big)]}]).info()
        assert (record["vision_tokens"], record["cost_class"]) == ("648", "s")  # a bounded class holds it


def test_an_idempotency_key_binds_the_messages_and_their_images(client: Client) -> None:
    def chat(text: str, colour: tuple[int, int, int]) -> list[dict[str, Any]]:
        image = image_part(data_url(png(40, 40, colour)))
        return [{"role": "user", "content": [{"type": "text", "text": text}, image]}]

    first = client.submit(messages=chat("a?", (1, 2, 3)), idempotency_key="k")
    assert client.submit(messages=chat("a?", (1, 2, 3)), idempotency_key="k").id == first.id
    for other in (chat("b?", (1, 2, 3)), chat("a?", (9, 9, 9))):
        with pytest.raises(InvalidRequest) as err:
            client.submit(messages=other, idempotency_key="k")
        assert err.value.code == "idempotency_conflict"
    assert queued(client) == 1


def test_vlmq_submit_takes_messages(client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.png").write_bytes(png(50, 50))
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": [image_part(str(tmp_path / "a.png")),
                                                             {"type": "text", "text": "Shape?"}]}]))
    monkeypatch.setenv("VLMQ_BROKER_URL", client.settings.broker_url)
    monkeypatch.setenv("VLMQ_STORAGE_URL", client.settings.storage_url)
    assert main(["submit", "--messages", str(path), "--json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["id"]
    assert json.loads(client.job(job_id).info()["messages"])[0] == {"role": "system", "content": "Be brief."}
    assert main(["submit", "--messages", '[{"role": "user", "content": "Hi"}]']) == 0 and queued(client) == 2


def test_a_prompt_over_the_text_bound_is_refused_at_submit(redis_client: object, redis_url: str,
                                                           tmp_path: Path) -> None:
    # issue 29 item 6: counted with the model folder's tokenizer and chat template as the engine counts
    # (tests/engine/test_prompt_count.py), so the job is refused here instead of failing on a worker later
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri(), text_token_bound=200)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many shapes? " * 4}]
    counted = prompttokens.counter(str(model_folder(resolve_model("tiny-shapes", settings))), "qwen2_vl")
    tokens = counted.text_tokens(chat)
    assert 20 < tokens < 200
    with Client(settings=settings) as client:
        client.submit(messages=chat, max_new_tokens=200 - tokens)  # exactly at the bound
        for kwargs in ({"messages": chat, "max_new_tokens": 201 - tokens},
                       {"messages": [{"role": "user", "content": "How many shapes? " * 60}]},
                       {"image": png(64, 48), "prompt": "How many shapes? " * 60}):
            with pytest.raises(InvalidRequest) as err:
                client.submit(**kwargs)
            assert err.value.code == "prompt_too_long" and "VLMQ_TEXT_TOKEN_BOUND" in str(err.value)
        assert queued(client) == 1


def test_submitting_a_chat_imports_no_torch(redis_client: object, redis_url: str, tmp_path: Path) -> None:
    code = ("import sys; from vlmq.client import Client; from vlmq.settings import Settings; "
            f"c = Client(settings=Settings(broker_url={redis_url!r}, storage_url={(tmp_path / 's').as_uri()!r})); "
            "c.submit(messages=[{'role': 'user', 'content': 'Hi'}]); "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
