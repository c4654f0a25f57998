"""The engine's CUDA path, run on CPU: decode through our Triton kernels (the Triton interpreter,
TRITON_INTERPRET=1, set by tests/conftest.py), the cascade kernel for questions sharing an image, and decode steps
through DecodeGraphs.run with an eager stand-in for CUDA graph capture. Greedy tokens equal the plain CPU path's.

What only a GPU can check (real graph capture, bf16 kernels, flash-attn) is in tests/gpu and scripts/gpu_check.sh.
"""
from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny.shapes import make_example, questions

from vlmq.workers.engine.cuda_graphs import DecodeGraphs, eager_capture
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.layers import attention

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
# block size 4: the questions about one image share every whole block of their common prefix (~150 tokens: the
# cascade route pays, cascade_route.CUDA_SHARED_PREFIX_COST)
CONFIG = dict(num_blocks=256, block_size=4)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # a private copy: a training test may rewrite the bundled one
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / TARGET.name))


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    """Four questions about one 672x672 image (144 image tokens) between three other images (the cascade route
    permutes the step's rows); exact lengths, so the decode batch shrinks 7 -> 1: cascade steps while three or more
    share the image, then plain decode."""
    shared = make_example((9, 0), size=(672, 672))
    asked = questions(shared.scene)[:4]
    same = [Request(shared.image, q, n, ignore_eos=True) for (q, _), n in zip(asked, (2, 3, 6, 7), strict=True)]
    others = [make_example((9, i), size=(224, 224)) for i in (1, 2, 3)]
    other = [Request(e.image, e.question, n, ignore_eos=True) for e, n in zip(others, (5, 9, 12), strict=True)]
    return [other[0], same[0], other[1], same[1], same[2], other[2], same[3]]


def generate(model_dir: Path, requests: list[Request], graphs: bool = False, **config) -> tuple[list, Engine]:
    engine = Engine.from_model_dir(model_dir, **CONFIG, **config)
    if graphs:
        runner = engine.runner
        runner.decode_graphs = DecodeGraphs.for_runner(runner.model, engine.config, runner.kv_caches, runner.device,
                                                       capture=eager_capture)
    try:
        outputs = engine.generate(requests, prepare_all_first=True)
    finally:
        engine.close()
    assert all(o.error is None for o in outputs)
    return [o.token_ids for o in outputs], engine


@pytest.fixture(scope="module")
def expected(model_dir, requests) -> list[list[int]]:
    torch.set_num_threads(1)  # as the other engine tests
    tokens, _ = generate(model_dir, requests)  # the plain CPU path: torch attention, no kernels
    assert [len(t) for t in tokens] == [r.max_new_tokens for r in requests]
    return tokens


def test_decode_through_the_kernels_and_the_cascade_kernel_equals_the_cpu_path(model_dir, requests, expected):
    before = attention.route_counts.copy()
    tokens, _ = generate(model_dir, requests, attention_backend="kernels")
    routes = attention.route_counts - before
    assert tokens == expected
    layers = 4  # every layer of a step takes the step's route
    assert routes["cascade"] >= 2 * layers  # the questions about one image decode together on the cascade kernel
    assert routes["paged_decode"] >= 2 * layers  # and plain decode steps take the paged decode kernel
    assert routes["torch"] > 0  # prefill chunks stay on the torch path on CPU


def test_decode_steps_through_decode_graphs_equal_the_cpu_path(model_dir, requests, expected):
    before = attention.route_counts.copy()
    tokens, engine = generate(model_dir, requests, graphs=True, attention_backend="kernels", cuda_graph_max_seqs=4)
    routes = attention.route_counts - before
    assert tokens == expected
    graphs = engine.runner.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4]  # buckets 1, 2, 4 captured once each (4 holds batches of 3 and 4)
    assert graphs.num_replays > len(graphs.graphs)  # and replayed in later steps
    # eager_capture runs the step once at capture and once per replay; the other plain decode steps ran eagerly
    # (more sequences than the largest bucket)
    eager_decodes = routes["paged_decode"] // 4 - len(graphs.graphs) - graphs.num_replays
    assert eager_decodes > 0 and routes["cascade"] > 0  # cascade steps never replay


def test_the_torch_backend_never_takes_the_kernels_and_has_no_graphs(model_dir, requests, expected):
    before = attention.route_counts.copy()
    tokens, engine = generate(model_dir, requests[:2], graphs=True, attention_backend="torch")
    assert tokens == expected[:2] and engine.runner.decode_graphs is None
    assert set(attention.route_counts - before) == {"torch"}


@pytest.mark.parametrize("family", ["qwen3_vl", "internvl", "llava_next"])
def test_other_families_through_the_kernels_and_decode_graphs(tmp_path, family):
    """DeepStack inputs (Qwen3-VL) and 1-D positions (InternVL, LLaVA-NeXT: a [1, B] position buffer) on the same
    path, on tiny random-weight models."""
    module = importlib.import_module(f"tiny.{family}")
    build = getattr(module, "build", None) or getattr(module, f"build_{family}")
    model_dir = build(tmp_path)
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8))
              for i, size in enumerate([(200, 180, 3), (60, 90, 3)])]
    requests = [Request(images[0], q, 5, ignore_eos=True) for q in ("what is it?", "what colour?", "where?")]
    requests.append(Request(images[1], "hi?", 8, ignore_eos=True))
    expected, _ = generate(model_dir, requests)
    tokens, engine = generate(model_dir, requests, graphs=True, attention_backend="kernels", cuda_graph_max_seqs=2)
    assert tokens == expected and engine.runner.decode_graphs.num_replays > 0
