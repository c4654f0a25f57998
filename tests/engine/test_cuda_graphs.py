"""CUDA-graph decode buckets, checked on CPU: bucket ladder, bucket choice, padding that neither reads nor
writes the KV cache (run through the kernels' store and decode with the padded inputs), and DecodeGraphs.run with
eager_capture (the CPU stand-in for capture and replay) on the tiny model through the kernel path."""
from pathlib import Path

import pytest
import torch

from vlmq import kernels as K
from vlmq.workers.engine.config import EngineConfig
from vlmq.workers.engine.cuda_graphs import (
    DecodeGraphs,
    eager_capture,
    graph_batch_sizes,
    pad_decode_batch,
    pick_bucket,
)
from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.models.loader import load_model

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
BS = 4


def test_buckets_are_powers_of_two_to_eight_then_every_eight_and_zero_turns_graphs_off():
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(12) == (1, 2, 4, 8, 12)
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(0) == ()
    with pytest.raises(ValueError, match=">= 0"):
        graph_batch_sizes(-1)


def test_a_batch_takes_the_smallest_bucket_that_holds_it_or_runs_eagerly():
    sizes = graph_batch_sizes(64)
    assert [pick_bucket(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert pick_bucket(65, sizes) is None
    assert pick_bucket(1, graph_batch_sizes(0)) is None


def test_padding_rows_neither_read_nor_write_the_cache():
    torch.manual_seed(0)
    tables, ctx = [[3, 1], [0], [2, 4, 5]], [6, 2, 11]
    meta = AttentionMetadata.build([1, 1, 1], ctx, tables, BS)
    k_cache, v_cache = torch.randn(2, 8, BS, 2, 16).unbind(0)
    x, positions = torch.randn(3, 32), torch.arange(9).view(3, 3)
    padded = pad_decode_batch(x, positions, meta, bucket=8, max_blocks=5)
    assert padded.x.shape == (8, 32) and torch.equal(padded.x[:3], x) and not padded.x[3:].any()
    assert padded.positions.shape == (3, 8) and not padded.positions[:, 3:].any()
    assert padded.block_tables.shape == (8, 5) and padded.block_tables[:3, :3].tolist() == [[3, 1, 0], [0, 0, 0],
                                                                                           [2, 4, 5]]
    lens = (padded.cu_context_lens[1:] - padded.cu_context_lens[:-1]).tolist()
    assert lens == ctx + [0] * 5
    assert padded.slot_mapping.tolist()[3:] == [-1] * 5

    k_new, v_new = torch.randn(2, 8, 2, 16).unbind(0)
    before = k_cache.clone()
    K.store_kv(k_new, v_new, k_cache, v_cache, padded.slot_mapping, impl="torch")
    written = (k_cache != before).any(-1).any(-1).nonzero().tolist()  # [block, offset] of every changed slot
    assert sorted(b * BS + o for b, o in written) == sorted(meta.slot_mapping.tolist())

    q = torch.randn(8, 4, 16)
    out, _ = K.paged_decode_attention(q, k_cache, v_cache, padded.block_tables, torch.tensor(lens), impl="torch")
    real, _ = K.paged_decode_attention(q[:3], k_cache, v_cache, meta.block_tables, torch.tensor(ctx), impl="torch")
    torch.testing.assert_close(out[:3], real)
    assert not out[3:].any()


def test_the_switch_is_a_config_field_and_graphs_stay_off_on_cpu():
    assert EngineConfig().cuda_graph_max_seqs == 64
    with pytest.raises(ValueError, match="cuda_graph_max_seqs"):
        EngineConfig(cuda_graph_max_seqs=-1)
    assert DecodeGraphs.for_runner(None, EngineConfig(), [], torch.device("cpu")) is None


@pytest.fixture(scope="module")
def model():
    return load_model(TARGET, torch.device("cpu"), torch.float32)


def decode_meta(tables: list[list[int]], ctx: list[int], query_lens: list[int] | None = None) -> AttentionMetadata:
    return AttentionMetadata.build(query_lens or [1] * len(ctx), ctx, tables, BS, backend="kernels")


def test_a_replay_equals_the_eager_step_and_its_output_outlives_the_next_replay(model):
    """DecodeGraphs.run with eager_capture (the CPU stand-in for a CUDA graph): padded replays give the eager
    forward's hidden states, and a step's output is its own (the static output is overwritten by the next replay,
    while ModelRunner.last_hidden and a proposer keep it)."""
    torch.manual_seed(0)
    kv_caches = model.make_kv_caches(32, BS)
    graphs = DecodeGraphs(model, kv_caches, BS, 64, (4,), backend="kernels", capture=eager_capture)
    steps = [([[1, 2], [3, 4, 5], [6]], [5, 9, 3]), ([[1, 2, 7], [3, 4, 5]], [9, 10])]
    outs = []
    for tables, ctx in steps:
        x, positions = torch.randn(len(ctx), 128), torch.tensor(ctx).expand(3, -1)
        eager_kv = [(k.clone(), v.clone()) for k, v in kv_caches]
        eager = model.language_model(x, positions, decode_meta(tables, ctx), eager_kv)
        outs.append(graphs.run(x, positions, decode_meta(tables, ctx)))
        torch.testing.assert_close(outs[-1], eager)
        for (k, v), (ek, ev) in zip(kv_caches, eager_kv, strict=True):  # the replay wrote the same cache slots
            # the same slots, the same values but for the last bits: the padded batch is another matmul shape,
            # whose CPU kernel may round differently
            assert torch.equal(k != 0, ek != 0) and torch.equal(v != 0, ev != 0)
            torch.testing.assert_close(k, ek)
            torch.testing.assert_close(v, ev)
        assert outs[-1].shape == (len(ctx), 128)
    assert list(graphs.graphs) == [4] and graphs.num_replays == 2  # one capture, replayed for both steps
    assert outs[0].data_ptr() != graphs.graphs[4].out.data_ptr()
    assert not torch.equal(outs[0][:2], graphs.graphs[4].out[:2])  # the first step's output survived the second


def test_steps_a_graph_cannot_replay_run_eagerly(model):
    kv_caches = model.make_kv_caches(64, BS)
    graphs = DecodeGraphs(model, kv_caches, BS, 16, (1, 2), backend="kernels", capture=eager_capture)
    x = torch.randn(3, 128)
    prefix = list(range(1, 41))  # 160 shared tokens: a cascade group
    eager = [
        (decode_meta([[1], [2], [3]], [2, 2, 2]), 3),  # more sequences than the largest bucket
        (decode_meta([[1], [2, 3]], [2, 5], [1, 2]), 3),  # a chunk of more than one token (prefill, proposals)
        (decode_meta([[1, 2, 3, 4, 5]], [18]), 1),  # a block table wider than the graph's (16 tokens)
        (decode_meta([prefix + [41], prefix + [42]], [163, 163]), 2),  # a cascade step
    ]
    for meta, num_tokens in eager:
        assert graphs.run(x[:num_tokens], torch.zeros(3, num_tokens, dtype=torch.long), meta) is None
    assert graphs.graphs == {} and graphs.num_replays == 0


def test_graphs_need_cuda_or_a_given_capture_and_never_take_the_torch_backend(model):
    on, off, torch_path = (EngineConfig(cuda_graph_max_seqs=n, attention_backend=b)
                           for n, b in ((8, "kernels"), (0, "kernels"), (8, "torch")))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    graphs = DecodeGraphs.for_runner(model, on, [], cpu, capture=eager_capture)
    assert graphs.sizes == (1, 2, 4, 8) and graphs.backend == "kernels" and graphs.capture is eager_capture
    assert DecodeGraphs.for_runner(model, on, [], cpu) is None  # no CUDA graphs on CPU
    assert DecodeGraphs.for_runner(model, off, [], cpu, capture=eager_capture) is None
    assert DecodeGraphs.for_runner(model, torch_path, [], cuda) is None  # its plan is host lists: no replay
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")
