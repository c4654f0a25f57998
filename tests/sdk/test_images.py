"""Image intake: every supported format is served, every bad input is refused with the right code."""
from __future__ import annotations

import base64
import io
import json
import random
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, ImageOps

import vlmq.images
from vlmq.cost import estimate_image
from vlmq.errors import InvalidRequest
from vlmq.images import (
    SUPPORTED_FORMATS,
    ImageInfo,
    ImageLimits,
    decode,
    is_storage_url,
    load_source,
    pixel_hash,
    probe,
)

Encode = Callable[..., bytes]
LOSSLESS = {"WEBP": {"lossless": True}}


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))


def _code(call: Callable[[], object]) -> str:
    with pytest.raises(InvalidRequest) as info:
        call()
    return info.value.code


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_declaring(width: int, height: int, rows: int = 8) -> bytes:
    """A small PNG whose header declares ``width x height`` RGB pixels (only ``rows`` rows of zeros follow)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * width) * rows, 9)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


# --- every supported format ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_every_supported_format_probes_and_decodes(encode: Encode, fmt: str) -> None:
    source = Image.new("RGB", (37, 23), (10, 200, 30))
    source.paste((250, 250, 0), (0, 0, 10, 10))
    data = encode(source, fmt, **LOSSLESS.get(fmt, {}))
    info = probe(data)
    assert info == ImageInfo(format=fmt, width=37, height=23, orientation=1, mode=info.mode, n_frames=1)
    assert info.mode == ("P" if fmt == "GIF" else "RGB")
    assert json.loads(json.dumps(info.to_dict()))["width"] == 37
    image = decode(data)
    assert (image.mode, image.size) == ("RGB", (37, 23))
    if fmt == "JPEG":
        assert max(abs(a - b) for a, b in zip(image.getpixel((20, 15)), (10, 200, 30), strict=True)) <= 4
    else:
        assert image.tobytes() == source.tobytes()


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_one_pixel_images(encode: Encode, fmt: str) -> None:
    data = encode(Image.new("RGB", (1, 1), (255, 0, 0)), fmt, **LOSSLESS.get(fmt, {}))
    assert (probe(data).width, probe(data).height) == (1, 1)
    assert decode(data).size == (1, 1)


def test_cmyk_jpeg(encode: Encode) -> None:
    data = encode(Image.new("CMYK", (16, 8), (0, 255, 255, 0)), "JPEG", quality=100)
    assert probe(data).mode == "CMYK"
    red, green, blue = decode(data).getpixel((8, 4))  # type: ignore[misc]
    assert red >= 250 and green <= 5 and blue <= 5


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grey_is_scaled_not_clipped(encode: Encode, fmt: str) -> None:
    source = Image.new("I;16", (4, 1))
    for x, value in enumerate([0, 257, 32768, 65535]):
        source.putpixel((x, 0), value)
    data = encode(source, fmt)
    assert probe(data).mode in ("I;16", "I;16B", "I")  # Pillow before 10.1 opens a 16-bit PNG as 32-bit "I"
    assert decode(data).tobytes() == bytes(v for v in (0, 1, 128, 255) for _ in range(3))


def test_palette_png_with_transparency_is_composited_on_white(encode: Encode) -> None:
    source = Image.new("P", (4, 4), 1)
    source.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    source.putpixel((0, 0), 0)
    data = encode(source, "PNG", transparency=0)
    image = decode(data)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (10, 200, 30)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_matches_transformers_convert_to_rgb(encode: Encode, mode: str) -> None:
    transforms = pytest.importorskip("transformers.image_transforms")
    source = _noise(9, 7).convert("RGBA")
    source.putalpha(Image.frombytes("L", (9, 7), random.Random(1).randbytes(63)))
    if mode == "P":
        source = source.convert("RGB").quantize(16)
        source.info["transparency"] = 3
    data = encode(source.convert(mode) if mode != "P" else source, "PNG")
    expected = transforms.convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert decode(data).tobytes() == expected.tobytes()


def test_semi_transparent_rgba(encode: Encode) -> None:
    assert decode(encode(Image.new("RGBA", (2, 2), (255, 0, 0, 128)), "PNG")).getpixel((0, 0)) == (255, 127, 127)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I", "F", "YCbCr"])
def test_modes_canonicalise_to_rgb(encode: Encode, mode: str) -> None:
    source = _noise(6, 5).convert(mode)
    # Pillow before 13 writes an uncompressed YCbCr TIFF that no reader takes (its strips lack the subsampling
    # its header declares); through libtiff's LZW it is a valid file in every Pillow our range allows
    data = encode(source, "TIFF", **({"compression": "tiff_lzw"} if mode == "YCbCr" else {}))
    image = decode(data)
    assert (image.mode, image.size) == ("RGB", (6, 5))
    if mode in ("1", "L", "P", "RGB", "CMYK"):
        assert image.tobytes() == source.convert("RGB").tobytes()


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_images_serve_their_first_frame(encode: Encode, fmt: str) -> None:
    frames = [Image.new("RGB", (8, 6), color) for color in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], **LOSSLESS.get(fmt, {}))
    assert probe(data).n_frames == 3
    assert _code(lambda: probe(data, ImageLimits(max_frames=2))) == "too_many_frames"
    assert decode(data).getpixel((4, 3)) == (255, 0, 0)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
def test_exif_orientation_is_applied(encode: Encode, fmt: str, orientation: int) -> None:
    source = _noise(40, 20, seed=orientation)
    if fmt == "TIFF":
        data = encode(source, fmt, tiffinfo={0x0112: orientation})
    else:
        data = encode(source, fmt, exif=_exif(orientation), **LOSSLESS.get(fmt, {}))
    info = probe(data)
    expected_size = (20, 40) if orientation >= 5 else (40, 20)
    assert (info.orientation, (info.width, info.height)) == (orientation, expected_size)
    image = decode(data)
    assert image.size == expected_size
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert image.tobytes() == reference.tobytes()


def test_orientation_6_jpeg_swaps_sides_for_the_cost_model(encode: Encode) -> None:
    data = encode(_noise(640, 480), "JPEG", exif=_exif(6))
    info = probe(data)
    assert (info.width, info.height) == (480, 640) == decode(data).size
    cost = estimate_image(info)
    assert (cost.resized_width, cost.resized_height) == (476, 644)


def test_corrupt_exif_is_ignored(encode: Encode) -> None:
    data = encode(_noise(8, 8), "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff garbage")
    assert probe(data).orientation == 1
    assert decode(data).size == (8, 8)


# --- bad inputs -----------------------------------------------------------------------------------

def test_empty() -> None:
    assert _code(lambda: probe(b"")) == "empty_image"
    assert _code(lambda: decode(b"")) == "empty_image"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "TIFF", "BMP"])
def test_truncated_files_are_refused_at_probe_and_decode(encode: Encode, fmt: str) -> None:
    data = encode(_noise(64, 64), fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    truncated = data[: len(data) * 6 // 10]
    assert _code(lambda: probe(truncated)) == "truncated_image"
    assert _code(lambda: decode(truncated)) == "truncated_image"


def test_damaged_pixel_data_passes_probe_and_fails_decode() -> None:
    ihdr = struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", b"\x78\x9c" + b"\xff" * 300)
            + _png_chunk(b"IEND", b""))
    assert probe(data).format == "PNG"
    assert _code(lambda: decode(data)) == "corrupt_image"


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_every_prefix_decodes_or_is_refused(encode: Encode, fmt: str) -> None:
    data = encode(_noise(12, 9), fmt, **LOSSLESS.get(fmt, {}))
    for cut in range(0, len(data), max(1, len(data) // 150)):
        try:
            image = decode(data[:cut])
        except InvalidRequest as e:
            assert e.code in ("empty_image", "corrupt_image", "truncated_image", "not_an_image",
                              "unsupported_format"), (cut, e)
        else:
            assert image.size == (12, 9)


@pytest.mark.parametrize("cut", [4, 11, 20])
def test_truncated_header_fails_probe(encode: Encode, cut: int) -> None:
    assert _code(lambda: probe(encode(_noise(8, 8), "JPEG")[:cut])) == "truncated_image"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    magic=st.sampled_from([b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF\x20\x00\x00\x00WEBPVP8X", b"GIF89a", b"BM",
                           b"II*\x00", b"MM\x00*", b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR"]),
    tail=st.binary(max_size=300),
)
def test_garbage_after_a_valid_signature_is_refused_cleanly(magic: bytes, tail: bytes) -> None:
    limits = ImageLimits(max_pixels=1_000_000, max_side=5000)
    for call in (probe, decode):
        try:
            call(magic + tail, limits)
        except InvalidRequest:
            pass


@pytest.mark.parametrize(
    "data",
    [
        random.Random(3).randbytes(4096),
        b"hello, this is not an image\n",
        b"<!DOCTYPE html><html><body>no</body></html>",
        b'{"image": "nope"}',
        b"PK\x03\x04" + bytes(100),
        b"BMW 3 series, not a bitmap",
    ],
    ids=["random", "text", "html", "json", "zip", "bm-text"],
)
def test_not_an_image(data: bytes) -> None:
    assert _code(lambda: probe(data)) == "not_an_image"
    assert _code(lambda: load_source(data) and decode(data)) == "not_an_image"


def _unsupported_samples(encode: Encode) -> dict[str, bytes]:
    small = Image.new("RGB", (16, 16), (1, 2, 3))
    return {
        "ico": encode(small, "ICO"),
        "ppm": encode(small, "PPM"),
        "pdf": encode(small, "PDF"),
        "psd": b"8BPS\x00\x01" + bytes(20),
        "svg": b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="9"/>',
        "bare-svg": b'  <svg width="10" height="10"></svg>',
        "heic": b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(32),
        "bigtiff": b"II+\x00\x08\x00\x00\x00" + bytes(16),
    }


@pytest.mark.parametrize("kind", ["ico", "ppm", "pdf", "psd", "svg", "bare-svg", "heic", "bigtiff"])
def test_unsupported_formats(encode: Encode, kind: str) -> None:
    data = _unsupported_samples(encode)[kind]
    assert _code(lambda: probe(data)) == "unsupported_format"
    assert _code(lambda: decode(data)) == "unsupported_format"


def _gif(screen: tuple[int, int], frame: tuple[int, int]) -> bytes:
    return (
        b"GIF89a" + struct.pack("<HHBBB", *screen, 0, 0, 0)
        + b"," + struct.pack("<HHHHB", 0, 0, *frame, 0) + b"\x02\x02\x44\x01\x00" + b";"
    )


def _bomb_samples(encode: Encode) -> dict[str, bytes]:
    jpeg = bytearray(encode(Image.new("RGB", (8, 8)), "JPEG"))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5: sof + 9] = struct.pack(">HH", 60000, 60000)
    bmp_header = struct.pack("<IiiHHIIiiII", 40, 100_000, -100_000, 1, 24, 0, 0, 0, 0, 0, 0)
    tiff_ifd = struct.pack("<HHHIIHHII", 2, 256, 4, 1, 100_000, 257, 4, 1, 100_000)
    return {
        "png-100000x100000": _png_declaring(100_000, 100_000),
        "png-7000x7000": _png_declaring(7000, 7000),  # under Pillow's own threshold: our limit must catch it
        "png-side-20001": encode(Image.new("L", (20_001, 1)), "PNG"),
        "gif-screen": _gif((65535, 65535), (1, 1)),
        "gif-first-frame": _gif((10, 10), (60000, 60000)),
        "webp-vp8x": b"RIFF" + struct.pack("<I", 22) + b"WEBPVP8X" + struct.pack("<I", 10) + bytes(4)
        + (16383).to_bytes(3, "little") * 2,
        "jpeg-sof": bytes(jpeg),
        "bmp": b"BM" + struct.pack("<IHHI", 54, 0, 0, 54) + bmp_header,
        "tiff": b"II*\x00" + struct.pack("<I", 8) + tiff_ifd + struct.pack("<I", 0),
    }


@pytest.mark.parametrize(
    "kind",
    ["png-100000x100000", "png-7000x7000", "png-side-20001", "gif-screen", "gif-first-frame", "webp-vp8x",
     "jpeg-sof", "bmp", "tiff"],
)
def test_decompression_bombs_are_refused_from_the_header(
    encode: Encode, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    data = _bomb_samples(encode)[kind]
    assert len(data) < 100_000
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # Pillow's guard off: ours must be the one that holds

    def pillow_must_not_see_it(*args: object) -> None:
        raise AssertionError("a bomb reached Pillow")

    for fmt in SUPPORTED_FORMATS:  # refused from our own header parse, before Pillow allocates anything
        monkeypatch.setitem(vlmq.images._OPENERS, fmt, pillow_must_not_see_it)
    assert _code(lambda: probe(data)) == "too_many_pixels"
    assert _code(lambda: decode(data)) == "too_many_pixels"


def test_pixel_limit_is_configurable(encode: Encode) -> None:
    data = encode(Image.new("RGB", (2000, 600)), "PNG")
    assert probe(data).width == 2000
    assert _code(lambda: probe(data, ImageLimits(max_pixels=1_000_000))) == "too_many_pixels"
    assert _code(lambda: decode(data, ImageLimits(max_side=1999))) == "too_many_pixels"


def test_aspect_ratio_over_200_is_refused_by_the_cost_model(encode: Encode) -> None:
    ok = probe(encode(Image.new("RGB", (200, 1)), "PNG"))
    assert estimate_image(ok).vision_tokens > 0
    too_long = probe(encode(Image.new("RGB", (1, 201)), "PNG"))
    with pytest.raises(InvalidRequest) as info:
        estimate_image(too_long)
    assert info.value.code == "aspect_ratio"


def test_oversize_bytes(encode: Encode, tmp_path: Path) -> None:
    data = encode(_noise(64, 64), "PNG")
    limits = ImageLimits(max_bytes=len(data) - 1)
    assert _code(lambda: probe(data, limits)) == "image_too_large"
    assert _code(lambda: decode(data, limits)) == "image_too_large"
    path = tmp_path / "big.png"
    path.write_bytes(data)
    assert _code(lambda: load_source(path, limits)) == "image_too_large"
    assert _code(lambda: load_source(io.BytesIO(data), limits)) == "image_too_large"
    assert load_source(path, ImageLimits(max_bytes=len(data))) == data


def test_decode_refuses_to_run_with_load_truncated_images(encode: Encode, monkeypatch: pytest.MonkeyPatch) -> None:
    truncated = encode(_noise(64, 64), "JPEG")[:1500]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode(truncated)


def test_limits_validation() -> None:
    for bad in ({"max_bytes": 0}, {"max_pixels": -1}, {"max_side": True}, {"max_frames": 0}, {"max_chunks": 0},
                {"max_scans": 1.5}, {"max_metadata_bytes": -1}, {"max_pixels": 100_000_000}):
        with pytest.raises(ValueError):
            ImageLimits(**bad)  # type: ignore[arg-type]


# --- pixel hash ---------------------------------------------------------------------------------

def test_pixel_hash_is_exact_and_stable(encode: Encode) -> None:
    image = Image.new("RGB", (2, 1))
    image.putpixel((0, 0), (1, 2, 3))
    image.putpixel((1, 0), (4, 5, 6))
    # The cache key base must not change silently between versions.
    assert pixel_hash(image) == "60009b1f2385fb73735689a6ff84c302499c2693ce62fff5d2abdc3a74a17dcb"
    source = _noise(30, 20)
    lossless = ("PNG", "BMP", "TIFF", "WEBP")
    hashes = {pixel_hash(decode(encode(source, fmt, **LOSSLESS.get(fmt, {})))) for fmt in lossless}
    assert len(hashes) == 1
    changed = source.copy()
    changed.putpixel((29, 19), (0, 0, 0) if source.getpixel((29, 19)) != (0, 0, 0) else (1, 0, 0))
    assert pixel_hash(changed) not in hashes


def test_pixel_hash_covers_the_size() -> None:
    data = bytes(range(18))
    assert pixel_hash(Image.frombytes("RGB", (2, 3), data)) != pixel_hash(Image.frombytes("RGB", (3, 2), data))


def test_pixel_hash_needs_rgb() -> None:
    with pytest.raises(ValueError, match="RGB"):
        pixel_hash(Image.new("RGBA", (1, 1)))


# --- sources --------------------------------------------------------------------------------------

def test_load_source_accepts_paths_bytes_and_files(encode: Encode, tmp_path: Path) -> None:
    data = encode(_noise(5, 4), "PNG")
    path = tmp_path / "x.png"
    path.write_bytes(data)
    with path.open("rb") as f:
        from_file = load_source(f)
    sources: list[object] = [str(path), path, data, bytearray(data), memoryview(data), io.BytesIO(data)]
    assert all(load_source(s) == data for s in sources)  # type: ignore[arg-type]
    assert from_file == data
    assert load_source("data:image/png;base64," + base64.b64encode(data).decode()) == data


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L", "CMYK", "I;16", "F"])
def test_load_source_reencodes_pil_images_losslessly(mode: str) -> None:
    source = _noise(7, 5).convert(mode) if mode != "I;16" else Image.new("I;16", (7, 5), 40000)
    data = load_source(source)
    assert probe(data).format == "PNG"
    assert decode(data).tobytes() == decode(_tiff(source)).tobytes()


def _tiff(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "TIFF")
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "TIFF"])
def test_load_source_keeps_the_orientation_of_pil_images(encode: Encode, fmt: str) -> None:
    if fmt == "TIFF":
        original = encode(_noise(40, 20), fmt, tiffinfo={0x0112: 6})
    else:
        original = encode(_noise(40, 20), fmt, exif=_exif(6))
    reencoded = load_source(Image.open(io.BytesIO(original)))
    assert decode(reencoded).tobytes() == decode(original).tobytes()
    transposed = ImageOps.exif_transpose(Image.open(io.BytesIO(original)))
    assert decode(load_source(transposed)).tobytes() == decode(original).tobytes()


@pytest.mark.parametrize(
    "source",
    ["s3://bucket/key.png", "file://otherhost/x.png", "http://example.com/x.png", "https://example.com/x.png",
     "ftp://host/x.png", "data:image/png,raw", "data:image/png;base64,!!!", "", 42, io.StringIO("text")],
)
def test_load_source_refuses_other_sources(source: object) -> None:
    assert _code(lambda: load_source(source)) == "bad_image_source"  # type: ignore[arg-type]


def test_load_source_missing_file_and_directory(tmp_path: Path) -> None:
    assert _code(lambda: load_source(tmp_path / "missing.png")) == "image_not_found"
    assert _code(lambda: load_source(str(tmp_path))) == "bad_image_source"


def test_storage_urls_are_recognised() -> None:
    assert is_storage_url("s3://b/k") and is_storage_url("S3://b/k")
    assert not is_storage_url("file:///x") and not is_storage_url("http://x") and not is_storage_url("/tmp/x.png")
    assert not is_storage_url(b"s3://")


def test_file_urls_are_read_as_local_paths(encode: Encode, tmp_path: Path) -> None:
    data = encode(_noise(8, 8), "PNG")
    (tmp_path / "a b.png").write_bytes(data)
    assert load_source(f"file://{tmp_path}/a%20b.png") == data
    assert load_source(f"FILE://localhost{tmp_path}/a%20b.png") == data
    assert _code(lambda: load_source(f"file://{tmp_path}/missing.png")) == "image_not_found"


def test_s3_urls_point_to_the_client() -> None:
    with pytest.raises(InvalidRequest, match="Client.submit, which reads it from the pool's bucket"):
        load_source("s3://bucket/key.png")
