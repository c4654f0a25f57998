"""Train the vision-aware proposer head (workers/engine/spec_head.py) for the bundled tiny-shapes model.

    python scripts/train_spec_head.py [--examples 1200] [--steps 800] [--seed 0] [--out <model>/spec-head]

1. The target answers training prompts (the training seed of tiny-shapes, 1000; never the held-out ones) greedily
   in the vlmq engine, which also hands over its last hidden states of every position (the numbers the head reads
   when serving: the same engine, the same kernels).
2. The head learns, at each position j, the target's next hidden state h_{j+1} (smooth L1) and the token after it
   (cross-entropy through the target's frozen LM head) from (h_j, x_{j+1}); a second pass feeds its own guesses
   back for the answer positions (as when it proposes several tokens), detached. Losses on answer positions only;
   the head's context starts at the last prompt token, whose hidden state already sums up the image and question.
Deterministic from --seed (one torch thread); about 5 minutes on one core.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny.shapes import make_split

from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.proposers import HEAD_DIR, MODEL_SETTINGS, Proposer
from vlmq.workers.engine.spec_decode import AdaptiveK
from vlmq.workers.engine.spec_head import SpecHead

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "workers" / "assets" / "tiny-shapes"
TRAIN_SEED, VALID_SEED = 1000, 1002  # tiny-shapes' training seed; a split nobody else uses


class Capture(Proposer):
    """Proposes nothing; keeps the target's hidden states of every computed position, per sequence."""

    def __init__(self) -> None:
        self.features: dict[str, list[torch.Tensor]] = {}
        self.seqs: dict[str, object] = {}

    def observe(self, out, runner_out, hidden) -> None:
        row = 0
        for s in out.scheduled:
            self.features.setdefault(s.seq_id, []).append(hidden[row:row + s.num_new_tokens].clone())
            self.seqs[s.seq_id] = s.seq
            row += s.num_new_tokens


def collect(n: int, seed: int) -> list[tuple[torch.Tensor, list[int], int]]:
    """(hidden states [L-1, H] of positions 0..L-2, token ids [L], prompt length) per example."""
    engine = Engine.from_model_dir(MODEL, num_blocks=8192, enable_prefix_caching=False)
    engine.proposer, engine.adaptive_k = Capture(), AdaptiveK(max_batch=0)  # observe only
    examples = make_split(seed, n, caption_prob=0.5)
    engine.generate([Request(e.image, e.question, 64) for e in examples], prepare_all_first=True)  # fixed batches
    data = []
    for seq_id, seq in engine.proposer.seqs.items():
        feats = torch.cat(engine.proposer.features[seq_id])
        assert len(feats) == seq.num_tokens - 1, (len(feats), seq)
        data.append((feats, list(seq.token_ids), seq.num_prompt_tokens))
    engine.close()
    return data


def from_last_prompt_token(item):
    # the head's context starts at the last prompt token (as when serving: see spec_head.HeadProposer)
    feats, ids, p = item
    return feats[p - 1:], ids[p - 1:], 1


def batch_tensors(items, embed):
    # inputs at j = 0..L-2: (h_j, x_{j+1}); targets: h_{j+1}, x_{j+2}; answer positions j >= P - 2
    n = max(len(f) for f, _, _ in items)
    hidden = embed.weight.shape[1]
    feats, toks = torch.zeros(len(items), n, hidden), torch.zeros(len(items), n, dtype=torch.long)
    tgt_f = torch.zeros(len(items), n, hidden)
    tgt_t = torch.full((len(items), n), -100, dtype=torch.long)
    for b, (f, ids, p) in enumerate(items):
        m = len(f)
        feats[b, :m], toks[b, :m] = f, torch.tensor(ids[1:m + 1])
        tgt_f[b, :m - 1] = f[1:]
        t = torch.tensor(ids[2:m + 1])
        keep = torch.arange(m - 1) >= p - 2
        tgt_t[b, :m - 1] = torch.where(keep, t, -100)
    return feats, embed(toks), tgt_f, tgt_t


def train(data, target, steps: int, seed: int, batch: int = 16) -> SpecHead:
    torch.manual_seed(seed)
    head = SpecHead(SpecHead.config_for(target.config.text_config))
    embed, lm_head = target.language_model.embed_tokens, target.lm_head
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))  # similar lengths batch together
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        items = [data[i] for i in batches[int(torch.randint(len(batches), (1,), generator=g))]]
        feats, embeds, tgt_f, tgt_t = batch_tensors(items, embed)
        mask = tgt_t != -100
        out1 = head(feats, embeds)
        # pass 2: answer positions read the head's own guess of h_j (out1 at j - 1), as when proposing
        own = torch.cat([feats[:, :1], out1[:, :-1].detach()], 1)
        out2 = head(torch.where(mask[..., None], own, feats), embeds)
        loss = 0
        for out in (out1, out2):
            loss = loss + F.cross_entropy(lm_head(out[mask]), tgt_t[mask]) + F.smooth_l1_loss(out[mask], tgt_f[mask])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    return head.eval().requires_grad_(False)


@torch.no_grad()
def agreement(head: SpecHead, data, target) -> float:
    """Teacher-forced share of answer tokens the head's first guess gets right."""
    right = total = 0
    for item in data:
        feats, embeds, _, tgt_t = batch_tensors([item], target.language_model.embed_tokens)
        out = head(feats, embeds)
        mask = tgt_t != -100
        right += int((target.lm_head(out[mask]).argmax(-1) == tgt_t[mask]).sum())
        total += int(mask.sum())
    return right / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(MODEL / HEAD_DIR))
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    data, valid = (list(map(from_last_prompt_token, collect(n, seed)))
                   for n, seed in ((args.examples, TRAIN_SEED), (100, VALID_SEED)))
    t1 = time.perf_counter()
    from vlmq.workers.models.loader import load_model

    target = load_model(MODEL)
    with torch.enable_grad():
        head = train(data, target, args.steps, args.seed)
    t2 = time.perf_counter()
    report = dict(examples=args.examples, steps=args.steps, seed=args.seed, train_seed=TRAIN_SEED,
                  valid_seed=VALID_SEED, first_token_agreement=round(agreement(head, valid, target), 4),
                  collect_s=round(t1 - t0), train_s=round(t2 - t1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps({**head.config, "train_report": report}, indent=1) + "\n")
    if out.name == HEAD_DIR:  # the head sits in a model folder: the folder names it as its default proposer
        settings = out.parent / MODEL_SETTINGS
        known = json.loads(settings.read_text()) if settings.is_file() else {}
        settings.write_text(json.dumps({**known, "speculative": "head"}) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
