"""Reference backend: plain transformers ``generate`` on padded batches (``--backend hf``)."""
from __future__ import annotations

import logging

import torch
from transformers import (
    AutoModelForImageTextToText,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from vlmq.chat import image_parts
from vlmq.errors import InvalidRequest
from vlmq.workers.backends.base import Backend, GenOutput, GenRequest, is_canceled
from vlmq.workers.engine.sequence import FinishReason
from vlmq.workers.engine.spec_decode import position_generator
from vlmq.workers.models.processor import ChatPrompt, load_processor, single_turn

log = logging.getLogger(__name__)


class CancelCriteria(StoppingCriteria):
    """Stops the rows of canceled requests; polls every ``every`` decode steps."""

    def __init__(self, batch: list[GenRequest], every: int = 8) -> None:
        self.batch, self.every, self.steps = batch, every, 0
        self.stopped = [False] * len(batch)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.steps += 1
        if self.steps % self.every == 0:
            pairs = zip(self.stopped, self.batch, strict=True)
            self.stopped = [s or is_canceled(r) for s, r in pairs]
        return torch.tensor(self.stopped, dtype=torch.bool, device=input_ids.device)


class RowSampler(LogitsProcessor):
    """Samples each row at its request's temperature, then leaves only the drawn token for generate's greedy pick;
    rows at temperature 0 are left alone (greedy). A seeded row draws its i-th token from the engine's (seed, i)
    stream (spec_decode.position_generator): what it draws does not depend on its batch, and equals the engine's
    draw wherever the two compute the same logits."""

    def __init__(self, batch: list[GenRequest], device: torch.device) -> None:
        self.device, self.step = device, 0
        self.rows = [(row, r.temperature, r.seed) for row, r in enumerate(batch) if r.temperature > 0]
        self.fresh = torch.Generator(device=device)
        self.fresh.seed()  # unseeded rows: fresh randomness

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores: [B, vocab] the next-token logits
        for row, temperature, seed in self.rows:
            gen = self.fresh if seed is None else position_generator(seed, self.step, self.device)
            probs = torch.softmax(scores[row].float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=gen)
            scores[row] = torch.where(torch.arange(len(probs), device=scores.device) == token, 0.0, -torch.inf)
        self.step += 1
        return scores


class HFBackend(Backend):
    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        self.model_dir = model_dir
        self.device = torch.device(device)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        self.model.to(self.device).eval()
        self.processor = load_processor(model_dir)
        self.chat = ChatPrompt(self.processor)  # the user's text as plain text, as on the engine
        tokenizer = self.processor.tokenizer
        self.image_token_id = self.chat.image_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        # One padded batch per max_new_tokens value keeps generate's stopping exact per job.
        outputs: dict[int, GenOutput | Exception] = {}
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, r in enumerate(requests):
            if r.controls:  # refused by name, never dropped
                outputs[i] = InvalidRequest(f"the hf reference backend does not apply {', '.join(sorted(r.controls))}; "
                                            "use the engine backend", code="unsupported_control")
                continue
            if r.messages is not None and any(set(p) - {"type"} for p in image_parts(r.messages)):
                outputs[i] = InvalidRequest("the hf reference backend does not apply image detail or pixel bounds; "
                                            "use the engine backend", code="unsupported_control")
                continue
            groups.setdefault((r.max_new_tokens, r.ignore_eos), []).append(i)
        for (max_new, _), idx in groups.items():
            batch = [requests[i] for i in idx]
            try:
                results: list[GenOutput | Exception] = list(self._generate(batch, max_new))
            except Exception:  # a bad member must not sink the batch: retry one by one
                log.exception("batch of %d failed; retrying one by one", len(batch))
                results = [self._one(r) for r in batch]
            outputs.update(zip(idx, results, strict=True))
        return [outputs[i] for i in range(len(requests))]

    def _one(self, request: GenRequest) -> GenOutput | Exception:
        try:
            return self._generate([request], request.max_new_tokens)[0]
        except Exception as e:  # returned in its slot; the worker fails this job alone
            return e

    @torch.inference_mode()
    def _generate(self, batch: list[GenRequest], max_new_tokens: int) -> list[GenOutput]:
        inputs = {k: v.to(self.device) for k, v in self._inputs(batch).items()}
        cancel = CancelCriteria(batch)
        # ignore_eos as in the engine (and vLLM): an eos token is generated like any other and does not stop
        no_eos = {"eos_token_id": []} if batch[0].ignore_eos else {}
        sampler = LogitsProcessorList([RowSampler(batch, self.device)])  # do_sample=False: greedy over its pick
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id,
                                  stopping_criteria=StoppingCriteriaList([cancel]), logits_processor=sampler,
                                  **no_eos)
        prompt_len = inputs["input_ids"].shape[1]
        outputs = [self._output(inputs, out, row, prompt_len, batch[row].ignore_eos) for row in range(len(batch))]
        for output, stopped in zip(outputs, cancel.stopped, strict=True):
            output.finish_reason = FinishReason.CANCELED if stopped else output.finish_reason
        return outputs

    def _inputs(self, batch: list[GenRequest]) -> dict[str, torch.Tensor]:
        # what the processor returns for these prompts, except that the user's text stays plain text
        chats = [(r.messages, r.images) if r.messages is not None else (single_turn(r.prompt), (r.image,))
                 for r in batch]
        flat = [image for _, row_images in chats for image in row_images]
        images, num_tokens = self.processor.image_inputs(flat) if flat else ({}, [])
        rows, at = [], 0
        for messages, row_images in chats:  # each row's images' token counts, in order
            rows.append(self.chat.messages_ids(messages, num_tokens[at:at + len(row_images)])[0])
            at += len(row_images)
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in rows])  # [B, L] left-padded
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])
        return {"input_ids": input_ids, "attention_mask": mask, **self.processor.text_inputs(input_ids, mask), **images}

    def _output(self, inputs: dict, out: torch.Tensor, row: int, prompt_len: int, ignore_eos: bool) -> GenOutput:
        ids = out[row, prompt_len:].tolist()
        finish = FinishReason.LENGTH
        for n, t in enumerate(ids):
            if t in self.eos_ids and not ignore_eos:
                ids, finish = ids[:n], FinishReason.STOP
                break
        mask = inputs["attention_mask"][row]
        prompt_tokens = int(mask.sum())
        image_tokens = int((inputs["input_ids"][row] == self.image_token_id).sum())
        text = self.processor.tokenizer.decode(ids, skip_special_tokens=True)
        return GenOutput(text, ids, finish, prompt_tokens, image_tokens)
