"""The archive object format: one self-describing, authenticated blob per archived KV item.

    blob = MAGIC (8 bytes) ‖ header length (uint32, little-endian) ‖ msgpack header ‖ payload ‖ tag (32 bytes)
    tag  = HMAC-SHA256(archive key, everything before it)

The archive key (``VLMQ_KV_ARCHIVE_KEY``) is held by workers only. Anyone who can write ``kv/`` (an untenanted
producer, every process on a ``file://`` store) could otherwise take image Y's object, put image X's key in its
header, and have X answered with Y's encoder output: a checksum over the payload alone proves nothing about
the header, and one anybody can compute proves nothing at all.

The header is a msgpack map:
    format   int    FORMAT_VERSION
    kind     str    "enc" (vision encoder output) or "prefix" (the KV of one prefix-cache block)
    key      str    the item's key (encoder-cache key, or prefix block hash in hex)
    model    str    the weights' identity (identity.py); another checkpoint's object is never used
    layout   str    what the tensors mean ("enc: embeds [tokens, hidden]", "prefix: kv [layers, 2, block, heads, dim]")
    dtype    str    the dtype of the restored tensor (the cache dtype)
    quant    str    "" (lossless), "int8" or "fp8"
    tensors  list   [[name, dtype, shape], ...] in payload order, each C-contiguous

Decoding never unpickles and never calls torch.load: it parses the header with size limits, checks its version,
verifies the tag, checks every field against what the caller expects (the key the object was fetched under,
the model), and only then views the payload as tensors. Any mismatch raises BadObject, which the store counts
as a miss (the caller recomputes). Format 1 (a payload checksum, no tag) is refused as ``old_version``.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from math import prod

import msgpack
import torch

from vlmq.kernels.kv import dequantize_kv_blocks, quantize_kv_blocks

FORMAT_VERSION = 2  # 2: authenticated with the archive key; 1: a payload checksum only
MAGIC = b"VLMQKV1\n"  # the family of formats (the version is in the header)
TAG_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16
MAX_HEADER_BYTES = 1 << 16
KINDS = ("enc", "prefix")
QUANTS = {"": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "float8_e4m3fn": torch.float8_e4m3fn}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
LAYOUTS = {"enc": "enc: embeds [tokens, hidden]", "prefix": "prefix: kv [layers, 2, block, heads, dim]"}


class BadObject(ValueError):
    """An archive object that must not be used; `reason` is a short counter name (truncated, checksum, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Expected:
    """What the caller needs: a blob that says anything else is refused."""

    kind: str
    key: str
    model: str
    shape: tuple[int, ...]  # of the restored tensor
    dtype: torch.dtype  # of the restored tensor


def _as_blocks(x: torch.Tensor, kind: str) -> torch.Tensor:
    # The kernels quantise [blocks, block_size, heads, dim] with one scale per (block, head).
    if kind == "enc":  # one scale per token: [tokens, 1, 1, hidden]
        return x.reshape(x.shape[0], 1, 1, x.shape[1])
    layers, two, block, heads, dim = x.shape  # one scale per (layer, K|V, head)
    return x.reshape(layers * two, block, heads, dim)


def _payload(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list, bytes]:
    specs, parts = [], []
    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        specs.append([name, _DTYPE_NAMES[t.dtype], list(t.shape)])
        parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return specs, b"".join(parts)


def _tag(secret: bytes, signed: bytes | memoryview) -> bytes:
    assert len(secret) >= MIN_SECRET_BYTES, "the archive key is too short"
    return hmac.new(secret, signed, hashlib.sha256).digest()


def encode(kind: str, key: str, model: str, tensor: torch.Tensor, quant: str = "", *, secret: bytes) -> bytes:
    """Serialise one item, signed with `secret`; `quant` "int8" / "fp8" stores it quantised (symmetric, see
    vlmq.kernels.kv)."""
    assert kind in KINDS and quant in QUANTS, (kind, quant)
    if quant:
        q, scales = quantize_kv_blocks(_as_blocks(tensor.detach().float().contiguous(), kind), QUANTS[quant],
                                       impl="torch")
        tensors = [("q", q), ("scales", scales)]
    else:
        tensors = [("data", tensor)]
    specs, payload = _payload(tensors)
    header = {"format": FORMAT_VERSION, "kind": kind, "key": key, "model": model, "layout": LAYOUTS[kind],
              "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "quant": quant, "tensors": specs}
    raw = msgpack.packb(header, use_bin_type=True)
    signed = MAGIC + struct.pack("<I", len(raw)) + raw + payload
    return signed + _tag(secret, signed)


def read_header(blob: bytes) -> tuple[dict, memoryview]:
    """The parsed header and the payload bytes (not yet authenticated); BadObject if the framing or the header
    is malformed, ``old_version`` for an older format, ``bad_version`` for a newer one."""
    if len(blob) < len(MAGIC) + 4 or blob[:len(MAGIC)] != MAGIC:
        raise BadObject("not_archive", "no vlmq KV magic (a pickle, or another file)")
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    if n > MAX_HEADER_BYTES or start + n > len(blob):
        raise BadObject("truncated", f"header of {n} bytes does not fit a {len(blob)}-byte object")
    try:
        header = msgpack.unpackb(blob[start:start + n], raw=False, strict_map_key=True, max_bin_len=0,
                                 max_ext_len=0, max_str_len=4096, max_array_len=64, max_map_len=32)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise BadObject("bad_header", str(e)) from None
    version = header.get("format") if isinstance(header, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version < FORMAT_VERSION:
        raise BadObject("old_version", f"format {version}: written before archive objects were authenticated")
    if version != FORMAT_VERSION:
        raise BadObject("bad_version", f"format {version}")
    if start + n + TAG_BYTES > len(blob):
        raise BadObject("truncated", "no room for the tag")
    return header, memoryview(blob)[start + n:len(blob) - TAG_BYTES]


def decode(blob: bytes, expected: Expected, *, secret: bytes) -> torch.Tensor:
    """The item's tensor ([shape] in the expected dtype, on CPU), or BadObject if anything does not match: an
    object not signed with `secret` is ``unauthenticated``, one signed for another key ``wrong_key``."""
    header, payload = read_header(blob)
    signed = memoryview(blob)[:len(blob) - TAG_BYTES]
    if not hmac.compare_digest(_tag(secret, signed), bytes(memoryview(blob)[len(blob) - TAG_BYTES:])):
        raise BadObject("unauthenticated", "not signed with this pool's archive key (forged, truncated or corrupt)")
    _check_header(header, expected)
    tensors = _tensors(header, payload)
    if header["quant"]:
        q, scales = tensors.get("q"), tensors.get("scales")
        if q is None or scales is None or q.numel() != prod(expected.shape) or q.dim() != 4:
            raise BadObject("bad_shape", "quantised tensors do not match the item")
        try:
            out = dequantize_kv_blocks(q, scales, torch.float32, impl="torch")
        except ValueError as e:
            raise BadObject("bad_shape", str(e)) from None
        return out.reshape(expected.shape).to(expected.dtype)
    data = tensors.get("data")
    if data is None or tuple(data.shape) != expected.shape or data.dtype != expected.dtype:
        raise BadObject("bad_shape", "stored tensor does not match the item")
    return data


def _check_header(header: dict, exp: Expected) -> None:
    fields = {"kind": exp.kind, "model": exp.model, "key": exp.key}
    for name, want in fields.items():
        if header.get(name) != want:
            raise BadObject("other_model" if name == "model" else "wrong_key",
                            f"{name} {header.get(name)!r} != {want!r}")
    if header.get("dtype") != _DTYPE_NAMES.get(exp.dtype) or header.get("shape") != list(exp.shape):
        raise BadObject("bad_shape", f"{header.get('dtype')} {header.get('shape')} != {exp.dtype} {list(exp.shape)}")
    if header.get("layout") != LAYOUTS[exp.kind] or header.get("quant") not in QUANTS:
        raise BadObject("bad_header", f"layout {header.get('layout')!r}, quant {header.get('quant')!r}")


def _tensors(header: dict, payload: memoryview) -> dict[str, torch.Tensor]:
    specs = header.get("tensors")
    if not isinstance(specs, list):
        raise BadObject("bad_header", "no tensor list")
    out, offset = {}, 0
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 3 and spec[1] in DTYPES and isinstance(spec[2], list)
                and all(isinstance(d, int) and d >= 0 for d in spec[2])):
            raise BadObject("bad_header", f"tensor spec {spec!r}")
        name, dtype, shape = spec[0], DTYPES[spec[1]], tuple(spec[2])
        nbytes = prod(shape) * dtype.itemsize
        if offset + nbytes > len(payload):
            raise BadObject("truncated", f"tensor {name!r} runs past the payload")
        raw = bytearray(payload[offset:offset + nbytes])  # a private copy the tensor owns
        out[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        offset += nbytes
    if offset != len(payload):
        raise BadObject("bad_shape", f"{len(payload) - offset} payload bytes left over")
    return out
