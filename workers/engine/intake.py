"""Request intake: what callers hand the engine and get back, and the preprocessing that turns a request into a
scheduler `Sequence` plus its image patches (on the engine's preprocessing threads, off the step loop).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vlmq.images import pixel_hash
from vlmq.workers.models.processor import render_prompt

from .encoder_cache import make_key
from .preprocess import ImagePreprocessor
from .sequence import ImagePlaceholder, SamplingParams, Sequence


@dataclass(slots=True)
class Request:
    image: Any  # PIL.Image.Image in mode RGB
    question: str
    max_new_tokens: int = 64
    ignore_eos: bool = False  # generate exactly max_new_tokens
    priority: int = 0  # 0 runs first
    temperature: float = 0.0  # 0 = greedy


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]  # completion; without the eos token when finish_reason == "stop"
    text: str
    finish_reason: str  # "stop", "length", "canceled" or "error"
    prompt_tokens: int = 0
    image_tokens: int = 0
    error: Exception | None = None
    arrival_time: float = 0.0  # time.perf_counter() at add_request
    first_token_time: float | None = None
    finish_time: float = 0.0


@dataclass(slots=True)
class Prepared:
    seq: Sequence
    pixel_values: torch.Tensor  # [P, C*Tp*p*p]
    grid_thw: torch.Tensor  # [N, 3]


class Preprocessor:
    """Request -> Sequence + pixels, on the preprocessing threads. Raises on a bad request (it fails alone)."""

    def __init__(self, processor, image_preprocessor: ImagePreprocessor, model_id: str, image_token_id: int,
                 eos_token_ids: tuple[int, ...], share_encoder_outputs: bool = True) -> None:
        self.processor, self.image_preprocessor = processor, image_preprocessor
        self.image_token_id, self.eos_token_ids = image_token_id, eos_token_ids
        self.model_id, self.share = model_id, share_encoder_outputs
        self.settings = {"policy": asdict(image_preprocessor.policy), "image_mean": image_preprocessor.image_mean,
                         "image_std": image_preprocessor.image_std, "rescale": image_preprocessor.rescale_factor}
        self._prompt_ids: dict[str, list[int]] = {}  # question -> ids with ONE image pad
        self._lock = threading.Lock()

    def prompt_ids(self, question: str) -> list[int]:
        ids = self._prompt_ids.get(question)
        if ids is None:
            text = render_prompt(self.processor, question)
            with self._lock:  # a fast tokenizer must not be entered from two threads at once
                ids = list(self.processor.tokenizer(text)["input_ids"])
                if len(self._prompt_ids) >= 4096:  # bounded: prompts are free-form text
                    self._prompt_ids.clear()
                self._prompt_ids[question] = ids
        return ids

    def __call__(self, request_id: str, req: Request) -> Prepared:
        if req.image is None:
            raise ValueError("a request needs an image (PIL RGB); text-only prompts are not supported")
        sampling = SamplingParams(req.max_new_tokens, () if req.ignore_eos else self.eos_token_ids, req.temperature)
        ids = self.prompt_ids(req.question)
        pixel_values, grid_thw = self.image_preprocessor([req.image])  # [P, D], [1, 3]
        num_patches = int(grid_thw.prod())
        num_tokens = num_patches // self.image_preprocessor.policy.merge_size ** 2
        at = ids.index(self.image_token_id)
        ids = ids[:at] + [self.image_token_id] * num_tokens + ids[at + 1:]
        # Without sharing, every request gets its own key: no encoder-cache or image-prefix reuse across requests.
        settings = self.settings if self.share else {**self.settings, "request": request_id}
        key = make_key(pixel_hash(req.image), self.model_id, settings)
        image = ImagePlaceholder(key, at, num_tokens, num_patches)
        return Prepared(Sequence(request_id, ids, images=(image,), sampling=sampling, priority=req.priority),
                         pixel_values, grid_thw)
