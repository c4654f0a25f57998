"""The worker's shared decode pool (vlmq.workers.decode.decode) closes its child processes when the process exits:
none is left running, nothing is reported unclosed."""
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import io
from PIL import Image
from vlmq.images import ImageLimits
from vlmq.workers import decode
buf = io.BytesIO()
Image.new("RGB", (32, 32)).save(buf, "PNG")
assert decode.decode(buf.getvalue(), ImageLimits()).size == (32, 32)
print(*decode._pool.idle_pids())
"""


def test_the_shared_decode_pool_is_closed_at_exit():
    run = subprocess.run([sys.executable, "-X", "dev", "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ResourceWarning" not in run.stderr, run.stderr
    pids = [int(p) for p in run.stdout.split()]
    assert pids  # the decode ran in a child process
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # exited and reaped before its parent ended
