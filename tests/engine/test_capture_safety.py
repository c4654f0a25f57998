"""What a CUDA graph captures must not wait for the device: no device-to-host reads (`.item()`, `int(t)`,
`.tolist()`, `nonzero`, boolean-mask indexing, shapes that depend on data) and no host data copied in
(`torch.tensor([...])` inside the step). Checked on CPU, on the kernel path (attention_backend="kernels", the
Triton interpreter), by recording the ops the step dispatches.

Not checkable on CPU: a tensor created on the host while the step's inputs are on the GPU (every tensor here is
on the CPU). By reading: the decode step creates tensors only with `device=` of its inputs, and the rotary table
moves to the device on the first (eager, warm-up) call, never inside a capture.
"""
from __future__ import annotations

import importlib
import inspect
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlmq.workers.engine.cuda_graphs import DecodeGraphs, eager_capture
from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.layers.cascade_route import route_for
from vlmq.workers.models.loader import load_model

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
BS = 4
aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
         aten._unique2, aten.unique_consecutive, aten.unique_dim, aten.bincount}
INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
HOST_DATA = {aten.lift_fresh, aten.lift_fresh_copy}  # torch.tensor(host data)
# The kernel wrappers' argument checks read CPU tensors only: each sits behind `if ... .is_cuda` (checked below)
CPU_ONLY_CHECKS = [(importlib.import_module(f"vlmq.kernels.{module}"), name) for module, name in
                   (("kv", "store_kv"), ("_checks", "check_lens_fit"), ("attention", "_check_groups"))]
SKIPPED = {(module.__file__, name) for module, name in CPU_ONLY_CHECKS}


class HostSyncs(TorchDispatchMode):
    """Records ops that read device data on the host, or copy host data in; `.tolist()` does not dispatch (on a CPU
    tensor), so it is wrapped while the mode is on. Ops inside the Triton interpreter (its CPU emulation of a
    launch) and the wrappers' CPU-only checks are not recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.host_data: list[str] = []

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        mode = self

        def tolist(t):
            mode._record(mode.reads, "Tensor.tolist")
            return mode._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        bool_index = packet in INDEX and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] or ()))
        unsized = packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) == 1
        if packet in READS or bool_index or unsized:
            self._record(self.reads, str(func))
        elif packet in HOST_DATA:
            self._record(self.host_data, str(func))
        return func(*args, **kwargs)

    def _record(self, into: list[str], what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if any("triton/runtime/interpreter" in f.filename for f in stack):
            return
        if any((f.filename, f.name) in SKIPPED for f in stack):
            return
        into.append(f"{what} at " + " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in stack[-4:][::-1]))


def test_the_recorder_sees_each_kind_of_host_sync():
    x = torch.arange(6)
    for sync in (lambda: x.tolist(), lambda: int(x[0]), lambda: x[x > 2], lambda: x.nonzero(), lambda: bool(x[1]),
                 lambda: torch.repeat_interleave(x)):
        with HostSyncs() as rec:
            sync()
        assert rec.reads, inspect.getsource(sync)
    with HostSyncs() as rec:
        torch.tensor([1, 2])
        x[torch.tensor([0, 1])]  # an index tensor: no read, but host data copied in
    assert rec.host_data and not rec.reads


def test_the_kernels_checks_that_read_tensors_are_skipped_on_cuda():
    for module, name in CPU_ONLY_CHECKS:
        assert ".is_cuda" in inspect.getsource(getattr(module, name))


@pytest.fixture(scope="module")
def model():
    return load_model(TARGET, torch.device("cpu"), torch.float32)


def decode_meta(tables: list[list[int]], ctx: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build([1] * len(ctx), ctx, tables, BS, backend="kernels")


def test_a_captured_decode_step_and_its_replays_never_sync(model):
    checked = []

    def capture(step, device, pool):  # as eager_capture, with the step recorded while it is captured
        with HostSyncs() as rec:
            replay, out, pool = eager_capture(step, device, pool)
        checked.append(rec)
        return replay, out, pool

    kv_caches = model.make_kv_caches(32, BS)
    graphs = DecodeGraphs(model, kv_caches, BS, 64, (2, 4), backend="kernels", capture=capture)
    x, positions = torch.randn(3, 128), torch.arange(9).view(3, 3)
    assert graphs.run(x, positions, decode_meta([[1, 2], [3, 4, 5], [6]], [5, 9, 3])) is not None
    assert len(checked) == 1 and checked[0].reads == [] and checked[0].host_data == []
    meta = decode_meta([[1, 2, 7], [3, 4, 5], [6]], [9, 10, 4])
    with HostSyncs() as rec:  # a later step: routing, padding, refilling the static buffers and the replay
        assert graphs.run(x, positions, meta) is not None
    assert rec.reads == [] and rec.host_data == [] and graphs.num_replays == 2


def test_the_decode_forward_through_the_kernels_never_reads_the_device(model):
    kv_caches = model.make_kv_caches(64, BS)
    prefix = list(range(1, 41))  # 160 shared tokens, three sequences: the cascade route pays
    for tables, route in (([[41, 42], [43], [44, 45, 46]], False), ([prefix + [41], prefix + [42], prefix], True)):
        ctx = [len(t) * BS - 1 for t in tables]
        meta = decode_meta(tables, ctx)
        with HostSyncs() as rec:
            routed = route_for(meta)  # no block table read back: the metadata keeps the host lists
        assert rec.reads == [] and (routed is not None) == route
        x, positions = torch.randn(len(ctx), 128), torch.tensor(ctx).expand(3, -1)
        with HostSyncs() as rec:
            model.language_model(x, positions, meta, kv_caches)
        assert rec.reads == [] and rec.host_data == []
