"""``vlmq up --serve PORT``: the printed OPENAI_BASE_URL and OPENAI_API_KEY work with the official client
unchanged, and Ctrl-C stops the server with the rest."""
from __future__ import annotations

import os
import signal

import openai
import pytest
from serveproc import free_port
from test_openai_client import example, messages
from workerproc import UpCommand, alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_vlmq_up_serve_prints_what_the_openai_client_needs_and_ctrl_c_stops_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLMQ_", "OPENAI_"))}
    up = UpCommand("--serve", str(free_port()), env=env)
    try:
        text, exports = up.ready()
        assert {"OPENAI_BASE_URL", "OPENAI_API_KEY"} <= set(exports), text
        url, question, answer = example(3)
        with openai.OpenAI(base_url=exports["OPENAI_BASE_URL"], api_key=exports["OPENAI_API_KEY"]) as client:
            completion = client.chat.completions.create(model="tiny-shapes", messages=messages(url, question))
        assert completion.choices[0].message.content == answer
        os.killpg(up.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
        assert up.proc.wait(90) == 0
        assert not [f"{pid} {name}" for pid, name in up.started.items() if alive(pid)]
    finally:
        up.close()
