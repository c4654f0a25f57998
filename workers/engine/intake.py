"""Request intake: what callers hand the engine and get back, and the preprocessing that turns a request into a
scheduler `Sequence` plus its image patches and positions (on the engine's preprocessing threads, off the step loop).

Everything that can be wrong with one request is found here, so it fails alone (`RequestRejected`), never a step:
the user's text is tokenized as plain text (a `<|image_pad|>` or `<|im_start|>` typed by a user is text, not a
control token), the prompt must fit the request's text-token bound and the model's positions, and the model
computes the prompt's positions (which checks the image tokens against the image grid).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vlmq.chat import image_parts
from vlmq.errors import InvalidRequest
from vlmq.images import pixel_hash
from vlmq.resolution import image_policy
from vlmq.workers.models.processor import ChatPrompt, single_turn

from .encoder_cache import make_key
from .errors import RequestRejected
from .grammar import GrammarError, Grammars, GrammarState
from .preprocess import ImagePreprocessor
from .sequence import FinishReason, ImagePlaceholder, SamplingParams, Sequence, TokenLogprob
from .stopping import StopMatcher, check_stop


@dataclass(slots=True)
class Request:
    """One image and a question (one user turn), or with `messages` a whole chat and its `images`."""

    image: Any  # PIL.Image.Image in mode RGB (None with messages)
    question: str
    max_new_tokens: int = 64
    ignore_eos: bool = False  # generate exactly max_new_tokens
    priority: int = 0  # 0 runs first
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None  # sampling: the request's own random stream, reproducible whatever it is batched with
    max_text_tokens: int | None = None  # bound on text prompt tokens (all but image tokens) + max_new_tokens
    # cross-request cache isolation: requests share encoder outputs, prefix KV and archived KV only with requests
    # of the same salt (the worker gives a tenant's jobs the tenant's; None: shared with every unsalted request)
    cache_salt: str | None = None
    # a chat in OpenAI's turns (system, developer, user, assistant; content a string or text and image parts, an
    # image part {"type": "image"}), rendered by the model's chat template; instead of image and question
    messages: list[dict] | None = None
    images: tuple[Any, ...] = ()  # with messages: PIL RGB images in the order of the image parts (none: text only)
    stop: tuple[str, ...] = ()  # stop strings (at most 4): the answer ends before the first one completed
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the answer as eos does (left out of it)
    # the logits pipeline (logits.py): defaults off
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    logprobs: int | None = None  # each token's logprob and this many alternatives (None: none)
    response_format: dict | None = None  # structured output (grammar.py: json_object, json_schema, regex, ...)

    @classmethod
    def chat(cls, messages: list[dict], images: tuple[Any, ...] = (), **options: Any) -> Request:
        return cls(None, "", messages=messages, images=tuple(images), **options)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]  # completion; without the eos token when finish_reason == "stop"
    text: str
    finish_reason: FinishReason
    prompt_tokens: int = 0
    image_tokens: int = 0
    error: Exception | None = None
    arrival_time: float = 0.0  # time.perf_counter() at add_request
    first_token_time: float | None = None
    finish_time: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, where the request asked for them


@dataclass(slots=True)
class Prepared:
    seq: Sequence
    pixel_values: torch.Tensor  # the image's rows in the model's layout: patches [P, C*Tp*p*p] or tiles [T, C, S, S]
    grid_thw: torch.Tensor  # [N, 3]
    positions: torch.Tensor  # [R, num_prompt_tokens] the model's rotary positions of the prompt (R = 3: M-RoPE)
    rope_delta: int  # generated token i (i >= prompt length) sits at position i + rope_delta


class Preprocessor:
    """Request -> Sequence + pixels + positions, on the preprocessing threads. Raises RequestRejected on a bad
    request (it fails alone)."""

    def __init__(self, processor, image_preprocessor: ImagePreprocessor, model, model_id: str,
                 eos_token_ids: tuple[int, ...], share_encoder_outputs: bool = True) -> None:
        self.chat, self.image_preprocessor, self.model = ChatPrompt(processor), image_preprocessor, model
        self.image_token_id, self.eos_token_ids = model.config.image_token_id, eos_token_ids
        self.model_id, self.share = model_id, share_encoder_outputs
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.settings = {"policy": asdict(image_preprocessor.policy), "image_mean": image_preprocessor.image_mean,
                         "image_std": image_preprocessor.image_std, "rescale": image_preprocessor.rescale_factor}

    def prompt_ids(self, question: str, num_image_tokens: int = 1) -> list[int]:
        return self.chat.ids(question, num_image_tokens)

    def __call__(self, request_id: str, req: Request) -> Prepared:
        messages, images = _chat(req)
        sampling, stopper = self.sampling(req)
        template_ids = self.chat.template_ids(messages)  # each image one placeholder: checked before any pixel work
        check_text_tokens(self.chat.text_tokens(template_ids), req)
        policies = self._policies(messages)  # each image's detail / pixel bounds (vlmq.resolution)
        try:  # patches [P, D] or tiles [T, 3, S, S]
            pixel_values, grid_thw = self.image_preprocessor(list(images), policies=policies) if policies else \
                self.image_preprocessor(list(images))
        except ValueError as e:
            raise RequestRejected(str(e), "invalid_image") from e
        counts = self.model.image_counts(grid_thw)  # (encoder patches, LM tokens) of each image
        try:
            ids, offsets = self.chat.expand(template_ids, [tokens for _, tokens in counts])
        except ValueError as e:  # a template that places images elsewhere than the image parts say
            raise RequestRejected(str(e), "invalid_prompt") from e
        positions, delta = self.positions(ids, grid_thw, req.max_new_tokens)
        # Without sharing, every request gets its own key: no encoder-cache or image-prefix reuse across requests.
        settings = self.settings if self.share else {**self.settings, "request": request_id}
        # an image resized to other bounds is another encoder input: its own key in every cache
        each = [settings if p is None else {**settings, "policy": asdict(p)} for p in policies or [None] * len(images)]
        placeholders = tuple(ImagePlaceholder(make_key(pixel_hash(image), self.model_id, image_settings,
                                                       req.cache_salt), at, num_tokens, num_patches)
                             for image, at, (num_patches, num_tokens), image_settings
                             in zip(images, offsets, counts, each, strict=True))
        seq = Sequence(request_id, ids, images=placeholders, sampling=sampling, priority=req.priority,
                       cache_salt=req.cache_salt or "", stopper=stopper, grammar=self._grammar(req))
        return Prepared(seq, pixel_values, grid_thw, positions, delta)

    def _policies(self, messages: list[dict]) -> list[Any] | None:
        """Each image part's resolution policy where any part asks for its own bounds (None: none does)."""
        parts = image_parts(messages)
        if not any(set(part) - {"type"} for part in parts):
            return None
        base = self.image_preprocessor.policy
        try:
            return [image_policy(base, part) for part in parts]
        except InvalidRequest as e:  # checked at submit with the same rule: a record written by another version
            raise RequestRejected(str(e), e.code) from e

    def sampling(self, req: Request) -> tuple[SamplingParams, StopMatcher | None]:
        """The request's sampling parameters and, where it has stop strings, their matcher."""
        try:
            stop = check_stop(req.stop)
            if not all(isinstance(t, int) and 0 <= t < len(self.chat.tokenizer) for t in req.stop_token_ids):
                raise ValueError(f"stop_token_ids must be token ids of this model's vocabulary, got "
                                 f"{list(req.stop_token_ids)}")
        except ValueError as e:
            raise RequestRejected(str(e), "invalid_stop") from e
        eos = tuple(req.stop_token_ids) + (() if req.ignore_eos else self.eos_token_ids)
        stopper = StopMatcher(stop, self._decode) if stop else None
        if any(not 0 <= t < len(self.chat.tokenizer) for t, _ in req.logit_bias):
            raise RequestRejected("logit_bias names a token id outside this model's vocabulary", "bad_sampling")
        try:
            return SamplingParams(req.max_new_tokens, eos, req.temperature, req.seed, req.top_p, req.top_k, req.min_p,
                                  req.repetition_penalty, req.frequency_penalty, req.presence_penalty,
                                  tuple(req.logit_bias), req.min_tokens, req.logprobs), stopper
        except (TypeError, ValueError) as e:
            raise RequestRejected(str(e), "bad_sampling") from e

    def _grammar(self, req: Request) -> GrammarState | None:
        if req.response_format is None:
            return None
        if self._grammars is None:
            with self._grammars_lock:  # one compiler per engine, made on first use
                if self._grammars is None:
                    self._grammars = Grammars(self.chat.tokenizer, self.model.config.text_config.vocab_size,
                                              self.eos_token_ids)
        try:
            return self._grammars.state(req.response_format)
        except GrammarError as e:
            raise RequestRejected(str(e), "bad_response_format") from e

    def _decode(self, ids: list[int]) -> str:
        return self.chat.tokenizer.decode(ids, skip_special_tokens=True)  # as the engine decodes the answer

    def positions(self, ids: list[int], grid_thw: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, int]:
        try:
            positions, delta = self.model.prompt_positions(ids, grid_thw)
        except ValueError as e:  # image tokens that do not match the image grid
            raise RequestRejected(str(e), "invalid_prompt") from e
        # the last token fed back is generated token max_new_tokens - 1, at position len(ids) + that + delta
        needed = len(ids) + delta + max_new_tokens - 1
        if needed > self.model.max_positions:
            raise RequestRejected(
                f"the prompt and answer need {needed} positions ({len(ids)} prompt tokens, max_new_tokens "
                f"{max_new_tokens}); the model has {self.model.max_positions}; shorten the prompt or lower "
                "max_new_tokens", "prompt_too_long")
        return positions, delta


def _chat(req: Request) -> tuple[list[dict], tuple[Any, ...]]:
    """The request as chat messages and their images; refuses a request without an image or messages."""
    if req.messages is not None:
        parts = sum(_image_parts(m) for m in req.messages)
        if parts != len(req.images):
            raise RequestRejected(f"the messages have {parts} image parts and the request {len(req.images)} images",
                                  "invalid_prompt")
        return req.messages, req.images
    if req.image is None:
        raise RequestRejected("a request needs an image (PIL RGB) and a question, or messages", "invalid_image")
    return single_turn(req.question), (req.image,)


def _image_parts(message: dict) -> int:
    content = message.get("content")
    return 0 if isinstance(content, str) else sum(part.get("type") == "image" for part in content or ())


def check_text_tokens(num_text_tokens: int, req: Request) -> None:
    """The text allowance the cost gate counted for the job (VLMQ_TEXT_TOKEN_BOUND) holds prompt and answer."""
    bound = req.max_text_tokens
    if bound is not None and num_text_tokens + req.max_new_tokens > bound:
        raise RequestRejected(
            f"the prompt has {num_text_tokens} text tokens and max_new_tokens is {req.max_new_tokens}: "
            f"{num_text_tokens + req.max_new_tokens} text tokens, over the bound of {bound} (VLMQ_TEXT_TOKEN_BOUND); "
            "shorten the prompt or lower max_new_tokens", "prompt_too_long")
