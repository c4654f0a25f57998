"""Resolution per image: OpenAI's ``image_url.detail`` and vlmq's ``min_pixels`` / ``max_pixels``.

One rule, :func:`image_policy`, shared by the SDK (which prices each image with it) and the engine (which resizes
each image with it), so an image is priced with exactly the bounds the worker uses. An image part of a chat's
engine form (``vlmq.chat``) carries what was asked: ``{"type": "image", "detail": "low", "max_pixels": N, ...}``.

For the Qwen families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``ResolutionPolicy``), whose processor resizes every image
into ``[min_pixels, max_pixels]``:

- ``detail: "auto"`` and ``"high"``: the model's own bounds (its ``preprocessor_config.json``): full resolution up
  to its ``max_pixels``. Neither is stored: they are the default.
- ``detail: "low"``: at most ``LOW_DETAIL_TOKENS`` (256) vision tokens, i.e. ``max_pixels`` lowered to
  256 x factor² (448 x 448 pixels for Qwen2-VL and Qwen2.5-VL, 512 x 512 for Qwen3-VL), ``min_pixels`` the
  model's (capped at that).
- ``min_pixels`` / ``max_pixels``: the resized area's bounds for this image, each at least factor² and
  ``max_pixels`` at most the model's own (what workers budget a job of the top class for); with ``detail: "low"``
  the lower of the two maxima applies.

The tiling families lay an image out on tiles of a fixed size, so ``detail: "low"`` means their smallest layout:

- InternVL: one tile of the whole image resized (``max_patches`` 1: 256 tokens for 448-px tiles, no thumbnail), what
  transformers' processor gives with ``max_patches=1``.
- LLaVA-NeXT: the base tile and a canvas of one tile (``image_grid_pinpoints`` ``[[S, S]]``), what its processor
  gives with those pinpoints.

``min_pixels`` and ``max_pixels`` are refused for them (``unsupported_field``), never silently ignored.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vlmq.cost import ImagePolicy, ResolutionPolicy
from vlmq.errors import InvalidRequest

LOW_DETAIL_TOKENS = 256  # most vision tokens of a detail "low" image
BOUND_FIELDS = ("detail", "min_pixels", "max_pixels")  # what an engine-form image part may carry
MAX_PIXELS_VALUE = 1 << 31  # no bound beyond this is accepted (the model's own max is far below)


def image_policy(policy: ImagePolicy, part: Mapping[str, Any]) -> ImagePolicy:
    """The policy one image part is laid out with: ``policy`` itself, or narrowed by the part's bounds.

    Raises:
        InvalidRequest: ``unsupported_field`` for bounds on a tiling family, ``bad_pixels`` for bounds outside
            what the model takes.
    """
    detail, low, high = (part.get(name) for name in BOUND_FIELDS)
    if detail is None and low is None and high is None:
        return policy
    if not isinstance(policy, ResolutionPolicy):
        return _tiled_policy(policy, detail, low, high)
    area = policy.factor ** 2
    top = min(policy.max_pixels, LOW_DETAIL_TOKENS * area) if detail == "low" else policy.max_pixels
    if high is not None:
        if not area <= high <= policy.max_pixels:
            raise InvalidRequest(f"max_pixels must be between {area} and the model's {policy.max_pixels}, got "
                                 f"{high}", code="bad_pixels")
        top = min(top, high)
    bottom = min(policy.min_pixels, top)
    if low is not None:
        if not area <= low <= top:
            raise InvalidRequest(f"min_pixels must be between {area} and this image's max_pixels {top}, got {low}",
                                 code="bad_pixels")
        bottom = low
    return dataclasses.replace(policy, min_pixels=bottom, max_pixels=top)


def _tiled_policy(policy: Any, detail: str | None, low: object, high: object) -> Any:
    """A tiling family's layout for ``detail: "low"``: its smallest (one tile; base tile and one canvas tile)."""
    if low is not None or high is not None:
        raise InvalidRequest("min_pixels and max_pixels apply to the Qwen-family models; this model lays images out "
                             "on fixed tiles: send detail \"low\", \"auto\" or \"high\"", code="unsupported_field")
    if detail != "low":
        return policy
    if hasattr(policy, "grid_pinpoints"):  # LLaVA-NeXT
        return dataclasses.replace(policy, grid_pinpoints=((policy.tile_size, policy.tile_size),))
    return dataclasses.replace(policy, min_tiles=1, max_tiles=1)  # InternVL (vlmq.families' or the engine's)


def check_bounds(value: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The bounds an ``image_url`` object (or an engine-form image part) asks for, as the engine form keeps them:
    ``detail`` only when ``"low"``, ``min_pixels`` / ``max_pixels`` when given (the model's limits are checked
    by :func:`image_policy`).

    Raises:
        InvalidRequest: ``bad_messages`` for a detail other than auto, low or high, or a bound that is not a
            positive integer; ``bad_pixels`` for ``min_pixels`` above ``max_pixels``.
    """
    bounds: dict[str, Any] = {}
    if "detail" in value:
        if value["detail"] not in ("auto", "low", "high"):
            raise InvalidRequest(f"{where}.detail {str(value['detail'])[:20]!r} is not one of auto, low, high",
                                 code="bad_messages")
        if value["detail"] == "low":
            bounds["detail"] = "low"
    for name in ("min_pixels", "max_pixels"):
        if name in value:
            number = value[name]
            if type(number) is not int or not 0 < number < MAX_PIXELS_VALUE:
                raise InvalidRequest(f"{where}.{name} must be a positive integer, got {str(number)[:20]!r}",
                                     code="bad_messages")
            bounds[name] = number
    if bounds.get("min_pixels", 0) > bounds.get("max_pixels", MAX_PIXELS_VALUE):
        raise InvalidRequest(f"{where}.min_pixels {bounds['min_pixels']} is above its max_pixels "
                             f"{bounds['max_pixels']}", code="bad_pixels")
    return bounds
