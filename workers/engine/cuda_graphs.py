"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use, replayed padded up.

A decode step of S sequences replays the graph of the smallest bucket >= S; rows S.. of the bucket are padding:
token 0 at position 0, context length 0 (the decode kernel returns zeros for an empty KV set), slot -1 (store_kv
skips it) and an all-zero block table, so padding neither reads nor writes the cache. Block tables are padded to a
fixed width (the longest sequence the cache can hold), and the captured kernel is sized for that context length.
Steps with a prefill chunk, with a cascade group (cascade_route.py), wider than the buckets, or with extra LM
inputs (DeepStack) run eagerly. `EngineConfig.cuda_graph_max_seqs = 0` turns graphs off.

The bucket and padding logic is pure and tested on CPU. Capture and replay go through a `capture` function (default
`cuda_capture`: warm-up on a side stream, then a CUDA graph); CPU tests pass `eager_capture`, which runs the step
again from the static buffers at each replay, so `DecodeGraphs.run` (buckets, refills, reuse, eager fallbacks) runs
end to end on CPU with the kernel path (attention_backend="kernels"). The real capture has not run on a GPU yet:
scripts/gpu_check.sh runs the engine parity tests with graphs on and off.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.layers.cascade_route import route_for


def graph_batch_sizes(max_seqs: int) -> tuple[int, ...]:
    """Buckets 1, 2, 4, 8, then every 8 up to max_seqs (itself included); () when max_seqs is 0 (graphs off)."""
    if max_seqs < 0:
        raise ValueError(f"cuda_graph_max_seqs must be >= 0, got {max_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_seqs} | set(range(8, max_seqs + 1, 8))
    return tuple(sorted(sizes | ({max_seqs} if max_seqs else set())))


def pick_bucket(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding num_seqs rows, or None (run eagerly)."""
    return next((s for s in sizes if s >= num_seqs), None)


@dataclass(slots=True)
class DecodeBatch:
    """A decode step's LM inputs padded to a bucket; the graph's static buffers have these shapes."""

    x: torch.Tensor  # [B, hidden] input embeddings
    positions: torch.Tensor  # [R, B] rotary positions
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_context_lens: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [B] int64, -1 on padding rows


def pad_decode_batch(x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int,
                     max_blocks: int) -> DecodeBatch:
    """Pad a decode step (S <= bucket sequences of one token, tables at most max_blocks wide) to the bucket."""
    num_seqs, width = meta.block_tables.shape
    assert meta.max_query_len == 1 and num_seqs <= bucket and width <= max_blocks, (num_seqs, width, bucket)
    pad = bucket - num_seqs
    tables = torch.nn.functional.pad(meta.block_tables, (0, max_blocks - width, 0, pad))
    cu = torch.cat([meta.cu_context_lens, meta.cu_context_lens[-1:].expand(pad)])  # empty KV on padding rows
    slots = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
    return DecodeBatch(torch.nn.functional.pad(x, (0, 0, 0, pad)), torch.nn.functional.pad(positions, (0, pad)),
                       tables, cu, slots)


# capture(step, device, pool) -> (replay, out, pool): record `step` (which reads and writes only static buffers),
# return a function that re-runs it, its static output and the memory pool for the next capture
Step = Callable[[], torch.Tensor]
Capture = Callable[[Step, torch.device, object], tuple[Callable[[], object], torch.Tensor, object]]


def cuda_capture(step: Step, device: torch.device, pool: object) -> tuple[Callable[[], object], torch.Tensor, object]:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the graph: Triton compiles, allocator settles
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the KV store's I/O thread copies archived / demoted KV to the host (a synchronous copy) at any
    # time, e.g. just after an image's prefill, when the first decode captures; "global" (the default) would fail
    # both that copy and the capture. The capturing thread itself is held to the same rules either way.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph.replay, out, graph.pool()


def eager_capture(step: Step, device: torch.device, pool: object) -> tuple[Callable[[], object], torch.Tensor, object]:
    """A stand-in for CPU tests: replay recomputes the step from the static inputs into the same static output."""
    out = step()
    return lambda: out.copy_(step()), out, pool


@dataclass(slots=True)
class _Graph:
    replay: Callable[[], object]
    inputs: DecodeBatch  # static buffers, refilled before each replay
    out: torch.Tensor  # [B, hidden] static output


class DecodeGraphs:
    """Capture-once, replay-padded decode graphs of `model.language_model` (CUDA; on CPU with eager_capture)."""

    def __init__(self, model, kv_caches, block_size: int, max_context_len: int, sizes: tuple[int, ...],
                 backend: str = "auto", capture: Capture = cuda_capture) -> None:
        self.lm, self.kv_caches, self.block_size, self.sizes = model.language_model, kv_caches, block_size, sizes
        self.max_blocks = -(-max_context_len // block_size)
        self.backend, self.capture = backend, capture  # the captured step must take the kernel path
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # one memory pool shared by every bucket's graph
        self.num_replays = 0

    @classmethod
    def for_runner(cls, model, config, kv_caches, device: torch.device,
                   capture: Capture | None = None) -> DecodeGraphs | None:
        """Graphs for a runner: on CUDA, or with an explicit `capture`; never with the torch backend (its plan is
        built from host lists, which a replay cannot refill)."""
        if (capture is None and device.type != "cuda") or not config.cuda_graph_max_seqs:
            return None
        if config.attention_backend == "torch":
            return None
        max_len = min(model.config.text_config.max_position_embeddings, config.max_num_kv_tokens)
        return cls(model, kv_caches, config.block_size, max_len, graph_batch_sizes(config.cuda_graph_max_seqs),
                   config.attention_backend, capture or cuda_capture)

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [S, hidden] from a graph replay, or None when this step runs eagerly."""
        bucket = pick_bucket(len(meta.query_lens), self.sizes)
        if (bucket is None or meta.max_query_len != 1 or meta.block_tables.shape[1] > self.max_blocks
                or route_for(meta) is not None):
            return None
        graph = self.graphs.get(bucket) or self._capture(bucket, x, positions)
        padded = pad_decode_batch(x, positions, meta, bucket, self.max_blocks)
        for name in DecodeBatch.__slots__:
            getattr(graph.inputs, name).copy_(getattr(padded, name), non_blocking=True)
        graph.replay()
        self.num_replays += 1
        # a copy: the static output is overwritten by the next replay, and callers keep the hidden states
        # (ModelRunner.last_hidden, a proposer's features)
        return graph.out[:len(meta.query_lens)].clone()

    def _capture(self, bucket: int, x: torch.Tensor, positions: torch.Tensor) -> _Graph:
        device = x.device
        inputs = DecodeBatch(
            x.new_zeros(bucket, x.shape[1]), positions.new_zeros(positions.shape[0], bucket),
            torch.zeros(bucket, self.max_blocks, dtype=torch.int32, device=device),
            torch.zeros(bucket + 1, dtype=torch.int32, device=device),
            torch.full((bucket,), -1, dtype=torch.long, device=device))  # capture writes nothing to the cache
        meta = AttentionMetadata([1] * bucket, [self.max_blocks * self.block_size] * bucket, inputs.block_tables,
                                 inputs.slot_mapping, torch.arange(bucket + 1, dtype=torch.int32, device=device),
                                 inputs.cu_context_lens, self.block_size, backend=self.backend)
        meta.cascade = False  # the captured step is plain paged decode; cascade steps never replay

        def step() -> torch.Tensor:
            return self.lm(inputs.x, inputs.positions, meta, self.kv_caches)

        replay, out, self.pool = self.capture(step, device, self.pool)
        self.graphs[bucket] = _Graph(replay, inputs, out)
        return self.graphs[bucket]
