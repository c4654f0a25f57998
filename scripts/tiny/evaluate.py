"""Greedy evaluation of a tiny-shapes folder (exact match by question kind and image size) and of the draft's
agreement with the target, through plain transformers."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tiny import EVAL_SEED, data, shapes
from vlmq.workers.models.processor import load_processor, render_prompt


def _num_tokens(processor, image) -> int:
    out = processor.image_processor(images=[image], return_tensors="np")
    return int(out["image_grid_thw"][0].prod()) // 4


@torch.inference_mode()
def greedy_answers(model, processor, examples, max_batch_tokens: int = 3000, max_new_tokens: int = 48) -> list[str]:
    """Answers for (image, question) examples, batched by image size with left padding."""
    sizes = [_num_tokens(processor, ex.image) for ex in examples]
    order = sorted(range(len(examples)), key=sizes.__getitem__)
    answers: list[str] = [""] * len(examples)
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch: list[int] = []
        for i in order + [None]:
            cost = 0 if i is None else sizes[i] + 80
            if batch and (i is None or cost * (len(batch) + 1) > max_batch_tokens):
                _decode_batch(model, processor, [examples[j] for j in batch], answers, batch, max_new_tokens)
                batch = []
            if i is not None:
                batch.append(i)
    finally:
        tokenizer.padding_side = side
    return answers


def _decode_batch(model, processor, batch, answers, indices, max_new_tokens) -> None:
    texts = [render_prompt(processor, ex.question) for ex in batch]
    inputs = processor(text=texts, images=[ex.image for ex in batch], return_tensors="pt", padding=True)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1]:]
    for j, text in zip(indices, processor.batch_decode(new, skip_special_tokens=True), strict=True):
        answers[j] = text.strip()


def exact_match(examples, answers) -> float:
    return sum(a == ex.answer for ex, a in zip(examples, answers, strict=True)) / max(1, len(examples))


@torch.inference_mode()
def draft_agreement(target, draft, processor, builder, examples, answers) -> tuple[int, int]:
    """Teacher-forced on the target's greedy answers: positions where draft argmax == target argmax.

    The draft sees the chat text without image pads (vision_start and vision_end kept).
    Returns (agreeing positions, positions).
    """
    agree = total = 0
    for ex, ans in zip(examples, answers, strict=True):
        text = render_prompt(processor, ex.question)
        inputs = processor(text=[text + ans + "<|im_end|>"], images=[ex.image], return_tensors="pt")
        ans_len = len(builder.row(ex.question, ans, 0)[0]) - len(builder.prompt_ids(ex.question, 0))
        t_pred = target(**inputs).logits[0, -ans_len - 1 : -1].argmax(-1)
        ids, _ = builder.row(ex.question, ans, 0)
        d_pred = draft(input_ids=torch.tensor([ids])).logits[0, -ans_len - 1 : -1].argmax(-1)
        agree += int((t_pred == d_pred).sum())
        total += ans_len
    return agree, total
def evaluate_folder(target_dir: Path, draft_dir: Path | None, n: int, seed: int = EVAL_SEED, **split) -> dict:
    """Greedy exact match of a folder on shapes.make_split(seed, n, **split), by size and question kind (+ the
    draft's agreement with the target on the first 100, with `draft_dir`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    processor = load_processor(target_dir)
    target = AutoModelForImageTextToText.from_pretrained(target_dir).eval()
    examples = shapes.make_split(seed, n, **split)
    t0 = time.time()
    answers = greedy_answers(target, processor, examples)
    result = {"n": n, "seed": seed, "exact_match": exact_match(examples, answers),
              "eval_seconds": round(time.time() - t0, 1)}
    result["by_size"] = _tally(examples, answers, size_band)
    result["by_question"] = _tally(examples, answers, lambda ex: shapes.question_kind(ex.question))
    pairs = list(zip(examples, answers, strict=True))
    caps = [int(a == ex.answer) for ex, a in pairs if ex.question == shapes.CAPTION_PROMPT]
    result["captions"] = [sum(caps), len(caps)]
    result["failures"] = [(ex.question, ex.answer, a, ex.image.size) for ex, a in pairs if a != ex.answer][:10]
    if draft_dir is not None:
        draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
        builder = data.RowBuilder(processor)
        agree, total = draft_agreement(target, draft, processor, builder, examples[:100], answers[:100])
        result["draft_agreement"] = [agree, total, round(agree / max(1, total), 4)]
    return result


def size_band(ex) -> str:
    side = max(ex.image.size)
    return "56-224" if side <= 224 else "225-448" if side <= 448 else "449-768" if side <= 768 else "769-1024"


def _tally(examples, answers, key) -> dict[str, list[int]]:
    """{key(example): [exact matches, examples]}, sorted by key."""
    counts: dict[str, list[int]] = {}
    for ex, a in zip(examples, answers, strict=True):
        right_total = counts.setdefault(key(ex), [0, 0])
        right_total[0] += int(a == ex.answer)
        right_total[1] += 1
    return dict(sorted(counts.items()))
