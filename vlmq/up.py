"""``vlmq up``: the pool ``vlmq demo`` runs (embedded Valkey, ``file://`` storage, workers), kept running for
producers in other shells until Ctrl-C, which stops everything it started. ``vlmq up --serve 8000`` runs
``vlmq serve`` too and prints ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (a new key of tenant ``local``).
"""
from __future__ import annotations

import dataclasses
import secrets
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vlmq.children import (
    Child,
    ChildFailed,
    check_alive,
    signals_ignored,
    signals_interrupt,
    start_child,
    stop_children,
    wait_ready,
)
from vlmq.embedded import Server, start_valkey
from vlmq.settings import BOTH, Settings, env_name

READY_TIMEOUT = 600.0  # s: every worker loads its model (a large checkpoint on a GPU takes minutes)


@dataclass(slots=True)
class UpOptions:
    workers: int = 1  # CPU worker processes (ignored with gpus)
    gpus: str | None = None  # "all" or "0,1": one supervised worker per GPU instead
    model: str = "tiny-shapes"
    folder: str | None = None  # storage and logs (kept); default: a temporary folder, removed at exit
    port: int | None = None  # Valkey's port; default: a free one
    serve: int | None = None  # also run ``vlmq serve`` (the OpenAI API) on this port, with a key of tenant "local"

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


def producer_exports(settings: Settings) -> list[str]:
    """``export`` lines of the settings producers and workers must share that differ from their defaults."""
    defaults, env = Settings(), settings.to_env()
    return [f"export {env_name(f.name)}={shlex.quote(env[env_name(f.name)])}" for f in dataclasses.fields(Settings)
            if f.metadata["reader"] == BOTH and getattr(settings, f.name) != getattr(defaults, f.name)]


def _start_workers(settings: Settings, options: UpOptions, folder: Path) -> list[Child]:
    if options.gpus:
        runs = [(settings, ["--model", options.model, "--gpus", options.gpus])]
    else:
        runs = [(dataclasses.replace(settings, device="cpu",
                                     metrics_port=settings.metrics_port + i if settings.metrics_port else 0),
                 ["--model", options.model]) for i in range(options.workers)]
    return [start_child(f"worker {i}", s, folder / f"worker-{i}.log", ["-m", "vlmq.workers.main", *args])
            for i, (s, args) in enumerate(runs)]


SERVE_READY = "Uvicorn running on"  # what vlmq serve's log says once it listens
SERVE_TENANT = "local"  # the tenant of the key ``vlmq up --serve`` makes


def start_serve(settings: Settings, port: int, folder: Path) -> tuple[Child, list[str]]:
    """``vlmq serve`` on ``port`` and a new key of tenant ``local``; the exports an ``openai`` client needs."""
    import redis

    from vlmq import apikeys

    client = redis.Redis.from_url(settings.broker_url)
    key = apikeys.create(client, SERVE_TENANT, "vlmq up")
    client.close()
    child = start_child("vlmq serve", settings, folder / "serve.log",
                        ["-m", "vlmq.cli", "serve", "--port", str(port), "--log-level", "info"], marker=SERVE_READY)
    return child, [f"export OPENAI_BASE_URL=http://127.0.0.1:{port}/v1", f"export OPENAI_API_KEY={key}"]


def run_up(options: UpOptions) -> int:
    """Start the pool, print what a producer needs, and keep it running until Ctrl-C, SIGTERM or SIGHUP.

    A worker that exits, or is not ready within ``READY_TIMEOUT``, stops everything with its cause (exit 1).
    """
    folder = Path(options.folder or tempfile.mkdtemp(prefix="vlmq-up-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    valkey: Server | None = None
    workers: list[Child] = []
    try:
        with signals_interrupt():
            valkey = start_valkey(options.port)
            settings = Settings.from_env(broker_url=valkey.url, storage_url=f"file://{folder / 'storage'}")
            if not settings.kv_archive_key:  # its workers share one archive: a key of this run, for them only
                settings = dataclasses.replace(settings, kv_archive_key=secrets.token_hex(32))
            workers = _start_workers(settings, options, folder)
            openai_exports: list[str] = []
            if options.serve:
                serve, openai_exports = start_serve(settings, options.serve, folder)
                workers.append(serve)
            watched = [Child("embedded Redis-compatible server", valkey.proc), *workers]
            print(f"vlmq up: Valkey at {valkey.url}, storage {settings.storage_url}; starting {len(workers)} worker "
                  f"process(es) for {options.model} (logs in {folder}) ...", flush=True)
            wait_ready(watched, READY_TIMEOUT)
            print("ready. In another shell:\n\n" + "\n".join(producer_exports(settings) + openai_exports) +
                  "\n\nCtrl-C stops the workers and the server.", flush=True)
            while True:
                check_alive(watched)
                time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nvlmq up: stopping ...", flush=True)
        return 0
    except (ChildFailed, RuntimeError) as e:
        print(f"vlmq up: {e}\nstopping", flush=True)
        return 1
    finally:
        with signals_ignored():  # a second signal must not cut the clean-up short
            stop_children(workers, float(Settings.from_env().shutdown_grace) + 15)
            if valkey is not None:
                valkey.stop()
            if not options.folder:
                shutil.rmtree(folder, ignore_errors=True)
