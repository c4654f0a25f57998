"""Fixtures shared by the SDK tests."""
from __future__ import annotations

import io
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from PIL import Image


@pytest.fixture(scope="session")
def hf_qwen2vl() -> ModuleType:
    """transformers' PIL Qwen2-VL image processor module (the reference for the cost model).

    The torchvision variant does not import without torchvision; the PIL one has the
    identical ``smart_resize`` and gives identical outputs.
    """
    return pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def _encode(img: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def encode() -> Callable[..., bytes]:
    """``encode(img, fmt, **save_kwargs) -> bytes`` with Pillow."""
    return _encode
