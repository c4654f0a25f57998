"""Seeded sampling through a real worker (its default proposer, the head, on): the same seed gives the same
answer, batched together or not; another seed gives another; the result says what was applied."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny.shapes import make_split
from workerproc import ready_worker

from vlmq.client import Client
from vlmq.request import JobRequest
from vlmq.settings import Settings

pytestmark = pytest.mark.timeout(300)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri())
    image = make_split(9, 1)[0].image  # a two-shape caption: at temperature 1.0 seeds part within 24 tokens
    with ready_worker(redis_url, settings, tmp_path / "worker.log"), Client(settings=settings) as client:
        def caption(seed: int | None, temperature: float = 1.0) -> JobRequest:
            return JobRequest(image, "Describe the image.", max_new_tokens=24, ignore_eos=True,
                              temperature=temperature, seed=seed)

        jobs = client.submit_many([caption(5), caption(5), caption(6), caption(None, 0.0)])
        first, again, other, greedy = (job.result(timeout=120) for job in jobs)
        later = client.submit_many([caption(5)])[0].result(timeout=120)  # alone this time
    assert len(first.token_ids) == 24 and first.token_ids == again.token_ids == later.token_ids
    assert other.token_ids != first.token_ids and greedy.token_ids != first.token_ids
    assert first.raw["sampling"] == {"temperature": 1.0, "seed": 5}
    assert greedy.raw["sampling"] == {"temperature": 0.0, "seed": None}
