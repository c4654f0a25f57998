"""A tensor-parallel group runs one engine: rank 0 schedules, preprocesses, encodes images and samples; before each
LM forward it broadcasts the step, and every other rank runs the same forward on its shard in lockstep.

The step packet is plain tensors (no pickle): a header of sizes, one int64 tensor with the token ids, positions,
image rows, attention layout (query and context lengths, block tables, KV slots) and the rows whose logits rank 0
computes, and the image rows' encoder outputs. A follower keeps nothing but its own KV cache: it embeds, runs the
LM and computes the same logit rows, for the collectives inside them (two all-reduces per layer, one in the
embedding, an all-gather in the LM head). The group agrees on the cache's shape when the leader starts.

    # rank 0                                          # every other rank
    engine = Engine.from_model_dir(d, tp=tp)          follow(load_model(d, tp=tp), tp)
    engine.generate(requests)
    engine.runner.stop_followers()
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlmq.workers.engine.config import ATTENTION_BACKENDS
from vlmq.workers.engine.model_runner import ModelRunner, embed, logit_rows
from vlmq.workers.layers.attention import AttentionMetadata

from .tensor import TPGroup

STOP, STEP = 0, 1
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Step:
    """One LM forward as a follower needs it."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [R, T] int64
    image_rows: torch.Tensor  # [K] int64
    feats: torch.Tensor | None  # [K, W]: the image rows' encoder outputs (None: no image rows)
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    logit_rows: list[int]


def send_step(step: Step, tp: TPGroup) -> None:
    k, w = (0, 0) if step.feats is None else step.feats.shape
    tables = [b for t in step.block_tables for b in t]
    dtype = 0 if step.feats is None else DTYPES.index(step.feats.dtype)
    header = [STEP, step.ids.numel(), step.positions.shape[0], k, w, len(step.query_lens), len(tables),
              len(step.logit_rows), dtype]
    ints = torch.cat([step.ids.cpu(), step.positions.cpu().flatten(), step.image_rows.cpu(),
                      torch.tensor(step.query_lens + step.context_lens + [len(t) for t in step.block_tables] + tables
                                   + step.slot_mapping + step.logit_rows, dtype=torch.long)])
    _broadcast(torch.tensor(header, dtype=torch.long), tp)
    _broadcast(ints, tp)
    if step.feats is not None:
        _broadcast(step.feats.contiguous().cpu(), tp)


def receive_step(tp: TPGroup) -> Step | None:
    """The leader's next step, or None when it stops the group."""
    header = _broadcast(torch.empty(9, dtype=torch.long), tp).tolist()
    if header[0] == STOP:
        return None
    t, r, k, w, s, n_tables, n_rows, dtype = header[1:]
    ints = _broadcast(torch.empty(t + r * t + k + 3 * s + n_tables + t + n_rows, dtype=torch.long), tp)
    ids, positions, rows, rest = ints.split([t, r * t, k, len(ints) - t - r * t - k])
    rest = rest.tolist()
    q, c, lens, rest = rest[:s], rest[s:2 * s], rest[2 * s:3 * s], rest[3 * s:]
    tables, at = [], 0
    for n in lens:
        tables.append(rest[at:at + n])
        at += n
    slots, logit = rest[at:at + t], rest[at + t:]
    feats = _broadcast(torch.empty(k, w, dtype=DTYPES[dtype]), tp) if k else None
    return Step(ids, positions.view(r, t), rows, feats, q, c, tables, slots, logit)


def _broadcast(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    # host tensors: a gloo group's (an NCCL group would need them on the device: not built yet)
    dist.broadcast(x, src=0, group=tp.group)
    return x


class LeaderRunner(ModelRunner):
    """Rank 0's ModelRunner: the engine's own, sending each LM forward's step to the followers first. CUDA graphs
    are off (a replay would skip the collectives' host side)."""

    def __init__(self, model, config, encoder_cache, device="cpu", dtype=None, seed: int = 0, *,
                 tp: TPGroup) -> None:
        super().__init__(model, config, encoder_cache, device, dtype, seed)
        self.tp, self.decode_graphs, self._rows = tp, None, []
        shape = [config.num_blocks, config.block_size, ATTENTION_BACKENDS.index(config.attention_backend),
                 DTYPES.index(self.kv_caches[0][0].dtype)]
        _broadcast(torch.tensor(shape, dtype=torch.long), tp)  # the followers allocate the same cache

    def forward(self, out):
        self._rows = logit_rows(out.scheduled)  # what execute computes logits for, sent with the step
        return super().forward(out)

    def _before_lm(self, out, ids, rows, feats, positions):
        send_step(Step(ids, positions, rows, feats, [s.num_new_tokens for s in out.scheduled],
                       [s.start + s.num_new_tokens for s in out.scheduled], [s.block_table for s in out.scheduled],
                       [x for s in out.scheduled for x in s.slot_mapping], self._rows), self.tp)

    def stop_followers(self) -> None:
        _broadcast(torch.tensor([STOP] + [0] * 8, dtype=torch.long), self.tp)


def follow(model, tp: TPGroup, device: str | torch.device = "cpu") -> int:
    """Run the leader's steps on this rank's shard until it stops the group; returns the number of steps run."""
    device = torch.device(device)
    num_blocks, block_size, backend, dtype = _broadcast(torch.empty(4, dtype=torch.long), tp).tolist()
    kv = model.make_kv_caches(num_blocks, block_size, dtype=DTYPES[dtype], device=device)
    steps = 0
    with torch.inference_mode():
        while (step := receive_step(tp)) is not None:
            meta = AttentionMetadata.build(step.query_lens, step.context_lens, step.block_tables, block_size, device,
                                           slot_mapping=step.slot_mapping, backend=ATTENTION_BACKENDS[backend])
            feats = None if step.feats is None else step.feats.to(device)
            x, kwargs = embed(model, step.ids.to(device), step.image_rows.to(device), feats)
            hidden = model.language_model(x, step.positions.to(device), meta, kv, **kwargs)
            if step.logit_rows:
                model.compute_logits(hidden[torch.tensor(step.logit_rows, device=device)])
            steps += 1
    return steps
