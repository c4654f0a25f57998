"""``vlmq up``: the pool ``vlmq demo`` runs (embedded Valkey, ``file://`` storage, workers), kept running for
producers in other shells until Ctrl-C, which stops everything it started.
"""
from __future__ import annotations

import dataclasses
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from vlmq.demo import start_worker, stop_processes
from vlmq.embedded import Server, start_valkey
from vlmq.settings import BOTH, Settings, env_name


@dataclass(slots=True)
class UpOptions:
    workers: int = 1  # CPU worker processes (ignored with gpus)
    gpus: str | None = None  # "all" or "0,1": one supervised worker per GPU instead
    model: str = "tiny-shapes"
    folder: str | None = None  # storage and logs (kept); default: a temporary folder, removed at exit
    port: int | None = None  # Valkey's port; default: a free one

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


def producer_exports(settings: Settings) -> list[str]:
    """``export`` lines of the settings producers and workers must share that differ from their defaults."""
    defaults, env = Settings(), settings.to_env()
    return [f"export {env_name(f.name)}={shlex.quote(env[env_name(f.name)])}" for f in dataclasses.fields(Settings)
            if f.metadata["reader"] == BOTH and getattr(settings, f.name) != getattr(defaults, f.name)]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM stops `vlmq up` the way Ctrl-C does


def _wait_ready(logs: list[Path], workers: list[subprocess.Popen[bytes]], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(" ready." in log.read_text(errors="replace") for log in logs):
        if (dead := [str(log) for log, w in zip(logs, workers, strict=True) if w.poll() is not None]) or \
                time.monotonic() > deadline:
            raise RuntimeError(f"a worker did not start; read {', '.join(dead or map(str, logs))}")
        time.sleep(0.2)


def _start_workers(settings: Settings, options: UpOptions, folder: Path) -> tuple[list[subprocess.Popen[bytes]],
                                                                                   list[Path]]:
    if options.gpus:
        runs = [(settings, ["--model", options.model, "--gpus", options.gpus])]
    else:
        runs = [(dataclasses.replace(settings, device="cpu",
                                     metrics_port=settings.metrics_port + i if settings.metrics_port else 0),
                 ["--model", options.model]) for i in range(options.workers)]
    logs = [folder / f"worker-{i}.log" for i in range(len(runs))]
    procs = [start_worker(s, log, ["-m", "vlmq.workers.main", *args])
             for (s, args), log in zip(runs, logs, strict=True)]
    return procs, logs


def run_up(options: UpOptions) -> int:
    """Start the pool, print what a producer needs, and keep it running until Ctrl-C or SIGTERM."""
    folder = Path(options.folder or tempfile.mkdtemp(prefix="vlmq-up-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    valkey: Server | None = None
    workers: list[subprocess.Popen[bytes]] = []
    try:
        valkey = start_valkey(options.port)
        settings = Settings.from_env(broker_url=valkey.url, storage_url=f"file://{folder / 'storage'}")
        if not settings.kv_archive_key:  # its workers share one archive: a key of this run, for them only
            settings = dataclasses.replace(settings, kv_archive_key=secrets.token_hex(32))
        workers, logs = _start_workers(settings, options, folder)
        print(f"vlmq up: Valkey at {valkey.url}, storage {settings.storage_url}; starting {len(workers)} worker "
              f"process(es) for {options.model} (logs in {folder}) ...", flush=True)
        _wait_ready(logs, workers)
        print("ready. In another shell:\n\n" + "\n".join(producer_exports(settings)) +
              "\n\nCtrl-C stops the workers and the server.", flush=True)
        while all(w.poll() is None for w in workers):
            time.sleep(0.5)
        print(f"vlmq up: a worker exited; read its log in {folder}; stopping", flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nvlmq up: stopping ...", flush=True)
        return 0
    except RuntimeError as e:
        print(f"vlmq up: {e}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        stop_processes(workers, float(Settings.from_env().shutdown_grace) + 15)
        if valkey is not None:
            valkey.stop()
        if not options.folder:
            shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
