"""Which models exist, their resolution policy and how each cost class is bounded.

The SDK needs a model's resolution policy to price an image from its header;
it never loads the model. ``tiny-shapes`` is bundled with the worker package;
other names map to local Hugging Face folders through ``VLMQ_MODELS``, priced by
their own family's rule (``config.json``'s ``model_type``, see :mod:`vlmq.families`).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from vlmq.cost import CostClasses, ImagePolicy, ResolutionPolicy
from vlmq.errors import InvalidRequest
from vlmq.families import read_model_folder
from vlmq.settings import Settings

BUNDLED_MODEL = "tiny-shapes"
# Must equal workers/assets/tiny-shapes/preprocessor_config.json (a test checks). Patches of 28 px (tokens of
# 56 px) keep the tiny model's sequences short: a 1024x1024 image is 18x18 tokens. The 224x224 minimum area
# gives every image up to 3:1 at least three tokens per side, so the task's 3x3 cells fall on the token grid.
TINY_SHAPES_POLICY = ResolutionPolicy(patch_size=28, min_pixels=224 * 224, max_pixels=1024 * 1024)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A servable model as the SDK sees it.

    Attributes:
        name: the public model name used in queue names.
        policy: resolution policy used to price images.
        path: local checkpoint folder, or None for the bundled model.
        family: the checkpoint's ``model_type`` (one of :data:`vlmq.families.FAMILIES`).
    """

    name: str
    policy: ImagePolicy
    path: str | None = None
    family: str = "qwen2_vl"


def resolve_model(name: str, settings: Settings) -> ModelSpec:
    """Look a model name up.

    Raises:
        InvalidRequest: code ``unknown_model`` if the name is unknown; ``unsupported_model`` if its folder's
            ``model_type`` is not a supported family; ``bad_model_config`` if its processor settings are invalid.
    """
    if name in settings.models:
        path = settings.models[name]
        family, policy = read_model_folder(path)
        return ModelSpec(name, policy, path, family)
    if name == BUNDLED_MODEL:
        return ModelSpec(name, TINY_SHAPES_POLICY, None)
    known = sorted({BUNDLED_MODEL, *settings.models})
    raise InvalidRequest(f"unknown model {name!r}; known models: {', '.join(known)} (add more with VLMQ_MODELS)",
                         code="unknown_model")


def model_folder(spec: ModelSpec) -> Path | None:
    """The model's local folder: its ``VLMQ_MODELS`` path, or the bundled model's in the installed worker package
    (found, not imported; None where that package is not installed)."""
    if spec.path is not None:
        return Path(spec.path)
    found = importlib.util.find_spec("vlmq.workers")
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0]) / "assets" / spec.name


def cost_classes(settings: Settings) -> CostClasses:
    """The configured cost classes."""
    return CostClasses.from_string(settings.cost_classes)


def class_cost(spec: ModelSpec, cost_class: str, settings: Settings) -> int:
    """Upper bound of one job of this class in tokens: vision bound plus the text allowance.

    The top class is bounded by the largest image the model's policy allows.
    """
    classes = cost_classes(settings)
    bound = classes.bound(cost_class)
    if bound is None:
        bound = spec.policy.max_vision_tokens()
    return bound + settings.text_token_bound
