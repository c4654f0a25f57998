"""Container walks for the supported image formats, in our own code, before Pillow sees the bytes.

Each walk reads only headers and the lengths of chunks, segments and blocks (never pixel data), stops as soon
as a limit is passed, and returns the declared size and frame count. It refuses with
:class:`~vlmq.errors.InvalidRequest`:

* ``too_many_pixels``: the declared size is over the limits (checked as soon as the size is read, so a
  decompression bomb is refused before the rest of the file is looked at);
* ``truncated_image``: the file ends before its structure does (no JPEG end-of-image marker, no PNG ``IEND``,
  no GIF trailer, a chunk, segment, strip or RIFF body that runs past the end), or its compressed data is too
  small to hold the declared pixels even at the format's best compression ratio;
* ``too_many_chunks``: more chunks, segments, blocks, TIFF tags or strips than ``max_chunks``, or more JPEG
  scans than ``max_scans`` (each costs Pillow a Python step, or libjpeg a pass over every block);
* ``too_many_frames``: more animation frames (GIF images, APNG ``acTL``, WebP ``ANMF``, TIFF IFDs) than
  ``max_frames``;
* ``metadata_too_large``: more than ``max_metadata_bytes`` in ancillary data (PNG ancillary chunks, JPEG APPn
  and COM segments, WebP EXIF/XMP/ICC and unknown chunks, GIF extensions, TIFF tag values);
* ``corrupt_image``: a header that cannot be parsed.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from vlmq.errors import InvalidRequest

# Pillow warns above this many pixels (its default MAX_IMAGE_PIXELS); our limits stay below it.
_PIL_WARN_PIXELS = 89_478_485


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Limits every input image must satisfy.

    Attributes:
        max_bytes: largest encoded size in bytes.
        max_pixels: largest declared ``width * height`` (at most Pillow's warning threshold).
        max_side: largest declared width or height.
        max_frames: most frames an animation may have (only the first is used).
        max_chunks: most container chunks, segments, blocks, TIFF tags or strips a file may have (Pillow handles
            each in Python, holding the GIL: a flood of empty chunks costs seconds within ``max_bytes``).
        max_scans: most JPEG scans (a progressive decoder passes over every block once per scan).
        max_metadata_bytes: most bytes of ancillary data (EXIF, XMP, ICC, text, unknown chunks).
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_side: int = 20_000
    max_frames: int = 1000
    max_chunks: int = 20_000
    max_scans: int = 100
    max_metadata_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_pixels > _PIL_WARN_PIXELS:
            raise ValueError(f"max_pixels must be at most {_PIL_WARN_PIXELS} (Pillow's decompression-bomb threshold)")


@dataclass(frozen=True, slots=True)
class Layout:
    """What a container walk learned: the declared size (before EXIF orientation) and the frame count."""

    width: int
    height: int
    frames: int


def check_size(width: int, height: int, limits: ImageLimits) -> None:
    """Refuses an empty declared size (``corrupt_image``) or one over the limits (``too_many_pixels``)."""
    if width < 1 or height < 1:
        raise InvalidRequest(f"the image declares an empty size {width}x{height}", code="corrupt_image")
    if max(width, height) > limits.max_side or width * height > limits.max_pixels:
        raise InvalidRequest(
            f"the image declares {width}x{height} pixels; the limits are {limits.max_side} per side and "
            f"{limits.max_pixels} in all. Downscale it before submitting",
            code="too_many_pixels",
        )


def corrupt(fmt: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"the {fmt} header is corrupt ({what})", code="corrupt_image")


def _truncated(fmt: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"the {fmt} file is truncated ({what}); submit the complete file", code="truncated_image")


class _Counter:
    """Counts chunks, frames and metadata bytes against the limits, raising as soon as one is passed."""

    def __init__(self, fmt: str, limits: ImageLimits) -> None:
        self.fmt, self.limits = fmt, limits
        self.chunks = self.frames = self.metadata = 0

    def chunk(self, what: str = "chunks", n: int = 1) -> None:
        self.chunks += n
        if self.chunks > self.limits.max_chunks:
            raise InvalidRequest(
                f"the {self.fmt} file has more than {self.limits.max_chunks} {what}; re-save it with a standard "
                "encoder", code="too_many_chunks")

    def frame(self) -> None:
        self.frames += 1
        self.frames_at_most(self.frames)

    def frames_at_most(self, frames: int) -> None:
        if frames > self.limits.max_frames:
            raise InvalidRequest(
                f"the {self.fmt} file has {frames} frames or more; the limit is {self.limits.max_frames} (only the "
                "first frame is used: submit it as a still image)", code="too_many_frames")

    def meta(self, size: int) -> None:
        self.metadata += size
        if self.metadata > self.limits.max_metadata_bytes:
            raise InvalidRequest(
                f"the {self.fmt} file carries more than {self.limits.max_metadata_bytes} bytes of metadata (EXIF, "
                "XMP, ICC, text or unknown chunks); strip the metadata before submitting", code="metadata_too_large")


# --- JPEG ----------------------------------------------------------------------------------------

# The next marker after entropy-coded data: 0xFF not followed by a stuffed 0x00, a restart marker or fill.
_JPEG_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_JPEG_HUFFMAN_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7})
_JPEG_ARITHMETIC_SOF = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


@dataclass(frozen=True, slots=True)
class _JpegFrame:
    width: int
    height: int
    huffman: bool
    min_blocks: int  # 8x8 blocks of the smallest component: each costs at least one bit in a Huffman scan


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _jpeg_frame(data: bytes, pos: int, end: int, limits: ImageLimits) -> _JpegFrame:
    height, width, count = struct.unpack_from(">HHB", data, pos + 5)
    check_size(width, height, limits)
    if pos + 10 + 3 * count > end:
        raise corrupt("JPEG", f"the frame header is too short for {count} components")
    factors = [(data[pos + 11 + 3 * i] >> 4, data[pos + 11 + 3 * i] & 15) for i in range(count)]
    if not factors or min(min(f) for f in factors) < 1:
        raise corrupt("JPEG", "frame header without components or with a zero sampling factor")
    h_max, v_max = max(h for h, _ in factors), max(v for _, v in factors)
    blocks = min(_ceil_div(_ceil_div(width * h, h_max), 8) * _ceil_div(_ceil_div(height * v, v_max), 8)
                 for h, v in factors)
    return _JpegFrame(width, height, data[pos + 1] in _JPEG_HUFFMAN_SOF, blocks)


def _jpeg_segment(data: bytes, pos: int) -> tuple[int, int]:
    """Returns (marker, end of segment) for the segment at ``pos`` (a marker with a length)."""
    if pos + 4 > len(data):
        raise _truncated("JPEG", "a segment header is cut short")
    (length,) = struct.unpack_from(">H", data, pos + 2)
    if length < 2:
        raise corrupt("JPEG", f"segment length {length} at byte {pos}")
    if pos + 2 + length > len(data):
        raise _truncated("JPEG", f"the segment at byte {pos} runs past the end")
    return data[pos + 1], pos + 2 + length


def _jpeg_marker(data: bytes, pos: int) -> int:
    """Skips fill bytes and markers without a length; returns the position of end-of-image or a segment."""
    while True:
        while data[pos: pos + 2] == b"\xff\xff":  # fill bytes before a marker
            pos += 1
        if pos + 2 > len(data):
            raise _truncated("JPEG", "no end-of-image marker")
        if data[pos] != 0xFF:
            raise corrupt("JPEG", f"no marker at byte {pos}")
        if not (data[pos + 1] in (0x01, 0xD8) or 0xD0 <= data[pos + 1] <= 0xD7):
            return pos
        pos += 2


def _jpeg_entropy_end(data: bytes, start: int) -> int:
    """Where the entropy-coded data that starts at ``start`` ends: the next marker."""
    found = _JPEG_NEXT_MARKER.search(data, start)
    if found is None:
        raise _truncated("JPEG", "no end-of-image marker")
    return found.start()


def jpeg(data: bytes, limits: ImageLimits) -> Layout:
    count = _Counter("JPEG", limits)
    frame: _JpegFrame | None = None
    pos, scans, scan_bytes = 2, 0, 0
    while data[(pos := _jpeg_marker(data, pos)) + 1] != 0xD9:  # until end of image
        marker, end = _jpeg_segment(data, pos)
        count.chunk("segments")
        if 0xE0 <= marker <= 0xEF or marker == 0xFE:  # APPn, COM
            count.meta(end - pos)
        elif (marker in _JPEG_HUFFMAN_SOF or marker in _JPEG_ARITHMETIC_SOF) and frame is None:
            frame = _jpeg_frame(data, pos, end, limits)
        elif marker == 0xDA:  # start of scan: entropy-coded data runs to the next marker
            scans += 1
            if frame is None:
                raise corrupt("JPEG", "a scan before the frame header")
            if scans > limits.max_scans:
                raise InvalidRequest(f"the JPEG file has more than {limits.max_scans} scans; re-save it as baseline "
                                     "or with a standard progressive script", code="too_many_chunks")
            scan_end = _jpeg_entropy_end(data, end)
            scan_bytes, end = scan_bytes + scan_end - end, scan_end
        pos = end
    if frame is None:
        raise corrupt("JPEG", "no frame header")
    if frame.huffman and scan_bytes * 8 < frame.min_blocks:
        raise _truncated("JPEG", f"{scan_bytes} bytes of compressed data cannot hold {frame.width}x{frame.height} "
                                 "pixels")
    return Layout(frame.width, frame.height, 1)


# --- PNG -----------------------------------------------------------------------------------------

_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_DEFLATE_MAX_RATIO = 1032  # a 258-byte match in 2 bits: no deflate stream expands more than this


def png(data: bytes, limits: ImageLimits) -> Layout:
    if data[12:16] != b"IHDR":
        raise corrupt("PNG", "no IHDR chunk")
    if len(data) < 29:
        raise _truncated("PNG", "the IHDR chunk is cut short")
    width, height, depth, colour = struct.unpack_from(">IIBB", data, 16)
    check_size(width, height, limits)
    count = _Counter("PNG", limits)
    pos, idat, frames = 8, 0, 1
    while True:
        if pos + 8 > len(data):
            raise _truncated("PNG", "no IEND chunk")
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if end > len(data):
            raise _truncated("PNG", f"the {kind.decode('latin-1')!r} chunk at byte {pos} runs past the end")
        count.chunk()
        if kind == b"IEND":
            break
        if kind == b"IDAT":
            idat += length
        elif kind == b"acTL" and length >= 8:
            (frames,) = struct.unpack_from(">I", data, pos + 8)
            count.frames_at_most(frames)
        elif kind[0] & 0x20 and kind != b"fdAT":  # ancillary (lower-case first letter), not frame data
            count.meta(length)
        pos = end
    bits = width * height * depth * _PNG_CHANNELS.get(colour, 1)
    if idat * _DEFLATE_MAX_RATIO < bits // 8:
        raise _truncated("PNG", f"{idat} bytes of image data cannot hold {width}x{height} pixels")
    return Layout(width, height, max(frames, 1))


# --- WebP ----------------------------------------------------------------------------------------

_WEBP_IMAGE_CHUNKS = frozenset({b"VP8X", b"VP8 ", b"VP8L", b"ALPH", b"ANIM", b"ANMF"})


def _webp_size(data: bytes, pos: int, kind: bytes) -> tuple[int, int] | None:
    """The size a VP8X, VP8 or VP8L chunk at ``pos`` declares (None for other chunks or a bad header)."""
    body = pos + 8
    if kind == b"VP8 " and data[body + 3: body + 6] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", data, body + 6)
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L" and data[body: body + 1] == b"\x2f":
        (bits,) = struct.unpack_from("<I", data, body + 1)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X" and len(data) >= body + 10:
        return int.from_bytes(data[body + 4: body + 7], "little") + 1, int.from_bytes(data[body + 7: body + 10],
                                                                                       "little") + 1
    return None


def webp(data: bytes, limits: ImageLimits) -> Layout:
    (riff,) = struct.unpack_from("<I", data, 4)
    riff_end = 8 + riff
    count = _Counter("WebP", limits)
    size: tuple[int, int] | None = None
    pos = 12
    while pos + 8 <= min(riff_end, len(data)):
        kind, length = struct.unpack_from("<4sI", data, pos)
        count.chunk()
        if size is None and (size := _webp_size(data, pos, kind)) is not None:
            check_size(*size, limits)
        if pos + 8 + length > len(data):
            raise _truncated("WebP", f"the {kind.decode('latin-1')!r} chunk at byte {pos} runs past the end")
        if kind == b"ANMF":
            count.frame()
        elif kind not in _WEBP_IMAGE_CHUNKS:  # EXIF, XMP, ICCP and unknown chunks
            count.meta(length)
        pos += 8 + length + (length & 1)
    if riff_end > len(data):
        raise _truncated("WebP", f"the RIFF header declares {riff_end} bytes; the file has {len(data)}")
    if size is None:
        raise corrupt("WebP", "no VP8/VP8L/VP8X header")
    return Layout(*size, max(count.frames, 1))


# --- GIF -----------------------------------------------------------------------------------------

_LZW_MAX_PIXELS_PER_BYTE = 4096  # a 12-bit code stands for at most 4,096 pixels


def _gif_sub_blocks(data: bytes, pos: int, count: _Counter) -> int:
    """Skips a chain of sub-blocks; returns the position after its terminator. Sub-blocks under 64 bytes count
    as chunks (encoders write 255-byte ones; a flood of tiny ones costs Pillow a Python call each)."""
    while size := data[pos]:
        if size < 64:
            count.chunk("blocks")
        pos += size + 1
    return pos + 1


def _gif_colour_table(flags: int) -> int:
    return 3 * (2 << (flags & 7)) if flags & 0x80 else 0


def gif(data: bytes, limits: ImageLimits) -> Layout:
    if len(data) < 13:
        raise _truncated("GIF", "short logical screen descriptor")
    width, height = struct.unpack_from("<HH", data, 6)
    check_size(width, height, limits)
    count = _Counter("GIF", limits)
    pos = 13 + _gif_colour_table(data[10])
    first_pixels = lzw_bytes = 0
    try:
        while data[pos] != 0x3B:  # trailer
            count.chunk("blocks")
            if data[pos] == 0x21:  # extension: introducer, label, sub-blocks
                start = pos
                pos = _gif_sub_blocks(data, pos + 2, count)
                count.meta(pos - start)
            elif data[pos] == 0x2C:  # image descriptor
                x0, y0, w, h = struct.unpack_from("<HHHH", data, pos + 1)
                if not count.frames:  # Pillow grows the canvas to the first frame's extent
                    width, height = max(width, x0 + w), max(height, y0 + h)
                    check_size(width, height, limits)
                pos += 10 + _gif_colour_table(data[pos + 9])
                start = pos + 1  # after the LZW minimum code size
                pos = _gif_sub_blocks(data, start, count)
                if not count.frames:
                    first_pixels, lzw_bytes = w * h, pos - start
                count.frame()
            else:  # Pillow skips stray bytes between blocks one at a time; they count as blocks
                pos += 1
    except (IndexError, struct.error):
        raise _truncated("GIF", "no trailer") from None
    if not count.frames:
        raise corrupt("GIF", "no image")
    if lzw_bytes * _LZW_MAX_PIXELS_PER_BYTE < first_pixels:
        raise _truncated("GIF", f"{lzw_bytes} bytes of image data cannot hold the first frame's pixels")
    return Layout(width, height, count.frames)


# --- BMP -----------------------------------------------------------------------------------------

_BMP_UNCOMPRESSED = frozenset({0, 3, 6})  # BI_RGB, BI_BITFIELDS, BI_ALPHABITFIELDS


def bmp(data: bytes, limits: ImageLimits) -> Layout:
    (offset, header) = struct.unpack_from("<II", data, 10)
    if header == 12:  # OS/2 BITMAPCOREHEADER
        width, height, _, bpp = struct.unpack_from("<HHHH", data, 18)
        compression = 0
    else:
        width, height, _, bpp, compression = struct.unpack_from("<iiHHI", data, 18)
    height = abs(height)  # negative height: rows stored top-down
    check_size(width, height, limits)
    need = offset + (width * bpp + 31) // 32 * 4 * height
    if compression in _BMP_UNCOMPRESSED and len(data) < need:
        raise _truncated("BMP", f"{width}x{height} pixels at {bpp} bits need {need} bytes; the file has {len(data)}")
    return Layout(width, height, 1)


# --- TIFF ----------------------------------------------------------------------------------------

_TIFF_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8,
                    18: 8}
_TIFF_PARTS = ((273, 279), (324, 325))  # (StripOffsets, StripByteCounts), (TileOffsets, TileByteCounts)
_TIFF_PART_TAGS = frozenset(tag for pair in _TIFF_PARTS for tag in pair)


def _tiff_values(data: bytes, endian: str, entry: int) -> tuple[int, ...]:
    """The SHORT or LONG values of the IFD entry at ``entry`` (empty for other types)."""
    kind, n = struct.unpack_from(endian + "HI", data, entry + 2)
    if kind not in (3, 4):
        return ()
    code = "H" if kind == 3 else "I"
    where = entry + 8 if n * (2 if kind == 3 else 4) <= 4 else struct.unpack_from(endian + "I", data, entry + 8)[0]
    return struct.unpack_from(f"{endian}{n}{code}", data, where)


def _tiff_ifd(data: bytes, endian: str, offset: int, n: int, count: _Counter) -> tuple[int, int]:
    """Checks the first IFD (metadata size, strips within the file); returns its (width, height)."""
    entries: dict[int, int] = {}
    for i in range(n):
        entry = offset + 2 + 12 * i
        tag, kind, values = struct.unpack_from(endian + "HHI", data, entry)
        entries[tag] = entry
        size = values * _TIFF_TYPE_SIZES.get(kind, 1)
        if size > 4 and tag not in _TIFF_PART_TAGS:
            (where,) = struct.unpack_from(endian + "I", data, entry + 8)
            if where + size <= len(data):  # Pillow skips a value that runs past the end
                count.meta(size)
    width = _tiff_values(data, endian, entries[256]) if 256 in entries else ()
    height = _tiff_values(data, endian, entries[257]) if 257 in entries else ()
    if not width or not height:
        raise corrupt("TIFF", "ImageWidth or ImageLength missing")
    check_size(width[0], height[0], count.limits)
    for offsets_tag, sizes_tag in _TIFF_PARTS:
        if offsets_tag in entries and sizes_tag in entries:
            count.chunk("strips or tiles", struct.unpack_from(endian + "I", data, entries[offsets_tag] + 4)[0])
            offsets, sizes = _tiff_values(data, endian, entries[offsets_tag]), _tiff_values(data, endian,
                                                                                            entries[sizes_tag])
            if max((o + s for o, s in zip(offsets, sizes, strict=False)), default=0) > len(data):
                raise _truncated("TIFF", "a strip or tile runs past the end")
    return width[0], height[0]


def tiff(data: bytes, limits: ImageLimits) -> Layout:
    endian = "<" if data[:2] == b"II" else ">"
    count = _Counter("TIFF", limits)
    size: tuple[int, int] | None = None
    seen: set[int] = set()
    try:
        (offset,) = struct.unpack_from(endian + "I", data, 4)
        while offset and offset not in seen:  # each IFD is a frame; a loop ends the chain
            seen.add(offset)
            (n,) = struct.unpack_from(endian + "H", data, offset)
            count.chunk("tags", n)
            count.frame()
            if size is None:
                size = _tiff_ifd(data, endian, offset, n, count)
            (offset,) = struct.unpack_from(endian + "I", data, offset + 2 + 12 * n)
    except struct.error:
        if size is None:
            raise _truncated("TIFF", "the first IFD is cut short") from None
    if size is None:
        raise corrupt("TIFF", "no readable first IFD with ImageWidth and ImageLength")
    return Layout(size[0], size[1], count.frames)


WALKS = {"JPEG": jpeg, "PNG": png, "WEBP": webp, "GIF": gif, "BMP": bmp, "TIFF": tiff}
"""Format name -> walk(data, limits) -> Layout."""
