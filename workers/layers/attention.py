"""The one attention interface of the engine.

Two entry points, both on flattened (packed) tokens:
- `varlen_attention`: bidirectional attention within segments (`cu_seqlens`), used by the vision tower for
  many images (and windows) in one call.
- `paged_attention`: the LM path. Writes this step's K/V into the paged cache by `slot_mapping`, then each
  sequence's queries attend over its cached context, causally within the step's chunk.

The CPU path is plain torch (`paged_torch`): the sequences of a step that have the same query length (all
decodes, say) gather their blocks into one padded batch and run one masked SDPA, and sequences that share leading
cache blocks attend to those once (cascade), merged by log-sum-exp. On CUDA: `vlmq.kernels` stores K/V by slot and
runs decode-only steps (paged split-KV decode; the cascade kernel, cascade_route.py, for groups sharing an image
prefix, grouped as the CPU path groups them); other steps use flash-attn's paged varlen kernel when it is
installed and the block size allows, else the same torch path without the cascade.

`AttentionMetadata.backend` (EngineConfig.attention_backend, config.ATTENTION_BACKENDS) picks the route: "auto" =
the kernels on CUDA, torch elsewhere; "kernels" = the kernels on any device (on CPU through the Triton interpreter:
how CPU tests run the CUDA path's wiring); "torch" = never the kernels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmq.workers.engine.config import ATTENTION_BACKENDS
from vlmq.workers.engine.device_defaults import prefill_path
from vlmq.workers.layers.cascade_route import cascade_attention, route_for
from vlmq.workers.layers.paged_torch import TorchPlan, torch_paged_attention

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func as _flash_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    _flash_varlen_func = None

try:  # our Triton kernels (KV store by slot, paged decode); they need triton only when they run on CUDA
    from vlmq import kernels as _kernels
except ImportError:  # pragma: no cover - depends on the install
    _kernels = None


# layer calls per route since import ("cascade", "paged_decode", "flash", "torch"), counted when this Python code
# runs (a CUDA graph replay does not run it): tests and benchmarks read it
route_counts: Counter[str] = Counter()


def _kernel_impl(x: torch.Tensor, backend: str) -> str | None:
    # the kernel wrappers' impl when this step runs on our kernels, None for the torch / flash path
    if backend == "kernels":
        return "triton"  # on CPU tensors the wrappers then need TRITON_INTERPRET=1
    return "auto" if backend == "auto" and x.is_cuda and _kernels is not None else None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention layout; sequences appear in the flattened token batch in this order."""

    query_lens: list[int]  # new tokens of each sequence in this step (prefill chunk length, or 1 for decode)
    context_lens: list[int]  # tokens in the cache for each sequence after this step (includes the new ones)
    block_tables: torch.Tensor  # [S, max_blocks] int32, cache block ids of each sequence (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) of every new token
    cu_query_lens: torch.Tensor  # [S + 1] int32, token offsets of each sequence in the flattened batch
    cu_context_lens: torch.Tensor  # [S + 1] int32
    block_size: int
    torch_plan: TorchPlan | None = None  # the torch path's plan, built by the first layer and reused by the rest
    cascade: object = None  # kernel decode steps: cascade_route.route_for's route (False: none), built once
    # block_tables as host lists (rows unpadded): cascade routing reads them without a device sync; None when the
    # metadata was not built from host lists (a CUDA graph's static buffers: it never routes)
    host_block_tables: list[list[int]] | None = None
    backend: str = "auto"  # one of ATTENTION_BACKENDS

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        slot_mapping: list[int] | None = None,
        backend: str = "auto",
    ) -> AttentionMetadata:
        """Sequences in batch order; `slot_mapping` (the scheduler's, if it made one) is derived from the block
        tables when not given."""
        assert len(query_lens) == len(context_lens) == len(block_tables)
        assert backend in ATTENTION_BACKENDS, backend
        slots: list[int] = []
        for q_len, ctx_len, table in zip(query_lens, context_lens, block_tables, strict=True):
            assert 0 < q_len <= ctx_len <= len(table) * block_size
            if slot_mapping is None:
                slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx_len - q_len, ctx_len)]
        if slot_mapping is not None:
            assert len(slot_mapping) == sum(query_lens)
            slots = slot_mapping
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]

        def cu(xs: list[int]) -> torch.Tensor:
            return torch.tensor([0, *xs], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)

        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            cu_query_lens=cu(query_lens),
            cu_context_lens=cu(context_lens),
            block_size=block_size,
            host_block_tables=[list(t) for t in block_tables],
            backend=backend,
        )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    # k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] (-1: skip, on the kernel path)
    if (impl := _kernel_impl(k, backend)) is not None:
        _kernels.store_kv(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping, impl=impl)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's keys/values, rotary applied); returns [T, H, D]."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.backend)
    impl = _kernel_impl(q, meta.backend) if meta.max_query_len == 1 else None  # decode-only steps
    if impl is not None and (route := route_for(meta)) is not None:
        route_counts["cascade"] += 1
        return cascade_attention(q, k_cache, v_cache, route, scale, impl=impl)  # groups sharing an image prefix
    if impl is not None:  # split-KV paged decode kernel
        route_counts["paged_decode"] += 1
        context_lens = meta.cu_context_lens[1:] - meta.cu_context_lens[:-1]
        out, _ = _kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, context_lens, scale=scale,
                                                 max_context_len=meta.max_context_len, impl=impl)
        return out
    if _use_flash_paged(q, meta):
        route_counts["flash"] += 1
        return _flash_varlen_func(
            q, k_cache, v_cache, meta.cu_query_lens, meta.cu_context_lens, meta.max_query_len,
            meta.max_context_len, softmax_scale=scale, causal=True, block_table=meta.block_tables,
        )  # fmt: skip
    route_counts["torch"] += 1
    return torch_paged_attention(q, k_cache, v_cache, meta, scale)


def _use_flash_paged(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    # flash-attn's paged varlen path (causal is bottom-right aligned, as we need); one rule with the engine's defaults
    flash = _flash_varlen_func is not None
    return prefill_path(q.device.type, flash, meta.block_size, q.dtype) == "flash_paged"


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    # q: [Q, H, D]; k, v: [C, Hkv, D] -> [Q, H, D]; grouped-query heads share K/V
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    # a leading batch dim: torch's CPU SDPA takes a much slower path for 3-D inputs (about 3x here)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class Segments:
    """The segments of a packed vision batch (one per image, frame or window), read once per encoder call and shared
    by every layer: offsets on the device for flash-attn, on the host for the SDPA path, so no layer syncs."""

    cu: torch.Tensor  # [S + 1] int32 offsets, on the device
    bounds: tuple[int, ...]  # the same offsets on the host
    # equal-length segments attend in one batched SDPA: (length, row index [n * length] on the device, or the start
    # of the only segment of that length, sliced without a gather)
    groups: tuple[tuple[int, torch.Tensor | int], ...]
    max_len: int  # the longest segment (flash-attn's max_seqlen)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor) -> Segments:
        bounds = tuple(cu_seqlens.tolist())  # the one device read of the call
        starts: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end > start:
                starts.setdefault(end - start, []).append(start)
        groups: list[tuple[int, torch.Tensor | int]] = []
        for length, firsts in starts.items():
            if len(firsts) == 1:
                groups.append((length, firsts[0]))
            else:
                rows = torch.tensor(firsts)[:, None] + torch.arange(length)  # [n, length]
                groups.append((length, rows.flatten().to(cu_seqlens.device)))
        return cls(cu_seqlens, bounds, tuple(groups), max(starts, default=0))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, scale: float) -> torch.Tensor:
    """Bidirectional attention inside each segment. q, k, v: [N, H, D] -> [N, H, D]."""
    if q.is_cuda and _flash_varlen_func is not None and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_varlen_func(q, k, v, seg.cu, seg.cu, seg.max_len, seg.max_len, softmax_scale=scale)
    out = torch.empty_like(q)
    for length, rows in seg.groups:
        if isinstance(rows, int):  # one segment of this length
            out[rows:rows + length] = _sdpa(q[rows:rows + length], k[rows:rows + length], v[rows:rows + length],
                                            scale, None)
            continue
        n = rows.numel() // length
        qs, ks, vs = (t.index_select(0, rows).view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        if ks.shape[1] != qs.shape[1]:  # grouped-query heads share K/V
            ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], dim=1)
            vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [n, H, length, D]
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(n * length, *q.shape[1:]))
    return out
