"""The training loop: size-bucketed batches of image groups, AdamW on a warmup + cosine schedule under a
step count or a wall-clock budget, data parallel over gloo processes, and the vision-use probe."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from tiny import EVAL_SEED, data, losses, shapes
from tiny.options import Options

TEXT_PER_ROW = 21  # about the text tokens a row adds after the image (question, answer, chat markers)
VISION_BATCH = 8  # images per step and process in the vision-only phase


def batches(builder, rng, opts: Options, clock: dict | None = None):
    """Endless stream of lists of Groups, each within the padded token budget.

    clock["progress"] (kept by run_training) drives the size curriculum (opts.small_until). Image sizes, the
    split of a pool into batches and their order come from a generator seeded alike on every rank (the scenes
    from `rng`, one per rank): the ranks' batches then cost about the same, and none waits long for the other
    at the gradient all-reduce (with independent sizes one rank often idled there)."""
    shared = np.random.default_rng((opts.seed, 999))
    while True:
        max_side = opts.max_side
        if clock is not None and clock.get("progress", 0.0) < opts.small_until:
            max_side = min(max_side or 224, 224)
        groups = [data.make_group(builder, rng, opts.questions_per_image, max_side, balanced=bool(opts.balanced),
                                  size_rng=shared) for _ in range(opts.pool)]
        groups.sort(key=lambda g: g.num_image_tokens)
        if clock is not None and clock.get("progress", 0.0) < opts.vision_until:  # no LM rows: more images a step
            yield from (groups[i: i + VISION_BATCH] for i in shared.permutation(range(0, len(groups), VISION_BATCH)))
            continue
        batch: list[data.Group] = []
        out = []
        for g in groups:
            if opts.packed:  # one sequence per image; the text's share estimated, so every rank splits alike
                width, rows = data.shared_length(g, builder) + TEXT_PER_ROW * opts.questions_per_image, len(batch) + 1
            else:
                width, rows = max(len(ids) for ids, _ in g.rows), sum(len(x.rows) for x in batch) + len(g.rows)
            if batch and rows * width > opts.batch_tokens:
                out.append(batch)
                batch = []
            batch.append(g)
        out.append(batch)
        for i in shared.permutation(len(out)):
            yield out[i]


def run_training(model, loss_fn, stream, steps, peak_lr, warmup, log_every, name, budget_s=0.0, probe_fn=None,
                 clock: dict | None = None):
    """AdamW on a warmup + cosine schedule over `steps`, or over `budget_s` seconds if that runs out first."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.98), foreach=True)
    model.train()
    parallel = dist.is_initialized() and dist.get_world_size() > 1
    t0, c0, seen, running, step = time.time(), time.process_time(), 0, [], 0
    progress = 0.0 if steps > 0 else 1.0
    while progress < 1.0:
        batch = next(stream)
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, peak_lr, warmup, step)
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if parallel:
            _all_reduce_grads(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running.append(loss.item())
        seen += len(batch)
        step += 1
        progress = _progress(step, steps, time.time() - t0, budget_s, parallel)
        if clock is not None:
            clock["progress"] = progress
        if log_every and step % log_every == 0 and _rank() == 0:
            print(f"[{name}] step {step}/{steps} progress {progress:.3f} loss {np.mean(running):.4f} "
                  f"images/rank {seen} wall {time.time() - t0:.0f}s cpu/rank {time.process_time() - c0:.0f}s"
                  + "".join(f" {k} {np.mean(v):.3f}" for k, v in losses.PARTS.items())
                  + ("" if probe_fn is None else " probe own/swapped {:.3f}/{:.3f}".format(*probe_fn(model))),
                  flush=True)
            running = []
        if log_every and step % log_every == 0:
            losses.PARTS.clear()
    model.eval()
    totals = torch.tensor([time.process_time() - c0, float(seen)], dtype=torch.float64)
    if parallel:
        dist.all_reduce(totals)
    return time.time() - t0, float(totals[0]), int(totals[1]), step


def lr_at(progress, peak, warmup, step):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _progress(step, steps, elapsed, budget_s, parallel) -> float:
    p = step / max(1, steps)
    if budget_s > 0:
        p = max(p, elapsed / budget_s)
    if parallel:  # every rank follows rank 0's clock, so all stop after the same step
        t = torch.tensor([p if _rank() == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        p = float(t[0])
    return p


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _all_reduce_grads(params) -> None:
    # data parallel over processes: average the gradients (one flat buffer, one all_reduce)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset: offset + g.numel()].view_as(p)
        offset += g.numel()


def probe_pairs(builder, n: int = 24, seed: int = EVAL_SEED + 100) -> list[tuple[data.Group, data.Group]]:
    """Pairs of same-sized images: rows asked about the first, features of either (a vision-use probe)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        size = shapes.sample_size(rng, (0.6, 0.9, 0.99))
        groups = []
        for _ in range(2):
            scene = shapes.sample_scene(rng, size)
            pixel_values, [grid] = builder.images([shapes.render(scene, rng)])
            k = int(grid.prod()) // 4
            qa = [(shapes.CAPTION_PROMPT, shapes.caption(scene)), shapes.pick_question(scene, rng, 0.0)]
            groups.append(data.Group(pixel_values, grid, [builder.row(q, a, k) for q, a in qa], qa, k))
        pairs.append((groups[0], groups[1]))
    return pairs


@torch.no_grad()
def probe(model, pairs, pad_id) -> tuple[float, float]:
    """(loss with each image's own features, loss with its pair's features): equal means blind."""
    own = [g for g, _ in pairs]
    swapped = [data.Group(o.pixel_values, o.grid_thw, g.rows, g.qa, g.num_image_tokens) for g, o in pairs]
    model.eval()
    result = float(losses.target_loss(model, own, pad_id)), float(losses.target_loss(model, swapped, pad_id))
    model.train()
    return result
