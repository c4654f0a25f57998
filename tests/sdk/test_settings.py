"""Settings: one declaration per VLMQ_* variable; the environment, child processes and the README agree."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from vlmq.settings import (
    DOCS_BEGIN,
    DOCS_READERS,
    ENV_VARS,
    READERS,
    README_BEGIN,
    README_END,
    README_READERS,
    Settings,
    env_name,
    markdown_table,
    readme_table,
    update_docs,
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


ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_and_docs_configuration_tables_are_the_generated_ones() -> None:
    readme, docs = (ROOT / "README.md").read_text(), (ROOT / "docs" / "configuration.md").read_text()
    fix = "run: python -m vlmq.settings --update-readme README.md --update-docs docs/configuration.md"
    assert readme_table(readme) == markdown_table(README_READERS), fix
    assert readme_table(docs, DOCS_BEGIN) == markdown_table(DOCS_READERS), fix
    assert "docs/configuration.md" in readme  # the README says where the rest are
    documented = readme_table(readme) + readme_table(docs, DOCS_BEGIN)
    for f in dataclasses.fields(Settings):  # every setting once, in the table of its reader
        row = f"| `{env_name(f.name)}` |"
        assert documented.count(row) == 1, env_name(f.name)
        section = documented.split(READERS[f.metadata["reader"]] + ":", 1)[1].split("Read by", 1)[0]
        assert row in section, env_name(f.name)


def test_update_readme_and_docs_rewrite_only_the_marked_table(tmp_path: Path) -> None:
    for begin, update, readers in ((README_BEGIN, update_readme, README_READERS),
                                   (DOCS_BEGIN, update_docs, DOCS_READERS)):
        path = tmp_path / "doc.md"
        path.write_text(f"# x\n\nbefore\n{begin}\n| stale |\n{README_END}\nafter\n")
        assert update(path) is True and update(path) is False
        text = path.read_text()
        assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{README_END}\nafter\n")
        assert "stale" not in text and readme_table(text, begin) == markdown_table(readers)
    run = subprocess.run([sys.executable, "-m", "vlmq.settings", "--markdown"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == markdown_table()
    assert all(f"| `{name}` |" in run.stdout for name in ENV_VARS)


def test_the_command_line_updates_both_documents(tmp_path: Path) -> None:
    readme, docs = tmp_path / "README.md", tmp_path / "configuration.md"
    readme.write_text(f"{README_BEGIN}\n{README_END}\n")
    docs.write_text(f"{DOCS_BEGIN}\n{README_END}\n")
    run = subprocess.run([sys.executable, "-m", "vlmq.settings", "--update-readme", str(readme), "--update-docs",
                          str(docs)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{readme}: updated\n{docs}: updated\n"
    assert readme_table(readme.read_text()) == markdown_table(README_READERS)
    assert readme_table(docs.read_text(), DOCS_BEGIN) == markdown_table(DOCS_READERS)


def test_every_setting_round_trips_through_the_environment() -> None:
    changed = Settings(broker_url="redis://h:1/2", storage_url="s3://b/p", s3_endpoint_url="http://s3:9",
                       models={"a": "/m/a", "b": "/m/b"}, cost_classes="xs=100,xl", text_token_bound=7,
                       max_image_bytes=8, max_image_pixels=9, job_ttl=10, max_new_tokens=11, max_prompt_chars=12,
                       max_images_per_job=22,
                       max_queue_depth="xs=3", batch_max_bad_share=0.25, visibility_timeout=13, max_attempts=14,
                       shutdown_grace=15,
                       storage_retry=16, orphan_grace=22, worker_budget=17, worker_batch=18, worker_classes="xs",
                       backend="hf",
                       device="cuda:1", tenant="acme", retention=19, webhook_allow="127.0.0.1/32",
                       webhook_url="https://example.com/h", webhook_secrets="whsec_x", webhook_retry_schedule="1,2.5",
                       webhook_timeout=2.5, webhook_concurrency=3, webhook_inline_max=4, webhook_poll=0.25,
                       webhook_ca_file="/etc/vlmq/ca.pem", image_fetch_allow="img.example.com s3://photos",
                       image_fetch_networks="127.0.0.1/32", image_fetch_timeout=4.5, image_fetch_redirects=1,
                       image_fetch_retries=0, image_fetch_ca_file="/etc/vlmq/img-ca.pem",
                       fake_gpus="0,1", metrics_port=9100, worker_events=True, log_format="json",
                       kv_archive=0, kv_archive_key="k" * 32, kv_archive_bytes=19, kv_archive_quant="tiny=int8",
                       kv_host_bytes=20,
                       kv_disk_dir="/d", kv_disk_bytes=21, affinity=False, affinity_queue_bound=19, affinity_ttl=20,
                       speculative="ngram",
                       tenant_cache_sharing=True, serve_max_file_bytes=23, serve_max_file_lines=24,
                       serve_max_body_bytes=25, serve_max_json_depth=26, serve_read_timeout=2.5,
                       serve_body_timeout=3.5, serve_chat_timeout=4.5)
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


def test_kv_archive_quantisation_is_per_model() -> None:
    assert Settings().kv_quant("tiny") == ""  # lossless by default
    assert Settings(kv_archive_quant="fp8").kv_quant("any") == "fp8"
    per_model = Settings(kv_archive_quant="tiny=int8,big=fp8")
    assert (per_model.kv_quant("tiny"), per_model.kv_quant("big"), per_model.kv_quant("other")) == ("int8", "fp8", "")
    with pytest.raises(ValueError, match="kv_archive_quant must be int8, fp8 or name=int8"):
        Settings.from_env({"VLMQ_KV_ARCHIVE_QUANT": "int4"})


def test_speculative_setting_is_checked() -> None:
    assert Settings.from_env({"VLMQ_SPECULATIVE": "draft:../draft"}).speculative == "draft:../draft"
    assert Settings.from_env({}).speculative == ""  # the model folder's default
    assert Settings.from_env({"VLMQ_SPECULATIVE": "none"}).speculative == "none"
    for bad in ("eagle", "draft", "ngram:x"):
        with pytest.raises(ValueError, match="speculative"):
            Settings.from_env({"VLMQ_SPECULATIVE": bad})
