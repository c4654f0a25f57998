"""A seed names one answer: the same seeded request gives the same tokens alone, batched with others, and with the
model's head proposer speculating or not (spec_decode.verify_seeded); another seed gives another answer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny.shapes import make_split

from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.spec_decode import SpecConfig

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def images() -> list:
    torch.set_num_threads(1)
    return [e.image for e in make_split(9, 6)]


def caption(image, seed: int | None, temperature: float = 1.0) -> Request:
    return Request(image, "Describe the image.", max_new_tokens=24, ignore_eos=True, temperature=temperature,
                   seed=seed)


def answers(engine: Engine, images: list, seed: int, temperature: float = 1.0) -> tuple[list[int], list[int]]:
    """The seeded request alone, then in the middle of five others (unseeded and seeded)."""
    alone = engine.generate([caption(images[0], seed, temperature)])[0].token_ids
    others = [caption(im, None if i % 2 else 100 + i, temperature) for i, im in enumerate(images[1:])]
    batched = engine.generate([*others[:2], caption(images[0], seed, temperature), *others[2:]])[2].token_ids
    return alone, batched


def test_a_seed_gives_one_answer_alone_batched_and_speculated(images):
    plain = Engine.from_model_dir(TARGET, num_blocks=256)
    # the head always proposing max_k tokens: every step speculates, batch or not
    head = Engine.from_model_dir(TARGET, num_blocks=256, speculative=SpecConfig("head", adaptive=False))
    want, batched = answers(plain, images, seed=5)
    assert batched == want and len(want) == 24
    assert answers(head, images, seed=5) == (want, want)
    st = head.stats.speculative
    assert st.num_proposed > 0 and 0 < st.num_accepted < st.num_proposed  # proposals were made, some rejected
    assert plain.generate([caption(images[0], seed=6)])[0].token_ids != want
    # temperature 0 is greedy whatever the seed, with or without speculation
    greedy = plain.generate([caption(images[0], None, 0.0)])[0].token_ids
    assert answers(plain, images, seed=5, temperature=0.0) == (greedy, greedy)
    assert answers(head, images, seed=5, temperature=0.0) == (greedy, greedy)


def test_the_hf_backend_draws_the_engines_seeded_answer(images):
    """`--backend hf` samples through the same (seed, position) streams: its seeded answer, alone or batched, is
    the engine's; temperature 0 stays greedy beside sampled rows."""
    from vlmq.workers.backends.base import GenRequest
    from vlmq.workers.backends.hf import HFBackend

    def gen(image, temperature: float, seed: int | None) -> GenRequest:
        return GenRequest("j", image, "Describe the image.", 24, ignore_eos=True, temperature=temperature, seed=seed)

    want = Engine.from_model_dir(TARGET, num_blocks=256).generate([caption(images[0], seed=5)])[0].token_ids
    hf = HFBackend(str(TARGET))
    assert hf.generate([gen(images[0], 1.0, 5)])[0].token_ids == want
    greedy = hf.generate([gen(images[0], 0.0, None)])[0].token_ids
    batch = hf.generate([gen(images[1], 1.0, None), gen(images[0], 1.0, 5), gen(images[0], 0.0, 5)])
    assert (batch[1].token_ids, batch[2].token_ids) == (want, greedy) and greedy != want
