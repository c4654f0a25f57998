"""The training script's options (one dataclass; every field is a command-line flag)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tiny import DRAFT_DIR, TARGET_DIR, TRAIN_SEED
from tiny.targets import NUM_CELLS, NUM_PAIRS


@dataclass(slots=True)
class Options:
    out: Path = TARGET_DIR
    draft_out: Path = DRAFT_DIR
    steps: int = 100_000  # the wall-clock budgets below end training first on a 2-core machine
    draft_steps: int = 100_000
    budget_min: float = 25.5  # wall-clock cap on target training (0: none); the schedule follows whichever ends first
    draft_budget_min: float = 1.5
    lr: float = 4e-3
    draft_lr: float = 3e-3
    warmup: int = 60
    pool: int = 48  # images generated at a time, then bucketed by size
    batch_tokens: int = 1024  # padded LM tokens per step and process
    questions_per_image: int = 5  # 1 = caption or question; n > 1 = caption + n-1 distinct questions
    packed: int = 1  # 1: an image's rows share one pass of its tokens through the LM (data.pack_groups)
    balanced: int = 1  # 1: an image's questions spread over the question kinds (shapes.balanced_questions)
    max_side: int | None = None  # restrict image sides (smoke tests)
    eval_n: int = 200
    seed: int = TRAIN_SEED
    procs: int = 2  # data-parallel processes (one per core)
    threads: int = 1  # per process; tiny ops run faster in 2 single-threaded processes than 1 with 2 threads
    demo_dir: Path | None = None
    init_from: Path | None = None  # start the target from this folder instead of random weights
    log_every: int = 50
    hidden: int = 128  # target text hidden size (= vision merger output)
    layers: int = 4
    mlp_mult: int = 2
    vision_depth: int = 3
    vision_embed: int = 64
    rope_theta: float = 10.0  # high M-RoPE frequencies: a one-token shift in h or w is visible to attention
    mrope: str = "4,6,6"  # frequency pairs per (t, h, w) axis; sums to head_dim / 2
    head_dim: int = 32  # LM attention head width (hidden / head_dim heads)
    kv_groups: int = 2  # query heads per key/value head
    probe_every: int = 0  # 1: each log line adds the loss with each image's own vs another image's features
    aux_weight: float = 0.5  # weight of the training-only dense losses (0: answers only)
    small_until: float = 0.3  # curriculum: images of at most 224 px per side until this fraction of training
    vision_until: float = 0.1  # first phase: the vision tower alone learns what each image token shows
    where: int = 1  # 1: an extra training-only head: which 3x3 cell each image token lies in, from the LM
    summary: int = 1  # 1: the LM halfway up, at <|vision_end|>, names what each cell holds
    registers: int = 27  # register tokens after each image (chat template); what they name: register_target
    register_target: str = "both"  # cell: register i names cell i; pair: register k names (colour k//3, shape k%3)
    # both: nine cell registers, then the eighteen pair registers
    ask: int = 1  # 1: halfway up, each row's last prompt token names the colour, shape and cell its question asks about
    phrase: int = 1  # 1: halfway up, each caption token names the colour, shape and cell of the phrase it continues
    per_row: float = 0.0  # weight of the per-answer mean in the answer loss (0: per token, captions dominate)


def parse_args(argv, description: str | None = None) -> Options:
    opts = Options()
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("out", "draft_out", "demo_dir", "init_from"):
        p.add_argument("--" + name.replace("_", "-"), type=Path, default=getattr(opts, name))
    ints = ("steps", "draft_steps", "warmup", "pool", "batch_tokens", "max_side", "eval_n", "seed", "procs", "threads",
            "log_every", "questions_per_image", "hidden", "layers", "mlp_mult", "vision_depth", "vision_embed",
            "probe_every", "packed", "where", "balanced", "summary", "head_dim",
            "kv_groups", "registers", "ask", "phrase")
    for name in ints:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(opts, name))
    p.add_argument("--mrope", default=opts.mrope)
    p.add_argument("--register-target", choices=("cell", "pair", "both"), default=opts.register_target)
    for name in ("lr", "draft_lr", "budget_min", "draft_budget_min", "rope_theta", "aux_weight", "small_until",
                 "vision_until", "per_row"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(opts, name))
    opts = Options(**vars(p.parse_args(argv)))
    needed = {"pair": NUM_PAIRS, "both": NUM_CELLS + NUM_PAIRS}.get(opts.register_target)
    if opts.registers and needed and opts.registers != needed:
        p.error(f"--register-target {opts.register_target} needs --registers {needed} (cells first, then one per "
                "colour and shape)")
    return opts
