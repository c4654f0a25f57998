"""load_processor takes transformers' PIL image processor on every machine, never the torchvision one.

Left to choose, transformers 5 takes the torchvision image processor wherever torchvision is installed (GPU
machines; CI has no torchvision), and it resizes differently from PIL: the engine (whose preprocessing is PIL's bit
for bit) and transformers' `generate` (through load_processor, as in tests/gpu/test_engine_cuda.py) would then see
different pixels, and the fp32 100%-equal parity check could fail for that reason alone.
"""
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from tiny import shapes
from tiny.internvl import build_internvl
from tiny.llava_next import build_llava_next

from vlmq.workers.engine.tiling import image_preprocessor_for
from vlmq.workers.models import processor as processor_module
from vlmq.workers.models.processor import load_processor

BUNDLED = Path(processor_module.__file__).resolve().parents[1] / "assets" / "tiny-shapes"
PIL_CLASSES = {"qwen2_vl": "Qwen2VLImageProcessorPil", "internvl": "GotOcr2ImageProcessorPil",
               "llava_next": "LlavaNextImageProcessorPil"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("processors")
    return {"qwen2_vl": BUNDLED, "internvl": build_internvl(tmp / "internvl"),
            "llava_next": build_llava_next(tmp / "llava_next")}


@pytest.mark.parametrize("family", sorted(PIL_CLASSES))
def test_every_family_gets_the_pil_image_processor_by_asking_for_it(model_dirs, family, monkeypatch):
    asked = []
    auto = processor_module.AutoImageProcessor

    class Spy:  # records the backend load_processor asks for (CI has no torchvision: the default would be PIL too)
        @staticmethod
        def from_pretrained(*args, **kwargs):
            asked.append(kwargs.get("backend"))
            return auto.from_pretrained(*args, **kwargs)

    monkeypatch.setattr(processor_module, "AutoImageProcessor", Spy)
    image_processor = load_processor(model_dirs[family]).image_processor
    assert asked == ["pil"]
    assert type(image_processor).__name__ == PIL_CLASSES[family] and image_processor.backend == "pil"


def test_the_reference_processor_sees_the_engines_pixels_bit_for_bit():
    image_processor = load_processor(BUNDLED).image_processor
    engine_side = image_preprocessor_for(image_processor.to_dict())
    images = [shapes.make_example((5, i), size=(97 + 61 * i, 211 - 23 * i), caption_prob=1.0).image for i in range(4)]
    ref = image_processor(images=images, return_tensors="pt")
    pixels, grid = engine_side(images)
    assert torch.equal(grid, ref["image_grid_thw"]) and torch.equal(pixels, ref["pixel_values"])


@pytest.mark.skipif(find_spec("torchvision") is None, reason="shows the torchvision default where it is installed")
def test_with_torchvision_installed_the_default_would_differ_but_load_processor_stays_pil():
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    default = AutoImageProcessor.from_pretrained(BUNDLED, local_files_only=True)
    assert default.backend == "torchvision"  # what load_processor avoids
    assert load_processor(BUNDLED).image_processor.backend == "pil"
