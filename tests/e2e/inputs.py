"""Crafted image files for the bad-input and odd-input tests, and scenes the bundled model describes."""
from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def scene_png(seed: int) -> bytes:
    """A 320x240 scene of the bundled model's training kind (its answers differ from scene to scene)."""
    from tiny.shapes import make_example

    return encode(make_example((777, seed), size=(320, 240)).image, "PNG")


def rgb(width: int = 120, height: int = 90) -> Image.Image:
    img = Image.new("RGB", (width, height), (200, 30, 30))
    img.paste((20, 20, 220), (width // 4, height // 4, width // 2, height // 2))
    return img


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A few hundred bytes declaring a 10-gigapixel image (zeros compress to nothing)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    body = b"".join(compressor.compress(row) for _ in range(8)) + compressor.flush()
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", body) + png_chunk(b"IEND", b"")


def gif_huge_screen() -> bytes:
    """A GIF whose header declares 65535x65535."""
    small = encode(Image.new("P", (4, 4)), "GIF")
    return small[:6] + struct.pack("<HH", 65535, 65535) + small[10:]


def truncated_jpeg() -> bytes:
    data = encode(rgb(400, 300), "JPEG", quality=90)
    return data[: len(data) // 2]


def corrupt_png_data() -> bytes:
    """A valid PNG header whose compressed pixel data is garbage."""
    ihdr = struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"\x78\x9c" + b"\xff" * 300)
            + png_chunk(b"IEND", b""))


def cmyk_jpeg() -> bytes:
    return encode(rgb().convert("CMYK"), "JPEG")


def png16() -> bytes:
    return encode(rgb().convert("L").convert("I;16"), "PNG")


def palette_with_transparency() -> bytes:
    img = rgb().convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    return encode(img, "PNG", transparency=0)


def animated_gif() -> bytes:
    frames = [rgb(), Image.new("RGB", (120, 90), (0, 255, 0)), Image.new("RGB", (120, 90), (0, 0, 255))]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    return encode(rgb(200, 100), "JPEG", exif=exif.tobytes())


def one_pixel() -> bytes:
    return encode(Image.new("RGB", (1, 1), (255, 0, 0)), "PNG")


def rgba_webp() -> bytes:
    return encode(rgb().convert("RGBA"), "WEBP")


def grey_tiff() -> bytes:
    return encode(rgb().convert("L"), "TIFF")


def bmp() -> bytes:
    return encode(rgb(), "BMP")


def ppm() -> bytes:
    return encode(rgb(), "PPM")


def wide_png() -> bytes:
    return encode(Image.new("RGB", (4200, 20)), "PNG")
