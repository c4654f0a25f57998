"""Can the tiny vision tower tell the shapes apart? Train it alone on per-token labels, or probe a trained one.

    python scripts/probe_vision.py --minutes 3                   # shapes on the token grid (the task)
    python scripts/probe_vision.py --minutes 3 --off-grid        # shapes at any offset, sized with their cell
    python scripts/probe_vision.py --minutes 1 --load workers/assets/tiny-shapes   # linear probe, tower frozen

The tower (the bundled model's vision config, fresh weights) and a linear head learn the colour and
shape under each image token (the training script's auxiliary target). Every 40 steps it prints, on 60
held-out images: the share of shape-covered tokens whose shape is right, and of shapes whose tokens'
majority vote is right. With --load the tower is a trained model's, frozen, and only the head learns:
what the LM could read off the image tokens.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tiny import data
from tiny import model as tiny_model
from tiny import tokenizer as tiny_tokenizer
from tiny.losses import aux_heads, image_features, split_ce
from tiny.targets import AUX_CLASSES
from transformers import Qwen2VLForConditionalGeneration

from vlmq.workers.models.processor import load_processor


def shape_accuracy(logits: torch.Tensor, groups: list[data.Group], classes: tuple[int, int]) -> tuple[float, float]:
    """(tokens with a shape whose shape is predicted right, shapes whose tokens' majority vote is right)."""
    predicted = logits.split(classes, -1)[1].argmax(-1)
    labels = torch.cat([g.token_labels for g in groups])
    covered = labels[:, 1] > 0
    tokens = (predicted[covered] == labels[covered, 1]).float().mean().item()
    right = total = start = 0
    for g in groups:
        n = g.token_labels.shape[0]
        votes, own = predicted[start: start + n], g.token_labels
        start += n
        for colour, shape in {tuple(x) for x in own.tolist() if x[1] > 0}:  # same colour and shape: one object
            mask = (own[:, 0] == colour) & (own[:, 1] == shape)
            right += int(torch.bincount(votes[mask], minlength=classes[1]).argmax().item() == shape)
            total += 1
    return tokens, right / max(1, total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--max-side", type=int, default=224, help="image sides drawn from 56..this")
    p.add_argument("--off-grid", action="store_true", help="shapes at any offset to the token grid")
    p.add_argument("--load", type=Path, help="probe this trained model's tower (frozen)")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp())
    tiny_tokenizer.save_tokenizer_files(folder)
    builder = data.RowBuilder(load_processor(folder))
    torch.manual_seed(0)
    if args.load:
        model = Qwen2VLForConditionalGeneration.from_pretrained(args.load)
    else:
        ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer())
        model = Qwen2VLForConditionalGeneration(tiny_model.target_config(ids, rope_theta=20.0))
    head = aux_heads(model.config.text_config.hidden_size)["token"]
    params = list(head.parameters()) + ([] if args.load else list(model.model.visual.parameters()))
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng, held_rng = np.random.default_rng(1), np.random.default_rng(99)
    on_grid = not args.off_grid
    held = [data.make_group(builder, held_rng, 1, args.max_side, on_grid) for _ in range(60)]

    def logits(groups: list[data.Group]) -> torch.Tensor:
        return head(torch.cat(image_features(model, groups)[1]))

    t0, step, report = time.time(), 0, {}
    while time.time() - t0 < args.minutes * 60:
        groups = [data.make_group(builder, rng, 1, args.max_side, on_grid) for _ in range(8)]
        loss = split_ce(logits(groups), torch.cat([g.token_labels for g in groups]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 40 == 0:
            with torch.no_grad():
                tokens, objects = shape_accuracy(logits(held), held, AUX_CLASSES)
            report = {"seconds": round(time.time() - t0), "step": step, "images": 8 * step,
                      "token_shape": round(tokens, 3), "object_shape": round(objects, 3)}
            print(json.dumps(report), flush=True)
    print(json.dumps({"final": report, "on_grid": on_grid, "max_side": args.max_side, "load": str(args.load)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
