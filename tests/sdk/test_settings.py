"""Settings: one declaration per VLMQ_* variable; the environment, child processes and the README agree."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from vlmq.settings import (
    ENV_VARS,
    READERS,
    README_BEGIN,
    README_END,
    Settings,
    env_name,
    markdown_table,
    readme_table,
    update_readme,
)
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


def test_the_readme_configuration_table_is_the_generated_one() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert readme_table(readme) == markdown_table(), "run: python -m vlmq.settings --update-readme README.md"
    for f in dataclasses.fields(Settings):  # every setting, in the table of its reader
        title = READERS[f.metadata["reader"]]
        section = markdown_table().split(title, 1)[1].split("Read by", 1)[0]
        assert f"| `{env_name(f.name)}` |" in section


def test_update_readme_rewrites_only_the_marked_table(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(f"# x\n\nbefore\n{README_BEGIN}\n| stale |\n{README_END}\nafter\n")
    assert update_readme(path) is True and update_readme(path) is False
    text = path.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{README_END}\nafter\n")
    assert "stale" not in text and readme_table(text) == markdown_table()
    run = subprocess.run([sys.executable, "-m", "vlmq.settings", "--markdown"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == markdown_table()


def test_every_setting_round_trips_through_the_environment() -> None:
    changed = Settings(broker_url="redis://h:1/2", storage_url="s3://b/p", s3_endpoint_url="http://s3:9",
                       models={"a": "/m/a", "b": "/m/b"}, cost_classes="xs=100,xl", text_token_bound=7,
                       max_image_bytes=8, max_image_pixels=9, job_ttl=10, max_new_tokens=11, max_prompt_chars=12,
                       max_queue_depth="xs=3", visibility_timeout=13, max_attempts=14, shutdown_grace=15,
                       storage_retry=16, worker_budget=17, worker_batch=18, worker_classes="xs", backend="hf",
                       device="cuda:1", tenant="acme", speculative="ngram")
    defaults = Settings()
    assert all(getattr(changed, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(Settings))
    env = changed.to_env()
    assert set(env) == {env_name(f.name) for f in dataclasses.fields(Settings)} == set(ENV_VARS)
    assert Settings.from_env(env) == changed
    assert Settings.from_env({}) == defaults and Settings.from_env(defaults.to_env()) == defaults
    assert Settings.from_env({"VLMQ_WORKER_BATCH": ""}).worker_batch == 16  # empty means unset
    assert Settings.from_env({"AWS_ENDPOINT_URL": "http://aws:1"}).s3_endpoint_url == "http://aws:1"


def test_a_bad_variable_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="VLMQ_WORKER_BATCH='many': must be an integer"):
        Settings.from_env({"VLMQ_WORKER_BATCH": "many"})
    with pytest.raises(ValueError, match="VLMQ_MODELS='x': VLMQ_MODELS entries look like name=/path"):
        Settings.from_env({"VLMQ_MODELS": "x"})
    with pytest.raises(ValueError, match="worker_batch must be positive"):
        Settings.from_env({"VLMQ_WORKER_BATCH": "0"})


def test_speculative_setting_is_checked():
    from vlmq.settings import Settings

    assert Settings.from_env({"VLMQ_SPECULATIVE": "draft:../draft"}).speculative == "draft:../draft"
    assert Settings.from_env({}).speculative == ""
    for bad in ("eagle", "draft", "ngram:x"):
        with pytest.raises(ValueError, match="speculative"):
            Settings.from_env({"VLMQ_SPECULATIVE": bad})
