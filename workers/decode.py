"""Image decoding off the model's path: a few child processes, each with an address-space limit, each image with
a CPU-time budget.

Why a process: Pillow runs Python code while decoding (PNG chunk handlers, the BMP RLE decoder, mode
conversions), so an image decoded on one of the worker's threads holds the GIL the model thread needs. In a child
process a slow image costs only that child: one that passes its CPU budget is ended by the kernel (a ``SIGPROF``
CPU-time timer) and the job fails with ``decode_timeout``; one that passes its memory limit (``RLIMIT_AS``) fails
with ``decode_out_of_memory``; a child that dies otherwise fails the job with ``decode_crashed``. All three are
non-retryable: the same bytes would do the same again. The child runs :func:`vlmq.images.decode`, so every refusal
of :func:`vlmq.images.probe` comes back with the same code. Children run at a lower CPU priority (``nice``) so the
model keeps the cores it needs.

Wire between parent and child (pipes; no pickle): a 4-byte big-endian length, a JSON header, then a body of the
header's ``size`` bytes. A child first says ``{"ready": true, "size": 0}`` (budgets count from then on). Request
header ``{"limits": {...}, "cpu_seconds": s, "size": n}``, body the encoded image; reply header
``{"width": w, "height": h, "size": n}`` with the RGB pixels as body, or ``{"code": c, "message": m, "size": 0}``.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import IO, Any

from PIL import Image

from vlmq import images
from vlmq.errors import InvalidRequest
from vlmq.images import ImageLimits

log = logging.getLogger(__name__)
_LENGTH = struct.Struct(">I")
_START_S = 60.0  # a child must start within this (not counted in any image's budget)


@dataclass(frozen=True, slots=True)
class DecodeBudget:
    """What one image may cost a decoding child.

    Attributes:
        cpu_seconds: CPU time per image.
        wall_factor: wall-clock limit per image as a multiple of ``cpu_seconds`` (a child starved of CPU by a
            busy machine still ends).
        memory_bytes: address-space limit of each child (canonicalising an image at ``max_pixels`` copies it a
            few times).
        processes: children decoding large images at once; more requests wait for a free one.
        nice: CPU priority increment of the children.
        light_pixels: an image of at most this many pixels ...
        light_bytes: ... and at most this many bytes is decoded in the light lane (see :class:`DecodePool`).
        light_processes: children decoding light images at once.
        light_cpu_seconds: CPU time per light image.
    """

    cpu_seconds: float = 10.0
    wall_factor: float = 6.0
    memory_bytes: int = 2 * 1024**3
    processes: int = 2
    nice: int = 10
    light_pixels: int = 4_000_000
    light_bytes: int = 4 * 1024**2
    light_processes: int = 2
    light_cpu_seconds: float = 2.0

    def __post_init__(self) -> None:
        if min(self.cpu_seconds, self.light_cpu_seconds) <= 0 or self.wall_factor < 1 \
                or self.memory_bytes < 256 * 1024**2 or min(self.processes, self.light_processes) < 1:
            raise ValueError(f"invalid decode budget {self}")

    @property
    def wall_seconds(self) -> float:
        return self.cpu_seconds * self.wall_factor


class _Lost(Exception):
    """The child died or ran out of time; ``code`` and the message say which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Child:
    """One decoding process and its pipes."""

    def __init__(self, budget: DecodeBudget) -> None:
        self.budget = budget
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlmq.workers.decode", str(budget.memory_bytes), str(budget.nice)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            self._reply(time.monotonic() + _START_S)  # started and imported: budgets count from here
        except _Lost as e:  # the worker's fault, not an image's: the job fails retryable (internal_error)
            self.kill()
            raise RuntimeError(f"an image decoding process did not start: {e}") from None

    def decode(self, data: bytes, limits: ImageLimits) -> Image.Image:
        assert self.proc.stdin is not None
        header = json.dumps({"limits": asdict(limits), "size": len(data), "cpu_seconds": self.budget.cpu_seconds})
        try:
            _write(self.proc.stdin, header.encode(), data)
        except (BrokenPipeError, OSError) as e:
            raise self._lost(f"the decoding process stopped reading: {e}") from e
        reply, body = self._reply(time.monotonic() + self.budget.wall_seconds)
        if "code" in reply:
            raise InvalidRequest(reply["message"], code=reply["code"])
        return Image.frombytes("RGB", (reply["width"], reply["height"]), body)

    def _reply(self, deadline: float) -> tuple[dict[str, Any], bytearray]:
        header = json.loads(self._read(_LENGTH.unpack(self._read(4, deadline))[0], deadline))
        return header, self._read(header["size"], deadline)

    def _read(self, n: int, deadline: float) -> bytearray:
        """Exactly ``n`` bytes of the reply, read straight into one buffer (the pixels are copied once more, by
        Pillow)."""
        assert self.proc.stdout is not None
        fd, out = self.proc.stdout.fileno(), bytearray(n)
        view, filled = memoryview(out), 0
        while filled < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise _Lost("decode_timeout", f"decoding took longer than {self.budget.wall_seconds:g} s of wall time")
            got = os.readv(fd, [view[filled:]])
            if not got:
                raise self._lost("the decoding process exited")
            filled += got
        return out

    def _lost(self, what: str) -> _Lost:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:  # alive but not answering: out of step for good
            self.proc.kill()
            code = self.proc.wait()
        if code == -signal.SIGPROF:
            return _Lost("decode_timeout", f"decoding used more than {self.budget.cpu_seconds} s of CPU")
        return _Lost("decode_crashed", f"{what} (exit status {code}) while decoding this image")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()

    def close(self) -> None:
        """Closes the pipes (an idle child then exits) and reaps the process."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:  # unflushed request bytes to a dead child
                    pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Lane:
    """Children sharing one budget; at most ``processes`` decode at once, more requests wait."""

    def __init__(self, budget: DecodeBudget, processes: int) -> None:
        self.budget = budget
        self._slots = threading.BoundedSemaphore(processes)
        self._idle: list[_Child] = []
        self._lock = threading.Lock()

    def decode(self, data: bytes, limits: ImageLimits) -> Image.Image:
        with self._slots:
            child = self._take()
            try:
                image = child.decode(data, limits)
            except _Lost as e:
                log.warning("image decoding process %d lost: %s: %s", child.proc.pid, e.code, e)
                child.kill()
                raise InvalidRequest(f"{e}; the image is too costly to decode", code=e.code) from None
            except BaseException:
                child.kill()  # a reply cut short leaves the pipe out of step: never reuse it
                raise
            with self._lock:
                self._idle.append(child)
            return image

    def idle_pids(self) -> list[int]:
        with self._lock:
            return [child.proc.pid for child in self._idle]

    def _take(self) -> _Child:
        """An idle child that is still alive (one killed while idle, by the OOM killer say, is replaced)."""
        while True:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            if child is None:
                return _Child(self.budget)
            if child.proc.poll() is None:
                return child
            log.warning("image decoding process %d exited while idle (%s); starting another", child.proc.pid,
                        child.proc.returncode)
            child.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.close()


class DecodePool:
    """Decodes images in child processes within a :class:`DecodeBudget`; thread-safe.

    Two lanes, so that large images queueing for a decoder never hold up ordinary ones: an image whose probe
    (the SDK's header checks, bounded by the limits) shows at most ``light_pixels`` and ``light_bytes`` goes to the
    light lane, with its own processes and the smaller ``light_cpu_seconds`` budget; any other to the heavy lane.
    """

    def __init__(self, budget: DecodeBudget = DecodeBudget()) -> None:
        self.budget = budget
        light = replace(budget, cpu_seconds=min(budget.cpu_seconds, budget.light_cpu_seconds))
        self._heavy, self._light = _Lane(budget, budget.processes), _Lane(light, budget.light_processes)

    def decode(self, data: bytes, limits: ImageLimits) -> Image.Image:
        """Like :func:`vlmq.images.decode`, in a child process.

        Raises:
            InvalidRequest: the codes of :func:`vlmq.images.decode`, or ``decode_timeout``,
                ``decode_out_of_memory``, ``decode_crashed``.
        """
        data = bytes(data)
        info = images.probe(data, limits)  # refused here with the SDK's code, or sized for a lane
        light = info.width * info.height <= self.budget.light_pixels and len(data) <= self.budget.light_bytes
        return (self._light if light else self._heavy).decode(data, limits)

    def idle_pids(self) -> list[int]:
        """Process ids of the decoding processes waiting for work."""
        return self._heavy.idle_pids() + self._light.idle_pids()

    def close(self) -> None:
        self._heavy.close()
        self._light.close()


_pool: DecodePool | None = None
_pool_lock = threading.Lock()


def decode(data: bytes, limits: ImageLimits) -> Image.Image:
    """:func:`vlmq.images.decode` in this process's shared :class:`DecodePool` (started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = DecodePool()
            atexit.register(_pool.close)  # its children exit and are reaped with this process
    return _pool.decode(data, limits)


# --- the child ---------------------------------------------------------------------------------

def _write(out: IO[bytes], header: bytes, body: bytes | memoryview) -> None:
    out.write(_LENGTH.pack(len(header)) + header)
    out.write(body)
    out.flush()


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _serve_one(request: IO[bytes], reply: IO[bytes]) -> None:
    header: dict[str, Any] = json.loads(_read_exactly(request, _LENGTH.unpack(_read_exactly(request, 4))[0]))
    data = _read_exactly(request, header["size"])
    signal.setitimer(signal.ITIMER_PROF, header["cpu_seconds"])  # SIGPROF ends this process past it
    try:
        image = images.decode(data, ImageLimits(**header["limits"]))
        (width, height), pixels = image.size, image.tobytes()
        del image, data
    except InvalidRequest as e:
        _write(reply, json.dumps({"code": e.code, "message": str(e), "size": 0}).encode(), b"")
    except MemoryError:
        message = "decoding needs more memory than the worker allows for one image"
        _write(reply, json.dumps({"code": "decode_out_of_memory", "message": message, "size": 0}).encode(), b"")
    else:
        _write(reply, json.dumps({"width": width, "height": height, "size": len(pixels)}).encode(), pixels)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


def main() -> None:
    memory, nice = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal stops the worker; this child follows on EOF
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    request = sys.stdin.buffer
    _write(reply, json.dumps({"ready": True, "size": 0}).encode(), b"")
    while True:
        try:
            _serve_one(request, reply)
        except EOFError:  # the worker closed the pipe or exited
            return


if __name__ == "__main__":
    main()
