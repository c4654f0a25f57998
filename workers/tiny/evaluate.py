"""Greedy evaluation of the tiny target and draft agreement, through plain transformers."""

from __future__ import annotations

import torch

from vlmq.workers.models.processor import render_prompt


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
