"""Vision cost model: what an image costs the model, from its header alone.

Each model family has its own resolution policy (an :class:`ImagePolicy`); this module holds the
Qwen2-VL / Qwen2.5-VL / Qwen3-VL one and the family-free parts (classes, estimates, the report).
The tiling families (InternVL, LLaVA-NeXT) and reading a model folder live in :mod:`vlmq.families`.

For the Qwen families an image of ``width x height`` pixels is resized so that both sides are multiples of
``factor = patch_size * merge_size`` and its area lies within ``[min_pixels,
max_pixels]`` (:func:`smart_resize`, bit-for-bit the rule of transformers' Qwen2-VL
image processor). The vision encoder then sees ``grid_h x grid_w`` patches of
``patch_size`` pixels (one temporal step for a still image), and every
``merge_size x merge_size`` block of patches becomes one LM token::

    grid_h = resized_height // patch_size          grid_w = resized_width // patch_size
    encoder_patches = grid_t * grid_h * grid_w     vision_tokens = encoder_patches // merge_size**2

Jobs are routed by cost class (``xs`` ... ``xl``), named by the vision-token count.
Nothing here imports torch or numpy.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vlmq.errors import InvalidRequest

if TYPE_CHECKING:
    from vlmq.images import ImageInfo, ImageLimits

__all__ = [
    "MAX_ASPECT_RATIO", "CostClasses", "CostEstimate", "ImagePolicy", "ImageShape", "JobCost", "ResolutionPolicy",
    "check_side", "cost_report", "estimate", "estimate_image", "estimate_job", "smart_resize",
]

# transformers rejects images whose long side is more than 200 times the short side.
MAX_ASPECT_RATIO = 200

_CLASS_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def positive_int(name: str, value: object) -> int:
    """Returns ``value``; raises ValueError (a bad setting, not a bad request) unless it is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ImageShape:
    """How a family's processor lays one still image out for the vision encoder and the LM.

    Attributes:
        resized_height: height of the pixels the encoder sees (Qwen: the resized image; tiling
            families: the high-resolution canvas the tiles are cut from).
        resized_width: width of that image or canvas.
        grid_h: Qwen: patch rows; tiling families: tile rows of the canvas.
        grid_w: Qwen: patch columns; tiling families: tile columns of the canvas.
        num_tiles: encoder inputs of fixed size (1 for Qwen; the grid plus thumbnail or base image when tiling).
        encoder_patches: patches the vision encoder processes, over all tiles.
        vision_tokens: the image's placeholder tokens, each replaced by one encoder feature (Qwen's
            ``<|image_pad|>``, InternVL's ``<IMG_CONTEXT>`` without the ``<img>``/``</img>`` around them,
            LLaVA-NeXT's ``<image>`` including its newline features).
    """

    resized_height: int
    resized_width: int
    grid_h: int
    grid_w: int
    num_tiles: int
    encoder_patches: int
    vision_tokens: int


class ImagePolicy(Protocol):
    """A family's resolution policy: what the cost model asks of it."""

    def measure(self, height: int, width: int) -> ImageShape:
        """Lays out a ``height x width`` image (as displayed); raises InvalidRequest for sizes it cannot take."""
        ...

    def max_vision_tokens(self) -> int:
        """The most vision tokens one image can cost under this policy."""
        ...


@dataclass(frozen=True, slots=True)
class ResolutionPolicy:
    """The resize-and-patchify rule of the Qwen2-VL image processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

    Attributes:
        patch_size: side of one vision-encoder patch in pixels.
        merge_size: patches merged per side into one LM token (2 -> 4 patches per token).
        temporal_patch_size: frames per temporal patch (a still image is repeated; grid_t stays 1).
        min_pixels: smallest resized area (transformers' ``size["shortest_edge"]``).
        max_pixels: largest resized area (transformers' ``size["longest_edge"]``).
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            positive_int(name, getattr(self, name))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size

    def measure(self, height: int, width: int) -> ImageShape:
        """Lays out a ``height x width`` image: resized by :func:`smart_resize`, one tile, merged patches."""
        resized_height, resized_width = smart_resize(height, width, self)
        grid_h, grid_w = resized_height // self.patch_size, resized_width // self.patch_size
        patches = grid_h * grid_w
        return ImageShape(resized_height, resized_width, grid_h, grid_w, num_tiles=1, encoder_patches=patches,
                          vision_tokens=patches // (self.merge_size * self.merge_size))

    def max_vision_tokens(self) -> int:
        """``max_pixels`` in tokens of ``factor x factor`` pixels."""
        return self.max_pixels // (self.factor * self.factor)

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> ResolutionPolicy:
        """Builds the policy from a ``preprocessor_config.json`` dict.

        Understands ``size={"shortest_edge", "longest_edge"}`` (transformers 5), the
        older ``size={"min_pixels", "max_pixels"}``, and top-level ``min_pixels`` /
        ``max_pixels`` keys, which win over ``size`` as they do in transformers.
        Missing keys take the class defaults; unrelated keys are ignored.

        Args:
            config: the parsed JSON object.

        Returns:
            The policy.

        Raises:
            ValueError: a value is missing, not a positive int, or inconsistent.
        """
        kwargs: dict[str, Any] = {}
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            if config.get(key) is not None:
                kwargs[key] = config[key]
        size = config.get("size")
        if size is not None:
            if not isinstance(size, Mapping):
                raise ValueError(f"size must be a dict with shortest_edge/longest_edge, got {size!r}")
            kwargs["min_pixels"] = size.get("shortest_edge", size.get("min_pixels"))
            kwargs["max_pixels"] = size.get("longest_edge", size.get("max_pixels"))
        for key in ("min_pixels", "max_pixels"):
            if config.get(key) is not None:
                kwargs[key] = config[key]
        missing = [k for k in ("min_pixels", "max_pixels") if k in kwargs and kwargs[k] is None]
        if missing:
            raise ValueError(f"size has no {' or '.join(missing)} (expected shortest_edge and longest_edge)")
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class CostClasses:
    """Named vision-token classes used to partition queues.

    A job belongs to the first class whose (inclusive) upper bound holds its vision
    tokens, or to ``top`` when it exceeds them all.

    Attributes:
        bounds: ``(name, max_vision_tokens)`` pairs with strictly increasing bounds.
        top: name of the unbounded class above the last bound.
    """

    bounds: tuple[tuple[str, int], ...] = (("xs", 256), ("s", 1024), ("m", 4096), ("l", 16384))
    top: str = "xl"

    def __post_init__(self) -> None:
        if not isinstance(self.bounds, tuple):
            raise ValueError("bounds must be a tuple of (name, max_vision_tokens) pairs")
        previous = 0
        for item in self.bounds:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"each bound must be a (name, max_vision_tokens) pair, got {item!r}")
            positive_int(f"bound of class {item[0]!r}", item[1])
            if item[1] <= previous:
                raise ValueError(f"class bounds must increase strictly, got {item[1]} after {previous}")
            previous = item[1]
        names = self.names
        for name in names:
            if not isinstance(name, str) or not _CLASS_NAME.match(name):
                raise ValueError(f"class name {name!r} must match {_CLASS_NAME.pattern}")
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")

    @property
    def names(self) -> tuple[str, ...]:
        """All class names, cheapest first, ``top`` last."""
        return (*(name for name, _ in self.bounds), self.top)

    def classify(self, vision_tokens: int) -> str:
        """Returns the name of the class that holds ``vision_tokens``.

        Args:
            vision_tokens: LM tokens the image costs (non-negative).

        Returns:
            The class name.

        Raises:
            ValueError: ``vision_tokens`` is negative.
        """
        if vision_tokens < 0:
            raise ValueError(f"vision_tokens must be >= 0, got {vision_tokens}")
        for name, bound in self.bounds:
            if vision_tokens <= bound:
                return name
        return self.top

    def bound(self, name: str) -> int | None:
        """Returns the inclusive vision-token upper bound of class ``name``.

        Args:
            name: a class name.

        Returns:
            The bound, or None for the unbounded top class.

        Raises:
            KeyError: no class has this name.
        """
        for class_name, limit in self.bounds:
            if class_name == name:
                return limit
        if name == self.top:
            return None
        raise KeyError(f"unknown cost class {name!r}; known: {', '.join(self.names)}")

    @classmethod
    def from_string(cls, spec: str) -> CostClasses:
        """Parses ``"xs=256,s=1024,m=4096,l=16384,xl"`` (bounded classes, then the top class).

        Args:
            spec: comma-separated ``name=max_tokens`` items followed by one bare top name.

        Returns:
            The classes.

        Raises:
            ValueError: the string is malformed or the classes are invalid.
        """
        items = [item.strip() for item in spec.split(",")]
        if not items or any(not item for item in items):
            raise ValueError(f"empty item in cost classes {spec!r}")
        *bounded, top = items
        if "=" in top:
            raise ValueError(f"cost classes {spec!r} must end with the name of the unbounded top class, e.g. ',xl'")
        bounds: list[tuple[str, int]] = []
        for item in bounded:
            name, sep, value = item.partition("=")
            if not sep or not re.fullmatch(r"[0-9]+", value.strip()):
                raise ValueError(f"cost class item {item!r} must look like name=max_vision_tokens")
            bounds.append((name.strip(), int(value)))
        return cls(bounds=tuple(bounds), top=top)

    def to_string(self) -> str:
        """Returns the :meth:`from_string` form of these classes."""
        return ",".join([*(f"{name}={bound}" for name, bound in self.bounds), self.top])


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """What one image costs the model (one temporal step).

    Attributes:
        width: displayed width in pixels (after EXIF orientation).
        height: displayed height in pixels (after EXIF orientation).
        resized_height: height fed to the vision encoder.
        resized_width: width fed to the vision encoder.
        grid_t: temporal patches (1 for a still image).
        grid_h: patch rows (``resized_height // patch_size``).
        grid_w: patch columns (``resized_width // patch_size``).
        encoder_patches: patches the vision encoder processes (``grid_t * grid_h * grid_w``).
        vision_tokens: LM tokens after merging (``encoder_patches // merge_size**2``).
        cost_class: the queue class of ``vision_tokens``.
        num_tiles: fixed-size encoder inputs (1 unless the family tiles).

    For the tiling families (:mod:`vlmq.families`) ``resized_*`` is the tile canvas, ``grid_h x grid_w``
    its tile rows and columns, and ``vision_tokens`` the image's placeholder tokens.
    """

    width: int
    height: int
    resized_height: int
    resized_width: int
    grid_t: int
    grid_h: int
    grid_w: int
    encoder_patches: int
    vision_tokens: int
    cost_class: str
    num_tiles: int = 1

    def to_dict(self) -> dict[str, int | str]:
        """Returns the fields as a JSON-ready dict."""
        return asdict(self)


def check_side(name: str, value: object) -> None:
    """Raises InvalidRequest (code ``invalid_size``) unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"image {name} must be a positive int, got {value!r}", code="invalid_size")


def smart_resize(height: int, width: int, policy: ResolutionPolicy = ResolutionPolicy()) -> tuple[int, int]:
    """Returns ``(resized_height, resized_width)`` exactly as transformers' Qwen2-VL processor resizes.

    Each side is rounded (half to even) to a multiple of ``factor``; if the area is
    then over ``max_pixels`` both sides are scaled down by the same ratio and floored
    to multiples of ``factor`` (never below ``factor``); if under ``min_pixels`` they
    are scaled up and ceiled. The arithmetic is the same float arithmetic as
    transformers', so results match bit for bit.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        policy: the resolution policy.

    Returns:
        The resized height and width.

    Raises:
        InvalidRequest: a side is not a positive int (code ``invalid_size``) or the
            long side is more than 200 times the short side (code ``aspect_ratio``).
    """
    check_side("height", height)
    check_side("width", width)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidRequest(
            f"image is {width}x{height}: aspect ratio {ratio:.1f} is over {MAX_ASPECT_RATIO}, which the model "
            "cannot take; crop or pad the image first",
            code="aspect_ratio",
        )
    factor = policy.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > policy.max_pixels:
        beta = math.sqrt((height * width) / policy.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < policy.min_pixels:
        beta = math.sqrt(policy.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def estimate(
    width: int,
    height: int,
    policy: ImagePolicy = ResolutionPolicy(),
    classes: CostClasses = CostClasses(),
) -> CostEstimate:
    """Estimates what a ``width x height`` image (as displayed) costs the model.

    Args:
        width: displayed width in pixels.
        height: displayed height in pixels.
        policy: the model's resolution policy (see :func:`vlmq.families.read_model_folder`).
        classes: the cost classes to classify into.

    Returns:
        The estimate.

    Raises:
        InvalidRequest: a side is not a positive int (code ``invalid_size``) or the policy cannot take
            the image's aspect ratio (code ``aspect_ratio``).
    """
    shape = policy.measure(height, width)
    return CostEstimate(
        width=width, height=height, resized_height=shape.resized_height, resized_width=shape.resized_width,
        grid_t=1, grid_h=shape.grid_h, grid_w=shape.grid_w, encoder_patches=shape.encoder_patches,
        vision_tokens=shape.vision_tokens, cost_class=classes.classify(shape.vision_tokens),
        num_tiles=shape.num_tiles,
    )


def estimate_image(
    info: ImageInfo,
    policy: ImagePolicy = ResolutionPolicy(),
    classes: CostClasses = CostClasses(),
) -> CostEstimate:
    """Estimates the cost of a probed image (see :func:`vlmq.images.probe`).

    Args:
        info: the probed image; its width and height are already as displayed.
        policy: the model's resolution policy.
        classes: the cost classes to classify into.

    Returns:
        The estimate.

    Raises:
        InvalidRequest: see :func:`estimate`.
    """
    return estimate(info.width, info.height, policy, classes)


@dataclass(frozen=True, slots=True)
class JobCost:
    """What a job's images cost the model together (none: a text-only job costs 0), classed by the total.

    Attributes:
        vision_tokens: the sum of the images' vision tokens.
        encoder_patches: the sum of their encoder patches.
        cost_class: the queue class of ``vision_tokens``.
        images: each image's estimate, in the job's order.
    """

    vision_tokens: int
    encoder_patches: int
    cost_class: str
    images: tuple[CostEstimate, ...] = ()


def estimate_job(sizes: Sequence[tuple[int, int]], policy: ImagePolicy = ResolutionPolicy(),
                 classes: CostClasses = CostClasses(), policies: Sequence[ImagePolicy] | None = None) -> JobCost:
    """Prices a job's images, each ``(width, height)`` as displayed, by :func:`estimate`: each with its own of
    ``policies`` where given (its ``detail`` / pixel bounds: ``vlmq.resolution``), else with ``policy``.

    Raises:
        InvalidRequest: see :func:`estimate`; ``too_many_vision_tokens`` when the images together fall in the top
            class and cost more than its bound, the largest image the policy takes (what workers budget a job of
            the top class for, ``vlmq.models.class_cost``).
    """
    each = policies if policies is not None else [policy] * len(sizes)
    images = tuple(estimate(w, h, p, classes) for (w, h), p in zip(sizes, each, strict=True))
    tokens, limit = sum(e.vision_tokens for e in images), policy.max_vision_tokens()
    cost_class = classes.classify(tokens)
    if cost_class == classes.top and tokens > limit:
        raise InvalidRequest(f"the job's {len(images)} images cost {tokens} vision tokens together: above every "
                             f"class bound and above {limit}, the model's largest image, which bounds class "
                             f"{classes.top}; send smaller images or split the job", code="too_many_vision_tokens")
    return JobCost(tokens, sum(e.encoder_patches for e in images), cost_class, images)


_REPORT_HEADER = ("file", "format", "size", "resized", "tiles", "vision_tokens", "patches", "class")
REPORT_COLUMNS = _REPORT_HEADER


def report_rows(paths: Sequence[str], policy: ImagePolicy = ResolutionPolicy(),
                classes: CostClasses = CostClasses(), limits: ImageLimits | None = None) -> list[tuple[str, ...]]:
    """The rows of :func:`cost_report` (``REPORT_COLUMNS``); a refused file's class reads ``error: <code>``."""
    from vlmq.images import ImageLimits

    limits = limits if limits is not None else ImageLimits()
    return [_report_row(path, policy, classes, limits) for path in paths]


def _report_row(path: str, policy: ImagePolicy, classes: CostClasses, limits: ImageLimits) -> tuple[str, ...]:
    from vlmq.images import load_source, probe

    name = os.path.basename(path) or path
    try:
        info = probe(load_source(path, limits), limits)
    except InvalidRequest as e:
        return (name, "-", "-", "-", "-", "-", "-", f"error: {e.code}")
    size = f"{info.width}x{info.height}"
    try:
        cost = estimate_image(info, policy, classes)
    except InvalidRequest as e:
        return (name, info.format, size, "-", "-", "-", "-", f"error: {e.code}")
    resized = f"{cost.resized_width}x{cost.resized_height}"
    return (name, info.format, size, resized, str(cost.num_tiles), str(cost.vision_tokens), str(cost.encoder_patches),
            cost.cost_class)


def cost_report(
    paths: Sequence[str],
    policy: ImagePolicy = ResolutionPolicy(),
    classes: CostClasses = CostClasses(),
    limits: ImageLimits | None = None,
) -> str:
    """Returns a text table of what each image file costs (the ``vlmq cost IMAGE...`` command).

    Only image headers are read. A file that cannot be served gets a row whose class
    column reads ``error: <code>`` (the :class:`InvalidRequest` code) instead of
    stopping the report.

    Args:
        paths: image file paths.
        policy: the model's resolution policy.
        classes: the cost classes.
        limits: intake limits; the defaults when None.

    Returns:
        The table, one header line and one line per path, newline-terminated.
    """
    rows = [_REPORT_HEADER, *report_rows(paths, policy, classes, limits)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_REPORT_HEADER))]
    numeric = {4, 5, 6}
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"
