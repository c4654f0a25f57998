"""Image intake: sniff and probe headers, enforce limits, decode to canonical RGB, hash pixels.

Two steps, both refusing bad input with :class:`~vlmq.errors.InvalidRequest`:

* :func:`probe` (the SDK, at submit) reads headers only. Our own code
  (:mod:`vlmq.imagescan`) walks the container of every supported format (JPEG,
  PNG, WebP, GIF, BMP, TIFF) and checks it against :class:`ImageLimits` *before*
  Pillow sees the bytes: the declared size (a decompression bomb is refused
  without allocating or decoding anything), the number of chunks, frames and
  scans, the metadata size, and truncation (a missing end marker, or compressed
  data too small for the declared size; a truncated file is never grey-filled).
  Pillow's plugin classes are then used directly (not ``Image.open``), which skips
  Pillow's own ``DecompressionBombWarning`` check; our limits are kept below
  Pillow's threshold so its remaining internal checks stay silent.
* :func:`decode` re-runs the probe (the same refusals, with the same codes),
  decodes the first frame and canonicalises it to 8-bit RGB with EXIF
  orientation applied. Workers call it in a separate process with a time and
  memory budget (``vlmq.workers.decode``).

Canonical RGB:
    * transparency (alpha bands, palette or colour-key ``transparency``) is
      composited onto **white**, as transformers' ``convert_to_rgb`` does, so the
      model sees what a viewer on a white page shows;
    * 16-bit and 32-bit integer grey (``I;16*``, ``I``) is scaled ``v / 257``
      (rounded, clipped to 0..255) rather than clipped, float grey (``F``) is clipped;
    * CMYK, palette, bilevel and grey go through Pillow's conversions; ICC profiles
      are ignored (pixels are taken as sRGB);
    * EXIF orientation (from JPEG APP1, WebP EXIF, PNG eXIf before the image data,
      TIFF tag 274) is applied; orientations 5-8 swap width and height.

Error codes: ``empty_image``, ``image_too_large``, ``not_an_image``,
``unsupported_format``, ``too_many_pixels``, ``truncated_image``,
``too_many_chunks``, ``too_many_frames``, ``metadata_too_large``,
``corrupt_image``, ``bad_image_source``, ``image_not_found``.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import os
import re
import stat
import struct
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Union

from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    ImageFile,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    WebPImagePlugin,
)

from vlmq import imagescan
from vlmq.errors import InvalidRequest
from vlmq.imagescan import ImageLimits, Layout, check_size

__all__ = [
    "DEFAULT_LIMITS", "SUPPORTED_FORMATS", "ImageInfo", "ImageLimits", "ImageSource",
    "decode", "file_url_path", "is_storage_url", "load_source", "pixel_hash", "probe", "probe_head",
]

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

_OPENERS: dict[str, type[ImageFile.ImageFile]] = {
    "JPEG": JpegImagePlugin.JpegImageFile,
    "PNG": PngImagePlugin.PngImageFile,
    "WEBP": WebPImagePlugin.WebPImageFile,
    "GIF": GifImagePlugin.GifImageFile,
    "BMP": BmpImagePlugin.BmpImageFile,
    "TIFF": TiffImagePlugin.TiffImageFile,
}

# Pillow's TIFF plugin reports the displayed size and applies the orientation tag itself on load.
_SELF_ORIENTING = frozenset({"TIFF"})

# Errors Pillow raises on malformed or truncated data.
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, TypeError, KeyError)

DEFAULT_LIMITS = ImageLimits()
"""The limits used when none are given (the SDK's and workers' defaults)."""

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes], Image.Image]
"""What :func:`load_source` accepts."""


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What :func:`probe` learns from an image's headers.

    Attributes:
        format: one of :data:`SUPPORTED_FORMATS`.
        width: width as displayed (after EXIF orientation).
        height: height as displayed (after EXIF orientation).
        orientation: EXIF orientation 1-8 (1 when absent or invalid).
        mode: Pillow mode of the stored pixels (``RGB``, ``P``, ``CMYK``, ``I;16`` ...).
        n_frames: frames in the file (at most ``ImageLimits.max_frames``).
    """

    format: str
    width: int
    height: int
    orientation: int
    mode: str
    n_frames: int

    def to_dict(self) -> dict[str, int | str]:
        """Returns the fields as a JSON-ready dict."""
        return asdict(self)


# --- format sniffing -------------------------------------------------------------------------------

_UNSUPPORTED_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x02\x00", "CUR"), (b"8BPS", "PSD"), (b"%PDF", "PDF"),
    (b"%!PS", "PostScript"), (b"\xc5\xd0\xd3\xc6", "EPS"), (b"II+\x00", "BigTIFF"), (b"MM\x00+", "BigTIFF"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"), (b"\xffO\xffQ", "JPEG 2000"), (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"), (b"qoif", "QOI"), (b"DDS ", "DDS"), (b"icns", "ICNS"),
    (b"gimp xcf", "XCF"), (b"\x8aMNG", "MNG"), (b"\x8bJNG", "JNG"), (b"SIMPLE  =", "FITS"),
    (b"#?RADIANCE", "HDR"), (b"\x76\x2f\x31\x01", "OpenEXR"),
)
_BMP_INFO_HEADER_SIZES = frozenset(struct.pack("<I", size) for size in (12, 16, 40, 52, 56, 64, 108, 124))
_PNM = re.compile(rb"P[1-7]\s")


def _sniff(data: bytes) -> str:
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM" and data[14:18] in _BMP_INFO_HEADER_SIZES:
        return "BMP"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    name = _unsupported_name(data)
    if name is not None:
        raise InvalidRequest(
            f"{name} images are not supported; convert to one of {', '.join(SUPPORTED_FORMATS)}",
            code="unsupported_format",
        )
    raise InvalidRequest(
        f"the data is not an image in a known format (supported: {', '.join(SUPPORTED_FORMATS)})",
        code="not_an_image",
    )


def _unsupported_name(data: bytes) -> str | None:
    for magic, name in _UNSUPPORTED_MAGIC:
        if data.startswith(magic):
            return name
    if _PNM.match(data[:3]):
        return "PNM (PPM/PGM/PBM)"
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "HEIF/AVIF"
    head = data[:4096].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<svg", b"<!doctype svg")) or (head.startswith(b"<?xml") and b"<svg" in head):
        return "SVG"
    return None


# --- declared sizes and structure, parsed without Pillow (vlmq.imagescan) -----------------------

def _declared(data: bytes, fmt: str, limits: ImageLimits) -> Layout:
    """Walks the container in our own code: declared size, frames, and the structure limits."""
    try:
        return imagescan.WALKS[fmt](data, limits)
    except (struct.error, IndexError) as e:
        raise InvalidRequest(f"the {fmt} file is truncated (a header is cut short); submit the complete file",
                             code="truncated_image") from e


# --- probe ---------------------------------------------------------------------------------------

def _check_bytes(data: bytes, limits: ImageLimits) -> None:
    if not data:
        raise InvalidRequest("the image is empty (0 bytes)", code="empty_image")
    if len(data) > limits.max_bytes:
        raise InvalidRequest(
            f"the image is {len(data)} bytes, over the limit of {limits.max_bytes}; recompress or downscale it",
            code="image_too_large",
        )


def _orientation(im: ImageFile.ImageFile) -> int:
    """EXIF orientation known before any pixel data is read (1 when absent or invalid)."""
    value: object = None
    try:
        if isinstance(im, TiffImagePlugin.TiffImageFile):
            value = im.tag_v2.get(0x0112)
        elif im.info.get("exif"):
            exif = Image.Exif()
            exif.load(im.info["exif"])
            value = exif.get(0x0112)
    except _PIL_ERRORS:  # malformed EXIF: show the pixels as stored
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


@contextlib.contextmanager
def _pil_warnings_ignored() -> Iterator[None]:
    """Pillow reports malformed metadata (EXIF, APNG chunks) as UserWarning and carries on; so do we.

    Without this, a process running with warnings as errors would refuse images that
    every other process serves. ``catch_warnings`` is not thread-safe before Python
    3.14; a race can only leave this Pillow-scoped filter on or off a little longer.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        yield


def _open(data: bytes, limits: ImageLimits) -> tuple[ImageInfo, ImageFile.ImageFile]:
    with _pil_warnings_ignored():
        return _open_quietly(data, limits)


def _open_quietly(data: bytes, limits: ImageLimits, walk: bool = True) -> tuple[ImageInfo, ImageFile.ImageFile]:
    _check_bytes(data, limits)
    fmt = _sniff(data)
    layout = _declared(data, fmt, limits) if walk else imagescan.Layout(0, 0, 1)
    try:
        im = _OPENERS[fmt](io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise InvalidRequest(f"the image is too large to decode safely: {e}", code="too_many_pixels") from e
    except _PIL_ERRORS as e:
        raise InvalidRequest(f"the {fmt} image is corrupt: {e}", code="corrupt_image") from e
    check_size(im.width, im.height, limits)
    orientation = _orientation(im)
    swap = orientation >= 5 and fmt not in _SELF_ORIENTING
    info = ImageInfo(
        format=fmt, width=im.height if swap else im.width, height=im.width if swap else im.height,
        orientation=orientation, mode=im.mode, n_frames=layout.frames,
    )
    return info, im


def probe(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> ImageInfo:
    """Reads an image's headers (no pixel decode) and checks it against the limits.

    Args:
        data: the encoded image.
        limits: the limits to enforce.

    Returns:
        Format, displayed size, orientation, mode and frame count.

    Raises:
        InvalidRequest: with code ``empty_image``, ``image_too_large``,
            ``not_an_image``, ``unsupported_format``, ``too_many_pixels``,
            ``truncated_image``, ``too_many_chunks``, ``too_many_frames``,
            ``metadata_too_large`` or ``corrupt_image`` (a header that cannot be
            parsed). Damage inside the compressed pixel data is only found by
            :func:`decode`.
    """
    return _open(bytes(data), limits)[0]


def probe_head(head: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> ImageInfo:
    """Reads format, displayed size, orientation and mode from the first bytes of an image (a ranged read).

    Unlike :func:`probe` the container is not walked (the rest of the file is not here): it prices a fetched
    image at submit; the worker runs :func:`probe` on the whole file and compares (``vlmq.remote``).
    ``n_frames`` is reported as 1.

    Raises:
        InvalidRequest: ``not_an_image``, ``unsupported_format``, ``too_many_pixels``; ``corrupt_image`` or
            ``truncated_image`` when the header is cut short (read more and call again).
    """
    with _pil_warnings_ignored():
        try:
            return _open_quietly(bytes(head), limits, walk=False)[0]
        except _PIL_ERRORS as e:  # Pillow's opener ran out of bytes before the header's end
            raise InvalidRequest(f"the image header is cut short: {e}", code="truncated_image") from e


# --- decode --------------------------------------------------------------------------------------

_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _to_rgb(im: Image.Image) -> Image.Image:
    """Converts a loaded image of any Pillow mode to 8-bit RGB (see the module docstring)."""
    if im.mode.startswith("I;16") or im.mode == "I":
        im = im.convert("I").point(lambda v: v / 257 + 0.5).convert("L")  # 16-bit range to 8-bit, rounded
        im.info.pop("transparency", None)  # a 16-bit colour key no longer matches the scaled values
    elif im.mode == "F":
        im = im.convert("L")
    if "A" in im.getbands() or "a" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("LA" if im.mode == "La" else im.mode).convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def decode(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decodes the first frame of an image to canonical RGB with EXIF orientation applied.

    Args:
        data: the encoded image.
        limits: the limits to enforce (checked again before decoding).

    Returns:
        A loaded ``RGB`` image of the displayed size.

    Raises:
        InvalidRequest: the codes of :func:`probe`, ``corrupt_image`` for truncated
            or damaged pixel data, ``unsupported_format`` for a colour mode that
            cannot be converted.
        RuntimeError: ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is set in this
            process, which would let truncated images through.
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set; vlmq refuses to decode with it on")
    with _pil_warnings_ignored():
        return _decode_quietly(bytes(data), limits)


def _decode_quietly(data: bytes, limits: ImageLimits) -> Image.Image:
    info, im = _open_quietly(data, limits)
    try:
        im.load()
    except Image.DecompressionBombError as e:
        raise InvalidRequest(f"the image is too large to decode safely: {e}", code="too_many_pixels") from e
    except _PIL_ERRORS as e:
        raise InvalidRequest(f"the {info.format} image data is truncated or corrupt: {e}", code="corrupt_image") from e
    try:
        rgb = _to_rgb(im)
    except ValueError as e:
        raise InvalidRequest(f"colour mode {im.mode} is not supported: {e}", code="unsupported_format") from e
    if info.orientation in _TRANSPOSE and info.format not in _SELF_ORIENTING:
        rgb = rgb.transpose(_TRANSPOSE[info.orientation])
    assert rgb.size == (info.width, info.height), (rgb.size, info)
    return rgb


def pixel_hash(img: Image.Image) -> str:
    """Returns the sha256 hex digest of an RGB image's exact pixels and size.

    This is the base of exact cache keys (callers add model id and processor
    settings); two images hash equal only if every pixel is equal.

    Args:
        img: an ``RGB`` image, as returned by :func:`decode`.

    Returns:
        64 lowercase hex characters.

    Raises:
        ValueError: the image is not in mode ``RGB``.
    """
    if img.mode != "RGB":
        raise ValueError(f"pixel_hash needs a canonical RGB image (see decode), got mode {img.mode}")
    digest = hashlib.sha256(b"vlmq-rgb8\x00")
    digest.update(struct.pack("<II", img.width, img.height))
    digest.update(img.tobytes())
    return digest.hexdigest()


# --- sources ------------------------------------------------------------------------------------

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_storage_url(value: object) -> bool:
    """Tells whether an image argument is a storage reference that the client resolves itself.

    Args:
        value: what the user passed as the image.

    Returns:
        True for an ``s3://`` string (any letter case): ``Client.submit`` reads it from the pool's bucket.
    """
    return isinstance(value, str) and value.lower().startswith("s3://")


def file_url_path(url: str) -> Path:
    """The local path a ``file:///path`` URL names.

    Raises:
        InvalidRequest: ``bad_image_source`` for a URL naming another host.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequest(f"{url[:80]!r} names another host; file:// URLs must name a local file (file:///path)",
                             code="bad_image_source")
    return Path(urllib.parse.unquote(parts.path))


READ_PIECE = 1 << 20  # bytes read from a file at a time


def _too_large(size: int, limits: ImageLimits) -> InvalidRequest:
    return InvalidRequest(
        f"the image is {size} bytes, over the limit of {limits.max_bytes}; recompress or downscale it",
        code="image_too_large",
    )


def _read_stream(stream: IO[bytes], limits: ImageLimits) -> bytes:
    """At most ``max_bytes`` + 1 bytes, a MiB at a time (``read(max_bytes + 1)`` would allocate the whole
    limit for every image, however small)."""
    parts: list[bytes] = []
    size = 0
    while size <= limits.max_bytes:
        part = stream.read(min(READ_PIECE, limits.max_bytes + 1 - size))
        if not isinstance(part, bytes | bytearray):
            raise InvalidRequest("the file object must be opened in binary mode ('rb')", code="bad_image_source")
        if not part:
            break
        parts.append(bytes(part))
        size += len(part)
    if size > limits.max_bytes:
        raise _too_large(size, limits)
    return b"".join(parts)


def _from_data_url(url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise InvalidRequest("data: URLs must be base64 encoded (data:image/png;base64,...)", code="bad_image_source")
    if len(payload) * 3 // 4 > limits.max_bytes + 2:
        raise _too_large(len(payload) * 3 // 4, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as e:  # binascii.Error, or a character that is not ASCII
        raise InvalidRequest(f"the data: URL is not valid base64: {e}", code="bad_image_source") from e


def _from_path(path: Path, limits: ImageLimits) -> bytes:
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # never open a device or a FIFO (opening one can block)
            raise _not_regular(path)
        # O_NONBLOCK: a FIFO swapped in since the stat must not block the open; fstat then refuses it
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _not_regular(path)
            return _read_stream(f, limits)
    except InvalidRequest:
        raise
    except FileNotFoundError as e:
        raise InvalidRequest(f"no image file at {str(path)!r}", code="image_not_found") from e
    except (OSError, ValueError) as e:  # ValueError: a NUL or a lone surrogate in the path
        raise InvalidRequest(f"cannot read image file {str(path)!r}: {e}", code="bad_image_source") from e


def _not_regular(path: Path) -> InvalidRequest:
    return InvalidRequest(f"{str(path)!r} is not a regular file (a device, FIFO, socket or folder); name an image file",
                          code="bad_image_source")


def _from_pil(img: Image.Image, limits: ImageLimits) -> bytes:
    check_size(img.width, img.height, limits)
    img.load()  # Pillow's TIFF plugin applies (and drops) the orientation tag on load: read EXIF after it
    if img.mode not in ("1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16"):
        img = _to_rgb(img)  # PNG cannot store this mode; decode would produce the same pixels
    buffer = io.BytesIO()
    exif = img.getexif()
    img.save(buffer, format="PNG", exif=exif.tobytes() if exif else b"")
    return buffer.getvalue()


def load_source(image: ImageSource, limits: ImageLimits = DEFAULT_LIMITS) -> bytes:
    """Returns the encoded bytes of an image given as a path, bytes, file object or PIL image.

    Accepted: a local path (``str`` or ``os.PathLike``); ``bytes``, ``bytearray`` or
    ``memoryview``; a binary file object (read from its current position); a
    ``file:///path`` URL (read as the local path); a ``data:...;base64,`` URL; a PIL
    image (re-encoded losslessly as PNG, current frame only, keeping its EXIF
    orientation). ``s3://`` strings are refused here: ``Client.submit`` resolves them
    itself (see :func:`is_storage_url`), as it does ``https://`` URLs (``vlmq.remote``:
    fetched by the worker). Other URL schemes are refused.

    Args:
        image: the image source.
        limits: only ``max_bytes`` (and, for PIL images, the pixel limits) apply here.

    Returns:
        The encoded image bytes (not yet validated: call :func:`probe`).

    Raises:
        InvalidRequest: ``bad_image_source`` (unsupported type or URL scheme,
            unreadable file), ``image_not_found`` (no such file),
            ``image_too_large`` or ``too_many_pixels``.
    """
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        if len(data) > limits.max_bytes:
            raise _too_large(len(data), limits)
        return data
    if isinstance(image, Image.Image):
        return _from_pil(image, limits)
    if isinstance(image, str):
        if is_storage_url(image):
            raise InvalidRequest(
                f"{image!r} is an s3:// URL; pass it to Client.submit, which reads it from the pool's bucket",
                code="bad_image_source",
            )
        if image.lower().startswith("file://"):
            return _from_path(file_url_path(image), limits)
        if image.lower().startswith("data:"):
            return _from_data_url(image, limits)
        if _SCHEME.match(image):
            raise InvalidRequest(
                f"cannot load {image[:80]!r} here: pass https:// URLs to Client.submit (its workers fetch them), "
                "or pass the image's bytes or path",
                code="bad_image_source",
            )
        if not image:
            raise InvalidRequest("the image path is empty", code="bad_image_source")
        return _from_path(Path(image), limits)
    if isinstance(image, os.PathLike):
        return _from_path(Path(image), limits)
    if hasattr(image, "read"):
        return _read_stream(image, limits)
    raise InvalidRequest(
        f"cannot load an image from {type(image).__name__}; pass a path, bytes, a binary file or a PIL image",
        code="bad_image_source",
    )
