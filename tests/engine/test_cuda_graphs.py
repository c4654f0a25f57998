"""CUDA-graph decode buckets, checked on CPU: bucket ladder, bucket choice, and padding that neither reads nor
writes the KV cache (run through the kernels' store and decode with the padded inputs)."""
import pytest
import torch

from vlmq import kernels as K
from vlmq.workers.engine.config import EngineConfig
from vlmq.workers.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, pad_decode_batch, pick_bucket
from vlmq.workers.layers.attention import AttentionMetadata

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
