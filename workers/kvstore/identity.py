"""The weights' identity: a hash that changes whenever the checkpoint does, equal on every machine.

sha256 over config.json and, per safetensors file (sorted by name): its name, size, JSON header (tensor names,
dtypes, shapes, offsets, metadata) and three 1 MiB samples of its data (start, middle, end). File times are left
out, so two copies of one checkpoint agree; the data samples tell apart fine-tunes whose headers are identical.
Archived KV lives under this hash: a new checkpoint never reads old KV.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLE_BYTES = 1 << 20


def _sample_file(h, path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h.update(json.dumps([path.name, size, n]).encode())
        h.update(f.read(min(n, 1 << 24)))  # the JSON header
        data_start = 8 + n
        for at in (data_start, (data_start + size) // 2, max(data_start, size - SAMPLE_BYTES)):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))


def weights_identity(model_dir: str | Path) -> str:
    """32 hex digits naming the checkpoint in `model_dir`."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        _sample_file(h, f)
    return h.hexdigest()[:32]
