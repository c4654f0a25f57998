"""Speculative decoding: the scheduler's KV accounting under proposals, and exact rejection sampling.

The engine-level greedy identity (every proposer, against transformers) is in test_engine.py.
"""
from __future__ import annotations

import random

import pytest
import torch
from test_scheduler import image_seq, small_config, text_seq

from vlmq.workers.engine import Scheduler, SequenceStatus, spec_decode
from vlmq.workers.engine.proposers import ngram_lookup
from vlmq.workers.engine.spec_decode import AdaptiveK, SpecConfig, verify
from vlmq.workers.engine.testing import FakeRunner, check_step, reference_completion


# -------------------------------------------------------------------------------------- KV accounting (FakeRunner)
def propose(sched: Scheduler, refs: dict, rng: random.Random) -> None:
    """Proposals from the reference completion, each position wrong with probability 0.3: accepted and rejected
    proposals, of random lengths."""
    for seq in sched.running:
        if seq.num_tokens - seq.num_computed_tokens == 1:
            done = seq.num_completion_tokens
            guess = refs[seq.seq_id][done:done + rng.randrange(0, 6)]
            seq.spec_token_ids = [t if rng.random() > 0.3 else (t + 1) % 1000 for t in guess]


def run_with_proposals(sched: Scheduler, runner: FakeRunner, refs: dict, rng: random.Random, abort_p: float):
    done, aborted, counts = {}, set(), {"proposed": 0, "accepted": 0, "cached": {}, "preempted": 0}
    while sched.has_unfinished:
        propose(sched, refs, rng)
        out = sched.schedule()
        check_step(sched, out)
        counts["preempted"] += len(out.preempted_seq_ids)
        if rng.random() < abort_p and sched.running:  # an abort while the step is in flight
            aborted.add(sched.abort(rng.choice(sched.running).seq_id).seq_id)
        result = runner.execute(out)
        counts["cached"].update((s.seq_id, s.num_cached_tokens) for s in out.scheduled if s.num_cached_tokens)
        counts["proposed"] += sum(s.num_spec_tokens for s in out.scheduled)
        counts["accepted"] += sum(map(len, result.more_token_ids.values()))
        for seq in sched.update(result):
            done[seq.seq_id] = seq.completion_token_ids
    return done, aborted, counts


def test_proposals_preemption_and_aborts_keep_outputs_and_free_every_block():
    cfg = small_config(num_blocks=20, max_num_batched_tokens=24)
    sched, rng = Scheduler(cfg), random.Random(3)
    runner = FakeRunner(cfg.block_size, sched.encoder_cache)
    seqs = [text_seq(i, 5 + i % 7, max_new_tokens=14) for i in range(10)]
    # half stop at an eos: a proposal accepted as eos ends the sequence, the tokens verified after it are dropped
    seqs[::2] = [text_seq(s.seq_id, s.num_prompt_tokens, 14, eos=(reference_completion(s)[6],)) for s in seqs[::2]]
    seqs += [image_seq(f"img{i}", [(f"k{i % 3}", 5)], max_new_tokens=12) for i in range(6)]
    refs = {s.seq_id: reference_completion(s) for s in seqs}
    for s in seqs:
        sched.add(s)
    done, aborted, counts = run_with_proposals(sched, runner, refs, rng, abort_p=0.03)
    assert counts["preempted"] and aborted and counts["accepted"] > 0 and counts["proposed"] > counts["accepted"]
    for seq_id, tokens in done.items():
        assert seq_id in aborted or tokens == refs[seq_id]
    bm = sched.block_manager
    assert bm.num_free_blocks == cfg.num_blocks and not any(bm.ref_counts)

    # Later requests extend finished ones (prompt + answer): they hit cached blocks that hold generated tokens.
    # A rejected proposal's KV under an accepted token's hash would change what the fake model reads back.
    first = {f"later-{s.seq_id}": s for s in seqs if s.seq_id not in aborted and len(done[s.seq_id]) > 8}
    later = [type(s)(seq_id, s.token_ids[:-1], images=s.images, sampling=s.sampling) for seq_id, s in first.items()]
    for s in later:
        sched.add(s)
    done, _, counts = run_with_proposals(sched, runner, {s.seq_id: reference_completion(s) for s in later}, rng, 0)
    for s in later:
        assert done[s.seq_id] == reference_completion(s)
    # some took blocks of generated tokens from the cache (past the prompt of the request they extend)
    assert sum(counts["cached"].get(seq_id, 0) > s.num_prompt_tokens for seq_id, s in first.items()) >= 2
    assert bm.num_free_blocks == cfg.num_blocks


def test_proposals_that_do_not_fit_are_dropped_not_preempting():
    cfg = small_config(num_blocks=9, max_num_batched_tokens=32)
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg.block_size, sched.encoder_cache)
    seq = text_seq(0, 7, max_new_tokens=20)
    sched.add(seq)
    sched.update(runner.execute(sched.schedule()))  # prefill: 2 blocks, one token sampled
    seq.spec_token_ids = [1] * 40  # 32 fit the token budget, but they would need 10 blocks: 7 are free
    out = sched.schedule()
    assert out.scheduled[0].num_spec_tokens == 0 and not out.preempted_seq_ids
    sched.update(runner.execute(out))
    seq.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4 and seq.status is SequenceStatus.RUNNING


# --------------------------------------------------------------------------------- exact sampling (chi-square)
VOCAB = 6


def tiny_model(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bigram target (logits [V, V]: row = previous token) and a draft that disagrees with it."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(VOCAB, VOCAB, generator=g)
    draft = target.flip(1) + torch.randn(VOCAB, VOCAB, generator=g)  # far from the target
    return target, draft


def sample_pair(target, draft, x0: int, k: int, sampled_draft: bool, gen: torch.Generator) -> tuple[int, int]:
    """The first two tokens after x0 under speculative sampling with k proposals per round."""
    out = [x0]
    while len(out) < 3:
        q = torch.softmax(draft, -1)
        proposal, probs = [], []
        for _ in range(k):
            prev = (out + proposal)[-1]
            t = int(torch.multinomial(q[prev], 1, generator=gen)) if sampled_draft else int(q[prev].argmax())
            proposal.append(t)
            probs.append(q[prev])
        logits = target[torch.tensor(out[-1:] + proposal)]  # [k + 1, V]: the target after x0 and each proposal
        out += verify(logits, proposal, torch.stack(probs) if sampled_draft else None, 1.0, gen)
    return out[1], out[2]


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled into one (the approximation needs it)."""
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))  # P(chi2_df > stat)


def two_sample_p(a: list, b: list) -> float:
    """Chi-square test of homogeneity: could samples a and b come from one distribution? Categories expected
    fewer than 5 times in either sample are pooled."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[x.count(c) for c in cats] for x in (a, b)], dtype=torch.float64)  # [2, C]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    small = (expected < 5).any(0)
    if small.any():
        counts = torch.cat([counts[:, ~small], counts[:, small].sum(1, keepdim=True)], 1)
        expected = torch.cat([expected[:, ~small], expected[:, small].sum(1, keepdim=True)], 1)
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2)) if df > 0 else 1.0


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: thread hand-offs would cost more than the work
    yield
    torch.set_num_threads(threads)


def sampling_p_values(sampled_draft: bool, n: int = 4000, seed: int = 1) -> tuple[float, float]:
    target, draft = tiny_model(0)
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for i in range(n):
        a, b = sample_pair(target, draft, 0, 1 + i % 3, sampled_draft, gen)
        pairs[a, b] += 1
    p = torch.softmax(target.double(), -1)
    exact_pairs = p[0][:, None] * p  # P(a, b) = p(a | x0) p(b | a)
    return chi_square_p(pairs.sum(1), n * p[0]), chi_square_p(pairs.flatten(), n * exact_pairs.flatten())


@pytest.mark.parametrize("sampled_draft", [True, False], ids=["draft-samples", "deterministic-proposals"])
def test_speculative_sampling_equals_the_target_distribution(sampled_draft):
    first, pair = sampling_p_values(sampled_draft)
    assert first > 0.01 and pair > 0.01, (first, pair)


BROKEN = {
    # keep a proposal with probability sqrt(min(1, p/q)): more than the target allows
    "acceptance": ("accept_probability", lambda p_x, q_x: torch.clamp(p_x / q_x, max=1.0).sqrt()),
    # after a rejection, draw from the target instead of the residual max(p - q, 0)
    "residual": ("_residual", lambda p, draft_probs, i, x: p),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
@pytest.mark.parametrize("sampled_draft", [True, False], ids=["draft-samples", "deterministic-proposals"])
def test_a_broken_rule_is_detected(monkeypatch, sampled_draft, broken):
    monkeypatch.setattr(spec_decode, *BROKEN[broken])
    first, pair = sampling_p_values(sampled_draft, n=1500)  # fewer draws than the test above: it still fails
    assert min(first, pair) < 0.01, (first, pair)


def test_greedy_verification_keeps_the_agreeing_prefix_and_one_more():
    logits = torch.full((4, 8), -1.0)
    logits[0, 5] = logits[1, 2] = logits[2, 7] = logits[3, 1] = 1.0  # argmax after x0, x1, x2, x3: 5, 2, 7, 1
    assert verify(logits, [5, 2, 7], None, 0.0) == [5, 2, 7, 1]
    assert verify(logits, [5, 3, 7], None, 0.0) == [5, 2]
    assert verify(logits, [4, 2, 7], None, 0.0) == [5]


# ----------------------------------------------------------------------------------------------- proposers, k
def test_ngram_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    assert ngram_lookup(tokens, 3, 4, 2) == [4, 5, 7]  # "1 2 3" last seen before "4 5 7"
    assert ngram_lookup([1, 2, 3, 4], 3, 4, 2) == []


def test_adaptive_k_follows_acceptance_and_switches_off_for_large_batches():
    ak = AdaptiveK(max_k=4, max_batch=8)
    assert ak.k_for("a", 1, 100) >= 2
    for _ in range(10):
        ak.observe("a", 4, 0)
    assert ak.k_for("a", 1, 100) == 0  # nothing accepted: off, but it probes now and then
    assert any(ak.k_for("a", 1, 100) for _ in range(ak.probe_every))
    for _ in range(10):
        ak.observe("b", 4, 4)
    assert ak.k_for("b", 1, 100) == 4 and ak.k_for("b", 9, 100) == 0 and ak.k_for("b", 1, 3) == 2
    slow = AdaptiveK(max_k=4, max_batch=8)
    slow.observe_cost(0.05, 1, 0.0, 1, decode_only=False)  # a proposer far dearer than a target step
    assert sum(slow.k_for("c", 1, 100) for _ in range(64)) == 1  # no sequence's acceptance would pay: rare probes
    # the default threshold is the proposer's measured one (spec_decode.MAX_BATCH), or what the config says
    assert SpecConfig("head").max_batch == 8 and SpecConfig("ngram").max_batch == 4
    assert SpecConfig("ngram", max_batch=0).max_batch == 0


def test_head_runner_computes_what_the_trained_head_computes():
    """The serving path (prepared weights, incremental cache, rotation matrices) gives the head's own forward,
    whether the positions come in one call or several."""
    from pathlib import Path

    from vlmq.workers.engine.spec_head import HeadCache, HeadRunner, load_head
    from vlmq.workers.models.loader import load_model

    model_dir = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
    target = load_model(model_dir, torch.device("cpu"), torch.float32)
    head = load_head(model_dir / "spec-head")
    runner = HeadRunner(head, target.language_model.embed_tokens.weight, target.lm_head)
    g = torch.Generator().manual_seed(0)
    feats = torch.nn.functional.normalize(torch.randn(9, 128, generator=g), dim=-1) * 128 ** 0.5
    ids = torch.randint(0, target.config.text_config.vocab_size, (9,), generator=g)
    with torch.inference_mode():
        want = head(feats[None], target.language_model.embed_tokens(ids)[None])[0]
        cache = HeadCache()
        got = torch.cat([runner(feats[a:b], ids[a:b], cache) for a, b in ((0, 4), (4, 5), (5, 9))])
        assert torch.allclose(got, want, atol=1e-4)
        cache.length = 4  # positions dropped and fed again (as after rejected proposals)
        assert torch.allclose(runner(feats[4:], ids[4:], cache), want[4:], atol=1e-4)
        assert torch.equal(runner.logits(got).argmax(-1), target.compute_logits(want).argmax(-1))


def test_a_model_folder_names_its_default_proposer(tmp_path):
    """speculative="model" (the worker's default) runs what the folder's vlmq.json names: the bundled tiny-shapes
    its head; "none" or None turns it off; a folder naming no proposer, or none at all, runs without."""
    import json
    import shutil
    from pathlib import Path

    from vlmq.workers.engine.engine import Engine
    from vlmq.workers.engine.proposers import model_default_proposer

    bundled = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
    assert model_default_proposer(bundled) == "head"
    assert Engine.from_model_dir(bundled, num_blocks=64, speculative="model").proposer.name == "head"
    for off in ("none", None):
        assert Engine.from_model_dir(bundled, num_blocks=64, speculative=off).proposer is None
    folder = Path(shutil.copytree(bundled, tmp_path / "m", ignore=shutil.ignore_patterns("spec-head")))
    (folder / "vlmq.json").write_text(json.dumps({"speculative": "ngram"}))
    assert Engine.from_model_dir(folder, num_blocks=64, speculative="model").proposer.name == "ngram"
    (folder / "vlmq.json").write_text(json.dumps({"speculative": "eagle"}))
    with pytest.raises(ValueError, match="vlmq.json"):
        model_default_proposer(folder)
    (folder / "vlmq.json").unlink()
    assert Engine.from_model_dir(folder, num_blocks=64, speculative="model").proposer is None
