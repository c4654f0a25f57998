"""The CUDA decode routing to the cascade kernel, decided and checked on CPU: the same groups as the CPU path's
cascade, rows permuted into groups and back, and the kernel's result equal to plain paged attention."""
import pytest
import torch

from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.layers.cascade_route import (
    CascadeLayout,
    build_route,
    cascade_attention,
    route_decode,
    route_for,
)
from vlmq.workers.layers.paged_torch import _SHARED_PREFIX_COST, _plan, torch_paged_attention

BS = 16


def decode_step(shared: dict[int, list[int]], own: list[int]):
    """Block tables: sequence i starts with the shared blocks of its group (shared[i], may be []) and then own[i]
    blocks of its own; every sequence decodes one token after its cached tokens."""
    next_block = 1 + max((b for blocks in shared.values() for b in blocks), default=0)
    tables, ctx = [], []
    for i, n_own in enumerate(own):
        table = list(shared.get(i, [])) + list(range(next_block, next_block + n_own))
        next_block += n_own
        tables.append(table)
        ctx.append(len(table) * BS - 3)  # the last block partly filled
    return tables, ctx


def test_sequences_sharing_an_image_prefix_become_one_adjacent_group():
    prefix = list(range(40))  # 640 shared tokens
    tables, ctx = decode_step({0: prefix, 2: prefix, 3: prefix}, [2, 5, 1, 3])
    layout = route_decode(ctx, tables, BS, cost=256)
    assert layout == CascadeLayout(order=[0, 2, 3, 1], group_sizes=[3, 1], prefix_lens=[640, 0])


def test_no_group_when_nothing_is_shared_or_the_saving_is_below_the_cost():
    tables, ctx = decode_step({}, [4, 4, 4])
    assert route_decode(ctx, tables, BS) is None
    short = [0, 1]  # two sequences sharing 32 tokens save 32 gathered tokens, under the cost
    tables, ctx = decode_step({0: short, 1: short}, [3, 3])
    assert route_decode(ctx, tables, BS, cost=256) is None


def test_groups_are_the_ones_the_cpu_cascade_forms():
    a, b = list(range(30)), list(range(30, 60))
    tables, ctx = decode_step({0: a, 1: b, 2: a, 3: b, 4: a, 5: a[:10]}, [2, 1, 3, 1, 2, 4])
    meta = AttentionMetadata.build([1] * len(ctx), ctx, tables, BS)
    cost = _SHARED_PREFIX_COST["cpu"]
    cpu_plan = _plan(meta, torch.zeros(len(ctx), 4, 8), torch.zeros(1, BS, 2, 8))
    layout = route_decode(ctx, tables, BS, cost=cost)
    grouped = [n for n in layout.group_sizes if n > 1]
    assert [p.num_rows for p in cpu_plan.prefixes] == grouped
    assert [len(p.block_ids) * BS for p in cpu_plan.prefixes] == layout.prefix_lens[:len(grouped)]
    assert sorted(layout.order) == list(range(len(ctx)))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cascade_route_equals_plain_paged_attention(impl):
    torch.manual_seed(0)
    prefix = list(range(20))
    tables, ctx = decode_step({1: prefix, 3: prefix, 4: prefix}, [1, 2, 1, 3, 2])
    num_blocks = 1 + max(b for t in tables for b in t)
    k_cache, v_cache = torch.randn(2, num_blocks, BS, 2, 32).unbind(0)
    q = torch.randn(len(ctx), 4, 32)
    meta = AttentionMetadata.build([1] * len(ctx), ctx, tables, BS)
    route = build_route(meta, route_decode(ctx, tables, BS, cost=64))
    assert route.group_indptr.tolist() == [0, 3, 4, 5] and route.prefix_lens.tolist() == [320, 0, 0]
    out = cascade_attention(q, k_cache, v_cache, route, scale=32 ** -0.5, impl=impl)
    expected = torch_paged_attention(q, k_cache, v_cache, AttentionMetadata.build([1] * len(ctx), ctx, tables, BS),
                                     scale=32 ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_route_is_built_once_per_step():
    prefix = list(range(40))
    tables, ctx = decode_step({0: prefix, 1: prefix}, [1, 1])
    meta = AttentionMetadata.build([1, 1], ctx, tables, BS)
    route = route_for(meta)
    assert route is not None and route_for(meta) is route
    plain = AttentionMetadata.build([1, 1], *decode_step({}, [3, 3])[::-1], BS)
    assert route_for(plain) is None and plain.cascade is False


def test_routing_reads_the_host_block_tables_not_the_device():
    """AttentionMetadata.build keeps the host lists: routing a step (DecodeGraphs.run does it before every replay)
    needs no device-to-host copy. Block tables on the meta device hold no data to read back."""
    prefix = list(range(40))
    tables, ctx = decode_step({0: prefix, 2: prefix}, [1, 2, 1])
    meta = AttentionMetadata.build([1] * 3, ctx, tables, BS)
    assert meta.host_block_tables == tables
    expected = route_for(AttentionMetadata.build([1] * 3, ctx, tables, BS))
    meta.block_tables = meta.block_tables.to("meta")
    route = route_for(meta)
    assert route.block_tables.is_meta and route.order.shape == (3,)  # built on the device, from host lists
    assert route.plan == expected.plan and expected.order.tolist() == [0, 2, 1]
