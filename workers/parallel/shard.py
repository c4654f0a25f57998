"""One rank's shard of a loaded model's language model: attention heads and MLP channels split, the vocabulary
split in the embedding and the LM head; the vision tower stays whole on every rank (data-parallel by default).

Every family the engine serves shares the LM's module names (Qwen2-VL's ``Qwen2Attention``, ``GatedMLP``,
``embed_tokens``, ``lm_head``), so one rule shards all five. Query heads split evenly; KV heads split with them
when they divide by the group size, else (fewer KV heads than ranks) each rank keeps the one KV head its query
heads read. After sharding, ``model.num_kv_heads`` is this rank's count, so ``make_kv_caches`` and the KV budget
size the paged cache per rank. Usage::

    shard_language_model(model, TPGroup.world())
"""
from __future__ import annotations

from torch import nn

from .tensor import RowParallelLinear, TPGroup, VocabParallelEmbedding, VocabParallelHead, column_slice


def kv_head_range(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's ``[start, end)`` of KV heads for its query heads ``tp.split(num_heads)``.

    Raises:
        ValueError: when the query heads do not split evenly, or the KV heads neither split nor replicate evenly.
    """
    if num_heads % tp.size:
        raise ValueError(f"{num_heads} attention heads do not split across {tp.size} ranks")
    if num_kv_heads % tp.size == 0:
        return tp.split(num_kv_heads)
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads neither split across nor replicate over {tp.size} ranks")
    kv = tp.rank * num_kv_heads // tp.size  # the KV head of this rank's first query head (and of all of them)
    return kv, kv + 1


def shard_attention(attn: nn.Module, tp: TPGroup) -> None:
    h0, h1 = tp.split(attn.num_heads)
    k0, k1 = kv_head_range(attn.num_heads, attn.num_kv_heads, tp)
    d = attn.head_dim
    attn.q_proj = column_slice(attn.q_proj, h0 * d, h1 * d)
    attn.k_proj = column_slice(attn.k_proj, k0 * d, k1 * d)
    attn.v_proj = column_slice(attn.v_proj, k0 * d, k1 * d)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp, h0 * d, h1 * d)
    attn.num_heads, attn.num_kv_heads = h1 - h0, k1 - k0


def shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    c0, c1 = tp.split(mlp.gate_proj.out_features)
    mlp.gate_proj = column_slice(mlp.gate_proj, c0, c1)
    mlp.up_proj = column_slice(mlp.up_proj, c0, c1)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, c0, c1)


def shard_language_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Turn ``model`` (any family's, loaded whole) into rank ``tp.rank``'s shard, in place; returns it.

    Every rank must then run the same forward calls with the same inputs (lockstep): each layer all-reduces
    twice, the embedding once, and the LM head all-gathers the logits, which every rank then holds whole.
    """
    lm = model.language_model
    for layer in lm.layers:
        shard_attention(layer.self_attn, tp)
        shard_mlp(layer.mlp, tp)
    lm.embed_tokens = VocabParallelEmbedding(lm.embed_tokens, tp)
    model.lm_head = VocabParallelHead(model.lm_head, tp)
    model.num_kv_heads = lm.layers[0].self_attn.num_kv_heads
    model.tp = tp
    return model
