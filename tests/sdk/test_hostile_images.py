"""The hostile-image corpus at submit: every file is refused with its code, or served, within a time bound."""
from __future__ import annotations

import functools
import io
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hostile_images import CASES, Case
from PIL import Image, ImageFile

from vlmq.errors import InvalidRequest
from vlmq.images import SUPPORTED_FORMATS, decode, probe

# Generous for a loaded host: a normal probe reads headers only, and the issue's chunk-flood PNG took seconds.
PROBE_BOUND_S = 1.0
DECODE_BOUND_S = 10.0


def _outcome(call: Callable[[], object]) -> tuple[str | None, float, Any]:
    start = time.perf_counter()
    try:
        result = call()
    except InvalidRequest as e:
        return e.code, time.perf_counter() - start, None
    return None, time.perf_counter() - start, result


def test_the_corpus_covers_every_kind_of_attack() -> None:
    assert len(CASES) >= 25
    assert len({case.name for case in CASES}) == len(CASES)
    codes = Counter(case.code for case in CASES)
    assert {"truncated_image", "too_many_chunks", "too_many_frames", "too_many_pixels", None} <= set(codes)
    for fmt in SUPPORTED_FORMATS:  # a decompression bomb and a truncated file in every supported format
        kinds = {case.code for case in CASES if case.name.startswith(fmt.lower())}
        assert {"too_many_pixels", "truncated_image"} <= kinds, fmt


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_probe_refuses_or_accepts_each_file_in_time(case: Case) -> None:
    data = case.data()
    code, seconds, info = _outcome(lambda: probe(data))
    assert code == case.code, f"{case.name}: probe gave {code}"
    assert seconds < PROBE_BOUND_S, f"{case.name}: probe took {seconds:.2f} s"
    if case.code is None:
        assert info.n_frames == 1 and info.width * info.height > 0


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_decode_gives_the_same_refusal_or_the_probed_image(case: Case) -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    data = case.data()
    code, seconds, image = _outcome(lambda: decode(data))
    assert code == case.code, f"{case.name}: decode gave {code}"
    assert seconds < DECODE_BOUND_S, f"{case.name}: decode took {seconds:.2f} s"
    if case.code is None:
        info = probe(data)
        assert (image.mode, image.size) == ("RGB", (info.width, info.height))


def test_the_issues_jpeg_is_refused_not_grey_filled() -> None:
    data = next(case for case in CASES if case.name == "jpeg 630 bytes declaring 6000x6600").data()
    assert len(data) < 700
    with pytest.raises(InvalidRequest, match=r"truncated \(\d+ bytes of compressed data cannot hold 6000x6600") as err:
        probe(data)
    assert err.value.code == "truncated_image"


def test_the_exif_loop_is_read_once() -> None:
    data = next(case for case in CASES if case.name == "jpeg EXIF IFD loop").data()
    info = probe(data)
    assert (info.orientation, info.width, info.height) == (6, 20, 40)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_byte_flips_in_valid_files_are_refused_with_a_code_or_served(fmt: str) -> None:
    source = Image.effect_noise((40, 30), 60).convert("RGB")
    buffer = io.BytesIO()
    source.save(buffer, fmt)
    valid, rng = buffer.getvalue(), random.Random(fmt)
    for _ in range(150):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        for call in (probe, decode):  # InvalidRequest or an answer; anything else fails the test
            code, seconds, result = _outcome(functools.partial(call, bytes(data)))
            assert seconds < PROBE_BOUND_S, (fmt, call.__name__, seconds)
            assert code is not None or result.width * result.height > 0
