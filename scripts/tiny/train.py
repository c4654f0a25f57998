"""One training run: the target and draft trained in data-parallel processes, saved as Hugging Face folders,
then evaluated, with the model cards written from the run's report."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from transformers import GenerationConfig, Qwen2ForCausalLM, Qwen2VLForConditionalGeneration

from tiny import DEMO_SEED, TEST_SEED, card, data, shapes
from tiny import model as tiny_model
from tiny import tokenizer as tiny_tokenizer
from tiny.evaluate import evaluate_folder
from tiny.loop import batches, probe, probe_pairs, run_training
from tiny.losses import aux_heads, draft_loss, target_loss, vision_loss
from tiny.options import Options, parse_args
from tiny.targets import separator_ids
from vlmq.workers.models.processor import load_processor


def main(argv=None, description: str | None = None) -> int:
    """The whole run (scripts/train_tiny.py): train, save, evaluate, write train_report.json and the cards."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv, description)
    history = card.read_history(opts.out)  # saving the target replaces its folder
    t0 = time.time()
    report = train(opts)
    report["train_wall_seconds"] = round(time.time() - t0, 1)
    report["machine"] = card.machine()
    print(json.dumps(report), flush=True)
    if opts.eval_n:
        result = evaluate_folder(opts.out, opts.draft_out, opts.eval_n)
        report["eval"] = result
        print(json.dumps(result, indent=1), flush=True)
        # the tests' own held-out split (reported, never trained on or used to pick a checkpoint)
        report["eval_tests"] = evaluate_folder(opts.out, None, opts.eval_n, TEST_SEED)
    report["script_wall_seconds"] = round(time.time() - t0, 1)
    (opts.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    card.write_model_cards(opts, report, argv, history)
    return 0


def train(opts: Options) -> dict:
    """Train both models with opts.procs data-parallel processes (gloo); rank 0 saves."""
    tiny_tokenizer.save_tokenizer_files(opts.out, registers=opts.registers)
    if opts.procs == 1:
        return _train_rank(0, opts, None)
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_train_rank, args=(opts, tmp), nprocs=opts.procs, join=True)
        return json.loads((Path(tmp) / "report.json").read_text())


def _train_rank(rank: int, opts: Options, tmp: str | None) -> dict:
    if tmp is not None:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=opts.procs)
    try:
        report = _train_models(rank, opts)
        if tmp is not None and rank == 0:
            (Path(tmp) / "report.json").write_text(json.dumps(report))
        return report
    finally:
        if tmp is not None:
            dist.destroy_process_group()


def _train_models(rank: int, opts: Options) -> dict:
    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)  # the same initial weights on every rank
    ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer(opts.registers))
    processor = load_processor(opts.out)
    builder = data.RowBuilder(processor)
    register_ids = torch.tensor(builder.mid_ids[1:])  # the template's tokens after <|vision_end|>, in order
    separators = separator_ids(builder.tok)
    pad_id = ids["<|endoftext|>"]
    if opts.init_from is not None:  # continue training a saved target (same tokenizer)
        target = Qwen2VLForConditionalGeneration.from_pretrained(opts.init_from, dtype=torch.float32)
    else:
        target = Qwen2VLForConditionalGeneration(tiny_model.target_config(
            ids, opts.hidden, opts.layers, opts.vision_depth, opts.vision_embed, opts.mlp_mult, opts.rope_theta,
            tuple(int(v) for v in opts.mrope.split(",")), opts.head_dim, opts.kv_groups))
    linear_patch_embed(target)
    draft = Qwen2ForCausalLM(tiny_model.draft_config(ids))
    report = {"target_params": sum(p.numel() for p in target.parameters()),
              "draft_params": sum(p.numel() for p in draft.parameters())}
    rng = np.random.default_rng((opts.seed, rank))
    probe_fn = None
    if opts.probe_every and rank == 0:
        pairs = probe_pairs(builder)
        probe_fn = lambda m: probe(m, pairs, pad_id)  # noqa: E731
    if opts.aux_weight:
        torch.manual_seed(opts.seed + 7)
        target.aux = aux_heads(target.config.text_config.hidden_size, bool(opts.where), bool(opts.summary),
                               opts.register_target if opts.registers else "", bool(opts.ask), bool(opts.phrase))
    clock: dict = {}

    def loss_fn(model, batch):
        if clock.get("progress", 0.0) < opts.vision_until and hasattr(model, "aux"):
            return vision_loss(model, batch)
        return target_loss(model, batch, pad_id, opts.aux_weight, builder if opts.packed else None, register_ids,
                           opts.per_row, separators)

    secs, cpu, images, steps = run_training(
        target, loss_fn, batches(builder, rng, opts, clock),
        opts.steps, opts.lr, opts.warmup, opts.log_every, "target", opts.budget_min * 60, probe_fn, clock)
    if hasattr(target, "aux"):
        del target.aux
    if probe_fn is not None:
        report["probe_own_swapped"] = [round(v, 3) for v in probe_fn(target)]
    report.update(target_seconds=round(secs, 1), target_cpu_seconds=round(cpu, 1), target_images=images,
                  target_steps=steps)
    if rank == 0:
        save_folder(target, opts.out, ids, opts.registers)
    rng = np.random.default_rng((opts.seed + 1, rank))
    secs, cpu, images, steps = run_training(
        draft, lambda m, b: draft_loss(m, b, builder, pad_id), batches(builder, rng, opts), opts.draft_steps,
        opts.draft_lr, min(opts.warmup, opts.draft_steps), opts.log_every, "draft", opts.draft_budget_min * 60)
    report.update(draft_seconds=round(secs, 1), draft_cpu_seconds=round(cpu, 1), draft_images=images,
                  draft_steps=steps,
                  procs=opts.procs, threads=opts.threads)
    if rank == 0:
        save_folder(draft, opts.draft_out, ids, opts.registers)
    if rank == 0 and opts.demo_dir is not None:
        write_demo_assets(opts.demo_dir)
    return report


def linear_patch_embed(model) -> None:
    """The patch embedding is a Conv3d whose kernel equals its stride: one matmul per patch row. Run it as that
    matmul on the same weight (the checkpoint is unchanged): on CPU the convolution's backward is a large share of
    a training step, and the matmul's forward and backward cost much less."""
    embed = model.model.visual.patch_embed
    weight = embed.proj.weight

    def forward(pixel_values: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))

    embed.forward = forward


def save_folder(model, out: Path, ids, registers: int = 0) -> None:
    """A Hugging Face folder: weights, config, generation config, tokenizer, chat template, processor config."""
    _fresh(out)
    tiny_tokenizer.save_tokenizer_files(out, registers=registers)
    model.save_pretrained(out)
    _generation_config(ids).save_pretrained(out)


def _fresh(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def _generation_config(ids) -> GenerationConfig:
    return GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
        do_sample=False, max_new_tokens=64,
    )


def write_demo_assets(out: Path, seed: int = DEMO_SEED) -> list[dict]:
    """8 held-out demo images (100-900 px, several aspect ratios, one JPEG with EXIF orientation)."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = [(100, 100), (160, 120), (224, 336), (300, 180), (448, 448), (640, 400), (360, 720), (900, 600)]
    samples = []
    for i, size in enumerate(sizes):
        rng = np.random.default_rng((seed, i))
        scene = shapes.sample_scene(rng, size)
        image = shapes.render(scene, rng)
        question, answer = (shapes.CAPTION_PROMPT, shapes.caption(scene)) if i % 2 == 0 else \
            shapes.pick_question(scene, rng, caption_prob=0.0)
        name = f"sample_{i}_{size[0]}x{size[1]}"
        if i == 3:
            # stored rotated 90 degrees with EXIF orientation 6: viewers (and exif_transpose) show it upright
            name += "_exif.jpg"
            exif = Image.Exif()
            exif[0x0112] = 6
            image.transpose(Image.Transpose.ROTATE_90).save(out / name, quality=95, exif=exif.tobytes())
        else:
            name += ".png"
            image.save(out / name)
        samples.append({"file": name, "prompt": question, "expected": answer})
    (out / "samples.json").write_text(json.dumps(samples, indent=2) + "\n")
    return samples
