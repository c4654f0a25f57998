"""Pillow's bicubic resize in C (`_resample.c`), when it was built and reproduces the installed Pillow.

setup.py builds the extension as optional: without a compiler the install still succeeds and `AVAILABLE` is
False (`REASON` says why), and preprocess.py keeps PIL's resize. Pillow 13 changed which pass runs first (the
vertical one when the height shrinks by more than twice as many pixels as the width), so at import we resize a
few small images both ways and keep the order whose output equals PIL's bit for bit; if neither does, the
native path stays off rather than differ from transformers.
"""

from __future__ import annotations

import logging

import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

_missing = ""
try:
    from . import _resample  # type: ignore[attr-defined]
except ImportError as e:  # not built: no compiler at install time, or an unsupported platform
    _resample, _missing = None, f"the C extension was not built or cannot load ({e})"

# (input (w, h), output (w, h)): Pillow 13 runs the vertical pass first on the first two, older Pillow does not;
# both run the horizontal one first on the last two (the last is on the boundary: dh == 2 * dw)
_PROBES = [((40, 30), (80, 15)), ((82, 93), (67, 62)), ((40, 30), (20, 60)), ((50, 60), (40, 40))]
ORDERS = (1, 0)  # 1: Pillow 13's choice of the first pass; 0: always horizontal first (Pillow < 13)


def resize(rgb: np.ndarray, size: tuple[int, int], order: int | None = None) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3] for size = (height, width), as PIL's bicubic resize."""
    src = np.ascontiguousarray(rgb)
    out = np.empty((*size, 3), dtype=np.uint8)
    _resample.resize_rgb(src, src.shape[0], src.shape[1], size, ORDER if order is None else order, out)
    return out


def resize_patches(
    rgb: np.ndarray,
    size: tuple[int, int],
    table: np.ndarray,
    out: np.ndarray,
    patch: int,
    merge: int,
    temporal: int,
) -> None:
    """uint8 [h, w, 3] -> resized to size = (height, width), each byte mapped through table [3, 256] float32,
    written as patch rows into out [height * width / patch**2, 3 * temporal * patch**2] float32 (C-contiguous)."""
    src = np.ascontiguousarray(rgb)
    assert table.dtype == np.float32 and table.shape == (3, 256) and table.flags.c_contiguous
    assert out.dtype == np.float32 and out.flags.c_contiguous
    _resample.resize_patches(src, src.shape[0], src.shape[1], size, ORDER, table, out, patch, merge, temporal)


def kernels(name: str | None = None) -> str:
    """The kernels of the two passes in use, "avx2" (x86-64 CPUs that have it) or "portable" (plain C); with a
    name, switch every caller to them (the tests run both)."""
    return _resample.kernels() if name is None else _resample.kernels(name)


def _pillow_order() -> int | None:
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (oh, ow)) for (w, h), (ow, oh) in _PROBES]
    expected = [np.asarray(Image.fromarray(a).resize(size[::-1], Image.Resampling.BICUBIC)) for a, size in cases]
    for order in ORDERS:
        if all(np.array_equal(resize(a, size, order), e) for (a, size), e in zip(cases, expected, strict=True)):
            return order
    return None


ORDER = _pillow_order() if _resample is not None else None
AVAILABLE = ORDER is not None
REASON = _missing or ("" if AVAILABLE else "its output differs from this Pillow's resize")
if not AVAILABLE:
    logger.info("image resize: PIL (slower, same output); the C resampler is off: %s", REASON)
