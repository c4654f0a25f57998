"""Kernel tests run the Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is created; the
kernel modules (vlmq.kernels._triton_*) are imported lazily by the wrappers, so
setting it here, at conftest import time, is early enough.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
