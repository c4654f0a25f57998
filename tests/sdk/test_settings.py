"""Worker backend selection: the engine by default, ``hf`` by VLMQ_BACKEND or ``--backend``."""
from __future__ import annotations

import argparse

import pytest

from vlmq.settings import Settings
from vlmq.worker_args import add_worker_arguments


def test_the_engine_is_the_default_backend_and_hf_stays_selectable() -> None:
    assert Settings().backend == "engine"
    assert Settings.from_env({}).backend == "engine"
    assert Settings.from_env({"VLMQ_BACKEND": "hf"}).backend == "hf"
    assert Settings.from_env({"VLMQ_BACKEND": "hf"}, backend="engine").backend == "engine"  # --backend wins
    assert Settings.from_env(Settings(backend="hf").to_env()).backend == "hf"  # what a child worker sees
    with pytest.raises(ValueError, match="backend must be one of engine, hf"):
        Settings(backend="vllm")


def test_worker_backend_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert parser.parse_args(["--backend", "hf"]).backend == "hf"
    assert parser.parse_args([]).backend is None  # then VLMQ_BACKEND, then the engine
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "vllm"])
    assert "invalid choice: 'vllm'" in capsys.readouterr().err
