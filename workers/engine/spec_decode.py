"""Speculative decoding: verifying proposed tokens (lossless) and choosing how many to propose.

A decode step of a sequence whose last token is x0 and whose proposer guessed x1..xk runs the target on the chunk
[x0, x1, ..., xk] (causal, over its paged KV) and gets target distributions p0..pk, where p_i is the target's
distribution of the token after x_i. Then (Leviathan et al. 2023; Chen et al. 2023):

    for i in 1..k:  accept x_i with probability min(1, p_{i-1}(x_i) / q_{i-1}(x_i))     (q: the proposer's law)
                    on rejection emit one token from  norm(max(p_{i-1} - q_{i-1}, 0))  and stop
    all accepted:   emit a bonus token from p_k

Every emitted token is then distributed exactly as the target's own sampling (P(accept x) + P(reject, then x) =
min(p, q)(x) + max(p - q, 0)(x) = p(x)). A deterministic proposer (n-gram, a greedy draft) has q = one-hot at its
guess, so it is accepted with probability p(x) and the residual is p with x removed. Greedy requests accept while
the target's argmax equals the guess: the output is token for token the one without speculation.

Seeded sampled requests (verify_seeded) are verified by matching instead, so that a seed names one answer. Their
token at completion index i is drawn from the target's p_i with randomness keyed by (seed, i) alone, exactly as
without speculation, and a proposal is kept only if it equals that draw. Rejection sampling above consumes a
shared random stream in amounts that depend on k, which adaptive k sets from the batch: measured on tiny-shapes
(temperature 1.0, 24 tokens, seed 5), the head proposer changed the answer from the 7th token on against the run
without speculation, and one request alone against the same request batched with six others. Matching stays
lossless (the emitted token is the plain sample) but keeps a sampled proposal x with probability p(x) rather than
min(1, p(x) / q(x)).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .sequence import SeqId


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)): the chance to keep a proposal drawn from q where the target says p."""
    return torch.clamp(p_x / q_x, max=1.0)


def verify(logits: torch.Tensor, proposal: list[int], draft_probs: torch.Tensor | None, temperature: float,
           generator: torch.Generator | None = None) -> list[int]:
    """Tokens to emit: the accepted proposals, then one corrected or bonus token (1 to k + 1 tokens).

    logits: [k + 1, vocab] float32, the target's logits after x0 .. xk; proposal: the k proposed ids;
    draft_probs: [k, vocab] the laws the proposals were drawn from, or None for deterministic proposals.
    """
    k = len(proposal)
    if temperature == 0:
        return verify_greedy(logits.argmax(-1).tolist(), proposal)
    p = torch.softmax(logits / temperature, dim=-1)  # [k + 1, vocab]
    if k:
        x = torch.tensor(proposal, device=p.device)
        p_x = p[:-1].gather(1, x[:, None])[:, 0]  # [k]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(1, x[:, None])[:, 0]
        u = torch.rand(k, generator=generator, device=p.device)
        rejected = (u >= accept_probability(p_x, q_x)).tolist()
        n = rejected.index(True) if True in rejected else k
        if n < k:
            return proposal[:n] + [_draw(_residual(p[n], draft_probs, n, proposal[n]), generator)]
    return proposal + [_draw(p[k], generator)]


def verify_greedy(target: list[int], proposal: list[int]) -> list[int]:
    """A greedy request's tokens from the target's argmaxes after x0 .. xk ([k + 1]): the proposals up to the first
    that differs from the target's pick, then the target's pick there (or after the last)."""
    n = 0
    while n < len(proposal) and proposal[n] == target[n]:
        n += 1
    return target[:n + 1]


def verify_seeded(logits: torch.Tensor, proposal: list[int], temperature: float, seed: int,
                  index: int) -> list[int]:
    """A seeded sampled request's tokens: the draws at completion indices index .. index + k, each from the target's
    law with its own (seed, index) stream, up to and including the first that differs from its proposal.

    logits: [k + 1, vocab] float32 as in verify. Same seed, same logits: same tokens, whatever k, the batch or the
    proposer (see the module docstring).
    """
    p = torch.softmax(logits / temperature, dim=-1)  # [k + 1, vocab]
    out: list[int] = []
    for i in range(len(proposal) + 1):
        out.append(_draw(p[i], position_generator(seed, index + i, p.device)))
        if i == len(proposal) or out[-1] != proposal[i]:
            break
    return out


def position_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The random stream of one completion index of a seeded request (a hash of seed and index seeds it)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def _residual(p: torch.Tensor, draft_probs: torch.Tensor | None, i: int, x: int) -> torch.Tensor:
    # norm(max(p - q, 0)); q one-hot at x when the proposal was deterministic
    if draft_probs is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = torch.clamp(p - draft_probs[i], min=0.0)
    return r if float(r.sum()) > 0 else p  # r = 0 only where p == q, where nothing is ever rejected


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(slots=True)
class SpecStats:
    proposer: str = "none"  # ngram, draft, head
    num_proposed: int = 0  # proposals verified
    num_accepted: int = 0  # of those, accepted
    num_decode_forwards: int = 0  # decode steps of sequences (one target forward row group each)
    num_decode_tokens: int = 0  # tokens those steps emitted (accepted + one each)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.num_decode_tokens / self.num_decode_forwards if self.num_decode_forwards else 0.0


@dataclass(slots=True)
class AdaptiveK:
    """How many tokens to propose for one sequence, from its running acceptance and measured costs.

    With per-token acceptance a, k proposals emit (1 - a^(k+1)) / (1 - a) tokens per target forward. With n
    decodes in a step that costs α + β × tokens (the target, fitted on decode-only steps) and a proposer that takes
    p per proposal, a sequence's share of the step grows from α / n + β by k × (p + β): k maximises tokens over
    cost. All times are the engine thread's CPU time (observe_cost). When k is 0 the sequence probes with one
    proposal every `probe_every` steps (8x as rarely while the acceptance of all sequences would not pay either).
    Off altogether above `max_batch` decodes (measured by scripts/bench_speculative.py: where verifying extra tokens
    stops paying).
    """

    max_k: int = 6
    max_batch: int = 4
    decay: float = 0.7  # weight of the past in the running acceptance
    probe_every: int = 8
    prior: float = 0.6  # acceptance assumed for a new sequence: the running acceptance of all sequences
    adaptive: bool = True  # False: always max_k (tests, benchmarks)
    proposal_s: float = 2e-4  # p: proposer seconds per proposal (a start, then measured)
    step_s: float = 1e-3  # α: target seconds per decode step, whatever its size (a start, then fitted)
    token_s: float = 1e-4  # β: target seconds per token of a decode step (a start, then fitted)
    rate: dict[SeqId, float] = field(default_factory=dict)
    idle: dict[SeqId, int] = field(default_factory=dict)
    moments: list[float] = field(default_factory=lambda: [0.0] * 5)  # EMA of 1, T, t, T², T·t

    def k_for(self, seq_id: SeqId, num_decodes: int, remaining: int) -> int:
        """remaining: tokens the sequence may still emit; proposals never go past its last one."""
        if num_decodes > self.max_batch or self.max_k == 0:
            return 0
        if not self.adaptive:
            return max(0, min(self.max_k, remaining - 1))
        c = (self.proposal_s + self.token_s) / (self.step_s / max(num_decodes, 1) + self.token_s)
        k = self._best_k(self.rate.get(seq_id, self.prior), c)
        if k == 0:
            idle = self.idle[seq_id] = self.idle.get(seq_id, 0) + 1
            # probes cost a proposal each: 8x rarer while even the acceptance of all sequences would not pay
            if idle % self.probe_every == 0:
                k = int(idle % (8 * self.probe_every) == 0 or self._best_k(self.prior, c) > 0)
        return max(0, min(k, remaining - 1))

    def _best_k(self, a: float, c: float) -> int:
        # k proposals at per-token acceptance a, each costing c target tokens' share: the most tokens per cost
        a = min(a, 0.99)
        return max(range(self.max_k + 1), key=lambda j: (1 - a ** (j + 1)) / (1 - a) / (1 + c * j))

    def observe_cost(self, propose_s: float, num_proposals: int, target_s: float, num_tokens: int,
                     decode_only: bool) -> None:
        """One step: the proposer's time for `num_proposals` proposals, and the target's for `num_tokens` tokens
        (fitted only when the step was all decodes: prefill chunks and images cost otherwise)."""
        if num_proposals:
            self.proposal_s = 0.9 * self.proposal_s + 0.1 * propose_s / num_proposals  # a property of the proposer
        if decode_only and target_s > 0:
            m = self.moments
            for i, x in enumerate((1.0, num_tokens, target_s, num_tokens ** 2, num_tokens * target_s)):
                m[i] = 0.95 * m[i] + 0.05 * x
            mean_t, mean_s = m[1] / m[0], m[2] / m[0]
            var = m[3] / m[0] - mean_t ** 2
            if var > 1e-9:  # steps of different sizes seen: a slope
                self.token_s = max(0.0, (m[4] / m[0] - mean_t * mean_s) / var)
            self.step_s = max(1e-6, mean_s - self.token_s * mean_t)

    def observe(self, seq_id: SeqId, num_proposed: int, num_accepted: int) -> None:
        if num_proposed:
            # per-token acceptance seen: accepted over trials (the accepted ones, plus the rejection if any)
            seen = num_accepted / (num_accepted + (num_accepted < num_proposed))
            self.rate[seq_id] = self.decay * self.rate.get(seq_id, self.prior) + (1 - self.decay) * seen
            self.prior = 0.95 * self.prior + 0.05 * seen

    def forget(self, seq_id: SeqId) -> None:
        self.rate.pop(seq_id, None)
        self.idle.pop(seq_id, None)


# Default max_batch per proposer, measured by scripts/bench_speculative.py on tiny-shapes (CPU; its `forced` rows lift
# the threshold): at batch 8 the head gained 1.26-1.40x, n-gram and the draft model about nothing (0.93-1.02x over
# runs; adaptive k alone proposes little for them); at batch 32 the gains are gone (0.93-1.10x over runs, noise).
MAX_BATCH = {"ngram": 4, "draft": 4, "head": 8}


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding settings: the proposer and the adaptive-k limits (see AdaptiveK)."""

    method: str  # "ngram", "draft:<path to a text-only causal LM>" or "head" (the model folder's spec-head)
    max_k: int = 6  # with the head at batch 1 on tiny-shapes, 6 beat 4 by about 10% (more when accepted runs are long)
    # more decodes than this in a step: no proposals; None: the proposer's MAX_BATCH. Raise it for a large model on
    # a GPU, where a decode step stays memory-bound longer.
    max_batch: int | None = None
    adaptive: bool = True  # False: always max_k proposals (below max_batch)

    def __post_init__(self) -> None:
        kind = self.method.partition(":")[0]
        if kind not in MAX_BATCH or (kind == "draft") != (":" in self.method):
            raise ValueError(f"speculative must be 'ngram', 'draft:<path>' or 'head', got {self.method!r}")
        if self.max_batch is None:
            self.max_batch = MAX_BATCH[kind]
        if self.max_k < 1 or self.max_batch < 0:
            raise ValueError(f"invalid speculative settings {self!r}")
