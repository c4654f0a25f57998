"""The training losses: the answer loss and the training-only dense losses of the heads in aux_heads.

The heads are attached as `model.aux` during training and dropped before saving (the checkpoint stays a plain
Qwen2-VL). Each dense loss's comment says what it asks of the model and why.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from tiny import data, shapes
from tiny.targets import (
    ASK_CLASSES,
    AUX_CLASSES,
    NUM_CELLS,
    PAIR_CLASSES,
    pair_targets,
    phrase_targets,
    question_target,
)

PARTS: dict[str, list[float]] = {}  # loss terms since the last log line (run_training prints their means)


def note(name: str, value: torch.Tensor) -> torch.Tensor:
    PARTS.setdefault(name, []).append(float(value.detach()))
    return value


def target_loss(model, batch, pad_id, aux_weight: float = 0.0, builder: data.RowBuilder | None = None,
                register_ids: torch.Tensor | None = None, per_row: float = 0.0,
                separator_ids: torch.Tensor | None = None):
    """Answer loss (+ the training-only dense losses); with `builder`, each image's rows are packed into one
    sequence (data.pack_groups: the same loss, the image tokens through the LM once), else one row each.
    `register_ids`: the register tokens that follow each image, in template order (their target: model.aux's
    "registers" head names a cell's content, its "pairs" head a colour and shape's count and cell).
    `per_row`: the weight of the per-answer mean in the answer loss (answer_loss). `separator_ids`: the tokens
    that join a caption's phrases ("," and " and"; model.aux's "phrase" head, phrase_targets)."""
    grids, feats = image_features(model, batch)
    image_id = model.config.image_token_id
    if builder is not None:
        input_ids, labels, positions, visible = data.pack_groups(batch, builder, pad_id, rope_index(model, image_id))
        inputs = dict(position_ids=positions, attention_mask={"full_attention": visible}, image_grid_thw=grids,
                      mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=tuple(feats))})
        firsts = list(range(len(batch)))
    else:
        rows, row_feats, row_grids, firsts = [], [], [], []
        for g, f in zip(batch, feats, strict=True):
            firsts.append(len(rows))
            for r in g.rows:
                rows.append(r)
                row_feats.append(f)
                row_grids.append(g.grid_thw)
        input_ids, labels, mask = data.pad_rows(rows, pad_id)
        inputs = dict(attention_mask=mask, image_grid_thw=torch.stack(row_grids),
                      mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=tuple(row_feats))})
    mm_types = (input_ids == image_id).long()
    aux = aux_weight and hasattr(model, "aux")
    middle_heads = aux and {"where", "summary", "registers", "pairs", "ask", "phrase"} & set(model.aux)
    out = model.model(input_ids=input_ids, mm_token_type_ids=mm_types, output_hidden_states=bool(middle_heads),
                      **inputs)
    hidden = out.last_hidden_state
    loss = answer_loss(model.lm_head, hidden, labels, per_row)
    note("answer", loss)
    if aux:
        dense = _aux_loss(model.aux, feats, hidden, labels, batch, firsts)
        if middle_heads:
            middle = out.hidden_states[(len(out.hidden_states) - 1) // 2]  # after half of the LM's layers
        if "where" in model.aux:
            dense = dense + note("where", _where_loss(model.aux["where"], middle[firsts], mm_types[firsts].bool(),
                                                       batch))
        if "summary" in model.aux:
            dense = dense + note("summary", _summary_loss(model.aux["summary"], middle[firsts],
                                                           input_ids[firsts] == model.config.vision_end_token_id,
                                                           batch))
        if {"registers", "pairs"} & set(model.aux):  # cell registers first (up to nine), then the pair registers
            states = _register_states(middle[firsts], input_ids[firsts], register_ids)
            if "registers" in model.aux:
                dense = dense + note("registers", _register_loss(model.aux["registers"], states[:, :NUM_CELLS],
                                                                  batch))
                states = states[:, NUM_CELLS:]
            if "pairs" in model.aux:
                dense = dense + note("pairs", _pair_loss(model.aux["pairs"], states, batch))
        if "ask" in model.aux:
            dense = dense + note("ask", _ask_loss(model.aux["ask"], middle, labels, batch))
        if "phrase" in model.aux:
            dense = dense + note("phrase", _phrase_loss(model.aux["phrase"], middle, labels, batch, separator_ids))
        loss = loss + aux_weight * dense
    return loss


def vision_loss(model, batch):
    """First phase: the colour and shape under each image token, from the vision tower alone (no LM)."""
    return _token_loss(model.aux, image_features(model, batch)[1], batch)


def draft_loss(model, batch, builder, pad_id):
    rows = [builder.text_only_row(q, a) for g in batch for q, a in g.qa]
    input_ids, labels, mask = data.pad_rows(rows, pad_id)
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    return answer_loss(model.lm_head, hidden, labels)


def aux_heads(hidden: int, where: bool = False, summary: bool = False, registers: str = "",
              ask: bool = False, phrase: bool = False) -> torch.nn.ModuleDict:
    """Training-only heads (removed before saving): what each image token shows, what each cell holds (at the last
    prompt token and, summary=True, at <|vision_end|> halfway up), and (where=True) which cell each image token lies
    in, read from the LM halfway up; halfway up, registers="cell": what the cell of each register token holds,
    registers="pair": each register's colour and shape count and cell (pair_targets), registers="both": nine cell
    registers, then the pair registers; ask=True: what each row's question names, at its last prompt token
    (question_target); phrase=True: the shape each caption token's phrase describes (phrase_targets)."""
    per = sum(AUX_CLASSES)
    heads = {"token": torch.nn.Linear(hidden, per), "cell": torch.nn.Linear(hidden, 9 * per)}
    if summary:
        heads["summary"] = torch.nn.Linear(hidden, 9 * per)
    if where:
        heads["where"] = torch.nn.Linear(hidden, 9)
    if registers not in ("", "cell", "pair", "both"):
        raise ValueError(f"registers must be '', 'cell', 'pair' or 'both', got {registers!r}")
    if registers in ("cell", "both"):
        heads["registers"] = torch.nn.Linear(hidden, per)
    if registers in ("pair", "both"):
        heads["pairs"] = torch.nn.Linear(hidden, sum(PAIR_CLASSES))
    if ask:
        heads["ask"] = torch.nn.Linear(hidden, sum(ASK_CLASSES))
    if phrase:
        heads["phrase"] = torch.nn.Linear(hidden, sum(ASK_CLASSES))
    return torch.nn.ModuleDict(heads)


def answer_loss(head, hidden, labels, per_row: float = 0.0):
    """hidden: [B, S, D]; position t predicts labels[t + 1]; only answer positions are scored. The mean over answer
    tokens, mixed with weight `per_row` with the mean over answers (each answer's tokens averaged first, so a
    one-word answer weighs as much as a caption of thirty tokens: the evaluation counts answers, not tokens)."""
    shifted = labels[:, 1:]
    keep = shifted != data.IGNORE
    losses = torch.nn.functional.cross_entropy(head(hidden[:, :-1][keep]), shifted[keep], reduction="none")
    if not per_row:
        return losses.mean()
    answer = _answer_index(keep)
    sizes = torch.bincount(answer)
    return (1 - per_row) * losses.mean() + per_row * (losses / sizes[answer]).sum() / len(sizes)


def answer_starts(keep: torch.Tensor) -> torch.Tensor:
    # the first scored position of each answer (a run of scored positions within a row: packed rows are separated
    # by the next row's unscored question; rows end in padding or at the row's end); it is the row's last prompt
    # token, the one that predicts the answer's first token
    starts = keep.clone()
    starts[:, 1:] &= ~keep[:, :-1]
    return starts


def _answer_index(keep: torch.Tensor) -> torch.Tensor:
    # which answer each scored position belongs to (a row's first scored position always starts one)
    return answer_starts(keep).reshape(-1).cumsum(0).view_as(keep)[keep] - 1


def image_features(model, batch):
    """(grid_thw [G, 3], the vision tower's output per image) for a batch of groups."""
    grids = torch.stack([g.grid_thw for g in batch])
    pixel_values = torch.cat([g.pixel_values for g in batch])
    return grids, model.model.get_image_features(pixel_values, grids, return_dict=True).pooler_output


def rope_index(model, image_id):
    def positions(ids: list[int], grid: torch.Tensor) -> torch.Tensor:
        row = torch.tensor([ids])
        return model.model.get_rope_index(row, (row == image_id).long(), grid[None])[0][:, 0]
    return positions


def split_ce(logits, targets, classes=AUX_CLASSES):
    # one cross-entropy per target column: logits [..., sum(classes)], targets [..., len(classes)]
    ce = torch.nn.functional.cross_entropy
    return sum(ce(part.reshape(-1, n), targets[..., i].reshape(-1))
               for i, (part, n) in enumerate(zip(logits.split(classes, dim=-1), classes, strict=True)))


def _aux_loss(aux, feats, hidden, labels, batch, firsts):
    # dense targets for the vision tower (per image token) and for the LM's reading of the layout (per cell,
    # from the hidden state that predicts the first answer token of each image's first row)
    token_loss = _token_loss(aux, feats, batch)
    last_prompt = (labels[firsts] != data.IGNORE).int().argmax(1) - 1
    state = hidden[torch.tensor(firsts), last_prompt]
    return token_loss + note("cell", _cell_loss(aux["cell"], state, batch))


def _token_loss(aux, feats, batch):
    # the colour and shape under each image token, from the vision tower's output
    return note("token", split_ce(aux["token"](torch.cat(feats)), torch.cat([g.token_labels for g in batch])))


def _cell_loss(head, states, batch):
    # the colour and shape in each of an image's nine cells, from one LM state per image [G, D]
    return split_ce(head(states).view(len(batch), 9, -1), torch.stack([g.cell_labels for g in batch]))


def _summary_loss(head, hidden, is_vision_end, batch):
    # what each 3x3 cell holds, from the LM's state at <|vision_end|> halfway up: the first token that has seen the
    # whole image. Image tokens cannot know their cell (the causal LM shows them only the rows above) and values
    # carry no positions, so "where is the red circle?" needs the layout written down at a token every later one
    # can read; this target asks for it there.
    return _cell_loss(head, hidden[torch.arange(len(batch)), is_vision_end.int().argmax(1)], batch)


def _where_loss(head, hidden, is_image, batch):
    # which 3x3 cell each image token lies in, from the LM's own states halfway up (the rows of one image share
    # their image tokens' states, so only each image's first row is scored)
    cells = [data.token_cells(int(g.grid_thw[1]) // 2, int(g.grid_thw[2]) // 2) for g in batch]
    return torch.nn.functional.cross_entropy(head(hidden[is_image]), torch.cat(cells))


def _register_states(hidden, input_ids, register_ids):
    # [G, R, D]: each image's register tokens' states (found by token, so packed and separate rows alike)
    at = (input_ids[:, :, None] == register_ids).int().argmax(1)  # [G, R]: each register's position in its row
    return hidden[torch.arange(len(hidden))[:, None], at]


def _register_loss(head, states, batch):
    # register i (a token after the image) names what cell i holds, halfway up: nine places a question can look a
    # cell up by attention, where one summary state had to hold the whole layout
    return split_ce(head(states), torch.stack([g.cell_labels[: states.shape[1]] for g in batch]))


def _pair_loss(head, states, batch):
    # register k names, halfway up, how many shapes of colour k // 3 and kind k % 3 the image holds and the cell of
    # a single one: "is there a red circle?", "where is the red circle?" and "what colour is the square?" then look
    # at fixed tokens, where reading them from image tokens by content needs an attention that can find nothing
    return split_ce(head(states), pair_targets(torch.stack([g.cell_labels for g in batch])), PAIR_CLASSES)


def _ask_loss(head, hidden, labels, batch):
    # halfway up, the last prompt token of each row (the one that predicts the answer's first token) names what its
    # question asks about: the first of the two steps "read the question, then look it up" gets its own target
    last = answer_starts(labels[:, 1:] != data.IGNORE)  # one per row (packed rows too), in row order
    targets = torch.tensor([question_target(q) for g in batch for q, _ in g.qa])
    return split_ce(head(hidden[:, :-1][last]), targets, ASK_CLASSES)


def _phrase_loss(head, hidden, labels, batch, separator_ids):
    # halfway up, every position of a caption (the one predicting each next token) names the shape its phrase
    # describes: a caption is many lookups in a row ("which cell is next, what is in it"), and losing track of the
    # current one swapped colours and shapes between neighbouring phrases or repeated a shape
    shifted = labels[:, 1:]
    keep = shifted != data.IGNORE
    answer, tokens = _answer_index(keep), shifted[keep]
    rows = [(g, q) for g in batch for q, _ in g.qa]
    captions = [i for i, (_, q) in enumerate(rows) if q == shapes.CAPTION_PROMPT]
    if not captions:
        return hidden.new_zeros(())
    targets = torch.cat([phrase_targets(tokens[answer == i], rows[i][0].cell_labels, separator_ids)
                         for i in captions])
    pick = torch.isin(answer, torch.tensor(captions))
    return split_ce(head(hidden[:, :-1][keep][pick]), targets, ASK_CLASSES)
