"""test_engine_cuda.py's harness (parity.py) on the CPU in float32, on a few prompts and every engine
configuration it compares: an API slip in the harness (transformers' loading or `generate` arguments, the engine's
settings) shows up here, not in the one GPU run."""
import pytest
import torch
from parity import CONFIGS, TARGET, engine_greedy, make_workload, match_rate, sized, transformers_greedy


@pytest.fixture(scope="module")
def workload():
    return make_workload(num_prompts=4, num_shared=1)  # 4 images, the first asked 3 more questions


@pytest.fixture(scope="module")
def reference(workload):
    return transformers_greedy(TARGET, workload, torch.float32, device="cpu")


def test_the_workload_asks_more_questions_about_the_first_images(workload):
    assert len(workload) == 7 and all(image is workload[0][0] for image, _ in workload[4:])
    assert len({question for _, question in workload[:1] + workload[4:]}) == 4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_equals_transformers_in_float32_on_the_cpu(workload, reference, name):
    config = sized(name)
    assert config["num_blocks"] * config["block_size"] == 65536
    assert all(reference) and match_rate(engine_greedy(TARGET, workload, torch.float32, "cpu", **config),
                                         reference) == 1.0
