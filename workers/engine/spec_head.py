"""The vision-aware proposer head (EAGLE-style): one transformer layer over the target's own last hidden states.

The target's hidden state at position j (after its final norm) already carries what the target read from the
image. The head reads, at each position j, the pair (h_j, x_{j+1}) (hidden state, next token):

    f_{j+1} = norm(layer(fc([h_j ; embed(x_{j+1})])))      # a guess of the target's next hidden state
    x_{j+2} ~ lm_head(f_{j+1})                             # the target's own embedding and LM head

and proposes k tokens by feeding its own guesses back: (f_{j+1}, x_{j+2}) -> f_{j+2} -> x_{j+3} ... Its attention
runs over its own cache of the positions from the last prompt token on (that hidden state already sums up the
image and the question; reading the image tokens again costs a long first step and, per ViSpec, a shallow head
averages them away), with its own position index (0 at its first position, as in training) as rotary position:
rotary attention depends only on distances, and the target's hidden states carry the M-RoPE layout. A prompt
served whole from the prefix cache has no hidden state here: the head starts after it.
Trained by scripts/train_spec_head.py; shipped as `<model>/spec-head`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from vlmq.workers.layers.norm import RMSNorm
from vlmq.workers.layers.rotary import MRotaryEmbedding, apply_rotary
from vlmq.workers.models.qwen2_vl import DecoderLayer, Qwen2VLModel

from .proposers import Proposal, Proposer
from .sequence import SeqId, Sequence

KV = tuple[torch.Tensor, torch.Tensor]

CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
               "rope_theta", "hidden_act")


class SpecHead(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        tc = SimpleNamespace(**cfg)
        self.config = cfg
        self.fc = nn.Linear(2 * tc.hidden_size, tc.hidden_size)
        self.layer = DecoderLayer(tc)
        self.norm = RMSNorm(tc.hidden_size, tc.rms_norm_eps)
        head_dim = tc.hidden_size // tc.num_attention_heads
        self.rotary = MRotaryEmbedding(head_dim, tc.rope_theta, [head_dim // 2, 0, 0])

    @classmethod
    def config_for(cls, target_text_config, intermediate_size: int | None = None) -> dict:
        tc = target_text_config
        return dict(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                    num_key_value_heads=tc.num_key_value_heads, rms_norm_eps=tc.rms_norm_eps,
                    intermediate_size=intermediate_size or tc.intermediate_size, rope_theta=10000.0,
                    hidden_act=tc.hidden_act)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """features, embeds: [B, n, H] (h_j and embed(x_{j+1}) of positions 0 .. n - 1) -> guesses of h_{j+1}
        [B, n, H], causal. Training and reference; serving runs HeadRunner (the same math on prepared weights)."""
        x = self.fc(torch.cat([features, embeds], dim=-1))
        b, n, hidden = x.shape
        attn, layer = self.layer.self_attn, self.layer
        cos, sin = self._rope(n, x)
        cos, sin = cos[:n].repeat(b, 1), sin[:n].repeat(b, 1)  # [B * n, D]
        qkv_w, qkv_b, gate_up_w = self._fused()
        h = _rms_norm(x, layer.input_layernorm).view(b * n, -1)
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        qkv = F.linear(h, qkv_w, qkv_b).view(b * n, heads + 2 * kv_heads, -1)  # q, k and v heads in one call
        qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        groups, d = heads // kv_heads, q.shape[-1]
        # grouped-query attention as one batch per KV head: query rows (group, position) share its keys
        q = q.reshape(b, n, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
        k, v = (t.view(b, -1, kv_heads, d).transpose(1, 2) for t in (k, v))  # [B, Hkv, n, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(0, n, groups, x.device))  # [B, Hkv, G * n, D]
        x = x + attn.o_proj(o.view(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, -1))
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), gate_up_w).chunk(2, dim=-1)
        x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return _rms_norm(x, self.norm)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # q/k/v and gate/up weights side by side: fewer tensor calls per token (cached when not training)
        fused = getattr(self, "_fused_weights", None)
        if fused is None or self.training:
            a, m = self.layer.self_attn, self.layer.mlp
            fused = (torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                     torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                     torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            if not self.training:
                self._fused_weights = fused
        return fused

    def _rope(self, num_positions: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos, sin of positions 0 .. at least num_positions - 1, computed once per doubling
        table = getattr(self, "_rope_table", None)
        if table is None or len(table[0]) < num_positions or table[0].dtype != x.dtype:
            positions = torch.arange(max(512, 2 * num_positions), device=x.device)
            table = self._rope_table = self.rotary(positions, x.dtype)
        return table


def _causal(past: int, n: int, groups: int, device: torch.device) -> torch.Tensor | None:
    # query rows (group, position) see every past position and the new ones up to their own
    if n == 1:
        return None
    mask = torch.arange(past + n, device=device)[None] <= past + torch.arange(n, device=device)[:, None]
    return mask.repeat(groups, 1)


class HeadCache:
    """Keys and values of one sequence's head positions, [Hkv, capacity, D] buffers that grow by doubling."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        # k, v: [Hkv, n, D] -> views of every position's keys and values [Hkv, length + n, D]
        end = self.length + k.shape[1]
        if self.k is None or end > self.k.shape[1]:
            cap = max(64, 2 * end)
            grown = [k.new_empty(k.shape[0], cap, k.shape[2]) for _ in range(2)]
            if self.k is not None:
                grown[0][:, :self.length], grown[1][:, :self.length] = self.k[:, :self.length], self.v[:, :self.length]
            self.k, self.v = grown
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class HeadRunner:
    """SpecHead.forward for serving, one sequence over its HeadCache, on weights prepared once: fc's token half
    and bias as a table per token id (no embedding lookup or concatenation), the RMSNorm weights and the attention
    scale folded into the next matmul, rotary as one [D, D] rotation per position (one batched matmul for q and
    k), and plain tensor calls. With a one-layer head the per-call overhead is most of a proposal's time."""

    def __init__(self, head: SpecHead, embed: torch.Tensor, lm_head: nn.Linear) -> None:
        layer, attn, hidden = head.layer, head.layer.self_attn, head.fc.out_features
        fc_w = head.fc.weight  # [H, 2H]: the feature half, then the token half
        self.feat_w = fc_w[:, :hidden].T.contiguous()
        self.token_rows = F.linear(embed, fc_w[:, hidden:], head.fc.bias)  # [vocab, H]
        qkv_w, qkv_b, gate_up_w = head._fused()
        # norm(x) * w == x / |x| * (w * sqrt(H)) (RMSNorm's eps, 1e-6 against |x|² / H, left out)
        scale = [n.weight * hidden ** 0.5 for n in (layer.input_layernorm, layer.post_attention_layernorm, head.norm)]
        q_rows = attn.num_heads * attn.head_dim
        q_scale = torch.ones(len(qkv_b), dtype=qkv_b.dtype, device=qkv_b.device)
        q_scale[:q_rows] = attn.head_dim ** -0.5
        self.qkv_w = (qkv_w * scale[0][None] * q_scale[:, None]).T.contiguous()
        self.qkv_b = qkv_b * q_scale
        self.gate_up_w = (gate_up_w * scale[1][None]).T.contiguous()
        self.o_w, self.down_w = attn.o_proj.weight.T.contiguous(), layer.mlp.down_proj.weight.T.contiguous()
        self.act, self.out_scale = layer.mlp.act_fn, scale[2]
        self.lm_w, self.lm_b = lm_head.weight, lm_head.bias
        self.heads, self.kv_heads = attn.num_heads, attn.num_kv_heads
        self.head, self.rot = head, torch.empty(0)

    def __call__(self, features: torch.Tensor, token_ids: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """features [n, H] (h_j of the cache's next n positions), token_ids [n] (x_{j+1}) -> guesses [n, H]."""
        n, start = len(token_ids), cache.length
        x = torch.addmm(self.token_rows[token_ids], features, self.feat_w)
        heads, kv_heads = self.heads, self.kv_heads
        qkv = torch.addmm(self.qkv_b, _unit(x), self.qkv_w).view(n, heads + 2 * kv_heads, -1)
        qk = torch.bmm(qkv[:, :heads + kv_heads], self._rotations(start + n)[start:start + n])  # rotary
        groups, d = heads // kv_heads, qk.shape[-1]
        k, v = cache.append(qk[:, heads:].transpose(0, 1), qkv[:, heads + kv_heads:].transpose(0, 1))
        q = qk[:, :heads].reshape(n, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, d)
        scores = torch.bmm(q, k.transpose(1, 2))  # [Hkv, G * n, P + n], q already scaled
        if n > 1:
            scores.masked_fill_(~_causal(start, n, groups, x.device), float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1), v)
        x = torch.addmm(x, o.view(kv_heads, groups, n, d).permute(2, 0, 1, 3).reshape(n, -1), self.o_w)
        gate, up = torch.mm(_unit(x), self.gate_up_w).chunk(2, dim=-1)
        x = torch.addmm(x, self.act(gate) * up, self.down_w)
        return _unit(x) * self.out_scale

    def logits(self, guess: torch.Tensor) -> torch.Tensor:
        return F.linear(guess, self.lm_w, self.lm_b)

    def _rotations(self, num_positions: int) -> torch.Tensor:
        # [P, D, D]: x @ rot[p] == apply_rotary(x, cos[p], sin[p]) (x * cos + rotate_half(x) * sin)
        if len(self.rot) < num_positions:
            cos, sin = self.head._rope(num_positions, self.feat_w)
            half = cos.shape[1] // 2
            i = torch.arange(half, device=cos.device)
            rot = torch.diag_embed(cos)
            rot[:, i + half, i] = -sin[:, :half]
            rot[:, i, i + half] = sin[:, half:]
            self.rot = rot
        return self.rot


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)  # one fused call (RMSNorm's math)


def load_head(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> SpecHead:
    cfg = json.loads((path / "config.json").read_text())
    head = SpecHead({k: cfg[k] for k in CONFIG_KEYS})
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


@dataclass(slots=True)
class _HeadSeq:
    first: int  # sequence position of the first target hidden state the head has (after any prefix-cache hit)
    # the target's hidden states of positions first .. first + num_features - 1: (step hidden states [T, H], first
    # row, end row) pieces, joined when read
    pieces: list[tuple[torch.Tensor, int, int]]
    num_features: int
    # the head's keys/values of positions first .. first + cache.length - 1, each fed (h_j, x_{j+1}) with the
    # target's own h_j: those stay valid; positions fed with the head's own guesses are dropped after proposing
    cache: HeadCache = field(default_factory=lambda: HeadCache())


class HeadProposer(Proposer):
    """One sequence at a time on a plain per-sequence cache (HeadRunner): a one-layer head costs less in tensor
    calls this way than through the paged path (which pays off for a batch; the head runs on small ones, see
    AdaptiveK)."""

    name = "head"

    def __init__(self, head: SpecHead, target: Qwen2VLModel, device: torch.device | str = "cpu") -> None:
        self.head, self.target, self.device = head, target, torch.device(device)
        self.runner = HeadRunner(head, target.language_model.embed_tokens.weight, target.lm_head)
        self.state: dict[SeqId, _HeadSeq] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(0)

    @classmethod
    def from_dir(cls, path: Path, target: Qwen2VLModel, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> HeadProposer:
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"no proposer head in {path}; train one with scripts/train_spec_head.py, or use "
                             "speculative='ngram' or 'draft:<path>'")
        return cls(load_head(path, device, dtype), target, device)

    def drop(self, seq_id: SeqId) -> None:
        self.state.pop(seq_id, None)

    def reset(self) -> None:
        self.state.clear()

    # -- what the target computed ----------------------------------------------------------------
    def observe(self, out, runner_out, hidden: torch.Tensor | None) -> None:
        # no tensor work here (it runs for every sequence of every step): rows are sliced when a sequence proposes
        row, more = 0, runner_out.more_token_ids
        for s in out.scheduled:
            first_row, row = row, row + s.num_new_tokens
            if s.seq.is_finished:
                continue
            valid = s.num_new_tokens - s.num_spec_tokens + (len(more.get(s.seq_id, ())) if s.sample else 0)
            # the head's context starts at the last prompt token (its hidden state sums up image and question)
            skip = max(0, s.seq.num_prompt_tokens - 1 - s.start)
            if skip < valid:
                self._add_features(s.seq_id, s.start + skip, (hidden, first_row + skip, first_row + valid))

    def _add_features(self, seq_id: SeqId, start: int, piece: tuple[torch.Tensor, int, int]) -> None:
        # piece: rows a .. b - 1 of a step's hidden states, the target's states of positions start .. start + b - a - 1
        st, (hidden, a, b) = self.state.get(seq_id), piece
        if st is None or start > st.first + st.num_features:  # first sight, or a gap after a prefix-cache hit
            self.state[seq_id] = _HeadSeq(start, [piece], b - a)
            return
        have = st.first + st.num_features
        if start + b - a > have:
            st.pieces.append((hidden, a + have - start, b))
            st.num_features = start + b - a - st.first

    # -- proposing ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._propose(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def _propose(self, seq: Sequence, k: int) -> Proposal:
        st = self.state.get(seq.seq_id)
        if st is None or k < 1:
            return Proposal([])
        # position j reads (h_j, x_{j+1}) for every j with a target hidden state; the last one gives proposal 1
        ids = seq.token_ids[st.first + 1:st.first + 1 + st.num_features]
        known = len(ids)
        st.cache.length = min(st.cache.length, known - 1)  # the last known position is always run again
        if len(st.pieces) > 1:
            joined = torch.cat([hidden[a:b] for hidden, a, b in st.pieces])
            st.pieces = [(joined, 0, len(joined))]
        hidden, a, b = st.pieces[0]
        feats = hidden[a + st.cache.length:b]
        tokens = torch.tensor(ids[st.cache.length:], device=self.device)
        temp, eos, guesses, probs = seq.sampling.temperature, seq.sampling.eos_token_ids, [], []
        for _ in range(k):
            if guesses and eos and int(guesses[-1]) in eos:  # nothing after an eos is ever verified
                break
            guess = self.runner(feats, tokens, st.cache)[-1:]  # [1, H]
            logits = self.runner.logits(guess)[0]
            if temp > 0:
                probs.append(torch.softmax(logits.float() / temp, dim=-1))
                tokens = torch.multinomial(probs[-1], 1, generator=self.generator)
            else:
                tokens = logits.argmax(-1, keepdim=True)
            guesses.append(tokens)
            feats = guess  # its own guess stands in for the target's next state
        st.cache.length = known  # positions fed with its own guesses are recomputed next time
        return Proposal(torch.cat(guesses).tolist(), torch.stack(probs) if probs else None)
