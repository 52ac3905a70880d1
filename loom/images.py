"""Image input and output: data URLs, signatures, our PAM decoder, Pillow codecs, limits, PNG.

A chat image part carries ``image_url.url``. ``decode_data_url`` turns it into
pixels, or raises ``ImageError``:

1. ``parse_data_url``: only ``data:<type>/<subtype>;base64,<payload>`` is
   accepted, with strict base64. Network URLs, ``file:`` URLs and paths are
   refused by name; nothing is ever fetched or read.
2. ``decode``: the byte limit; the format found in the signature bytes
   (``sniff``), which must be the declared MIME type's; the codec must be
   enabled; animated or multi-image files are refused from their container
   structure (``animated``); the header's width, height and pixel count are
   checked against the limits before any pixel is decoded; then the pixels.

PAM (``image/x-portable-arbitrarymap``) is decoded here, without Pillow, in
every build. PNG, JPEG, GIF and WebP go through Pillow; each can be switched
off through ``codecs``. Every result is uint8 RGB (H, W, 3) or RGBA (H, W, 4)
with straight alpha, plus a ``Source`` (format, size, mode, sha256 of the
compressed bytes) whose ``identity()`` names the image in conversation
identity.

``encode_png`` writes image-generation results: same array, same bytes.

Decisions, each explained where it is made: PAM trailing bytes reject (Netpbm
reads them as a further image), while PNG after IEND and JPEG after EOI are
left to Pillow, which ignores them as viewers do; EXIF orientation is applied,
and the size reported is the upright picture's; 16-bit PNG samples keep their
high byte; ICC profiles and gAMA are not applied. Animation is read from the
container (APNG's acTL, WebP's VP8X flag and ANIM/ANMF chunks, GIF's image
descriptors, JPEG's MPF index), with Pillow's frame count behind it.

This module knows no HTTP and no device: an ``ImageError`` carries a stable
code (statuses in errors.STATUS) and the param the caller names (the JSON path
of the url, e.g. ``messages[0].content[1].image_url.url``). Decoding runs on a
worker thread: numpy and Pillow's decoders release the GIL.
"""
from __future__ import annotations

import binascii
import hashlib
import io
import re
import struct
from dataclasses import dataclass

import numpy as np
from PIL import GifImagePlugin, Image, JpegImagePlugin, PngImagePlugin, WebPImagePlugin, features

from .errors import Problem

__all__ = ["ImageError", "Limits", "Source", "DecodedImage", "parse_data_url", "sniff", "animated",
           "decode_pam", "decode", "decode_data_url", "encode_png", "CODECS", "FORMATS", "MIME_TYPES",
           "PIXELS_CEILING", "Probe", "probe", "probe_data_url"]

CODECS = ("png", "jpeg", "gif", "webp")      # Pillow's, each switchable off
FORMATS = CODECS + ("pam",)                  # PAM is ours and always on
NAMES = {"png": "PNG", "jpeg": "JPEG", "gif": "GIF", "webp": "WebP", "pam": "PAM"}
MIME_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp",
              "pam": "image/x-portable-arbitrarymap"}
# Declared type -> format. image/jpg is not registered, but clients send it for JPEG files.
_DECLARED = {**{mime: fmt for fmt, mime in MIME_TYPES.items()}, "image/jpg": "jpeg"}

# Codecs this Pillow was built with; one it lacks answers as disabled.
_BUILT = {"png": features.check_codec("zlib"), "jpeg": features.check_codec("jpg"), "gif": True,
          "webp": features.check_module("webp")}

# Limits.max_pixels may not exceed this. Pillow's own decompression-bomb guard
# (Image.MAX_IMAGE_PIXELS, about 89 M pixels, which this module leaves alone)
# then never decides before our limit does, and never warns for an image we accept.
PIXELS_CEILING = 1 << 26


class ImageError(Problem):
    """An image that cannot become the model's input; param is the url's JSON path."""

    code = "invalid_image"

    def __init__(self, message, code=None, param=None):
        super().__init__(message, code, param)


@dataclass(frozen=True)
class Limits:
    """What a source accepts (its policy declares these): compressed bytes, the larger
    side, and width x height. Checked before decoding; the defaults suit tests and demos."""

    max_bytes: int = 20 << 20
    max_dimension: int = 8192
    max_pixels: int = 1 << 25

    def __post_init__(self):
        for name in ("max_bytes", "max_dimension", "max_pixels"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, not {value!r}")
        if self.max_pixels > PIXELS_CEILING:
            raise ValueError(f"Limits.max_pixels {self.max_pixels} is over the ceiling {PIXELS_CEILING}")


@dataclass(frozen=True)
class Source:
    """What the decoded image resolved to. width and height are the pixels' (after EXIF
    orientation), mode "RGB" or "RGBA", sha256 the hex digest of the compressed bytes."""

    format: str
    width: int
    height: int
    mode: str
    sha256: str

    @property
    def has_alpha(self) -> bool:
        return self.mode == "RGBA"

    def identity(self) -> bytes:
        """Stable bytes naming this image: equal exactly when the bytes, and what they
        were resolved to, are equal. No field holds a colon, so the join is unambiguous."""
        return f"{self.format}:{self.width}x{self.height}:{self.mode}:{self.sha256}".encode("ascii")


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """pixels: read-only C-contiguous uint8 (height, width, 3 or 4)."""

    pixels: np.ndarray
    source: Source

    def identity(self) -> bytes:
        return self.source.identity()


def _accepted(codecs=CODECS):
    names = [MIME_TYPES[f] for f in FORMATS if f == "pam" or f in codecs]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _brief(text, limit=40):
    """A prefix of untrusted text for a message: never the whole payload."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _too_large(nbytes, limits, param):
    return ImageError(f"the image is {nbytes} bytes; this model accepts at most {limits.max_bytes}",
                      "image_too_large", param)


# --- Data URLs -------------------------------------------------------------------------

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_NETWORK = {"http", "https", "ftp", "ftps", "sftp", "ws", "wss", "gopher", "s3", "gs", "blob"}
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_EXAMPLE = "data:image/png;base64,..."


def parse_data_url(url, *, param=None, max_bytes=None) -> tuple[str, bytes]:
    """(mime type in lower case, decoded bytes) of ``data:<type>/<subtype>;base64,<payload>``.

    Nothing else is accepted: no other media-type parameters, no percent-encoded data,
    no whitespace, only the standard base64 alphabet with canonical padding (a length
    that is a multiple of 4, at most two "=", zero bits after the last byte), so each
    image has one spelling. max_bytes, when given, refuses a payload from its length,
    before decoding it."""
    if not isinstance(url, str):
        raise ImageError(f"image_url.url must be a string ({_EXAMPLE})", "invalid_image_url", param)
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else None
    if scheme != "data":
        if scheme is None or len(scheme) == 1:  # "photo.png", "/tmp/x.png", "C:\\x.png"
            why = "it looks like a file path, and the server never reads image files"
        elif scheme == "file":
            why = "the server never reads image files"
        elif scheme in _NETWORK:
            why = f"the server never fetches {scheme}: URLs"
        else:
            why = f"{scheme}: URLs are not accepted"
        raise ImageError(f"image URLs must be base64 data URLs ({_EXAMPLE}), not {_brief(url)}: {why}",
                         "unsupported_image_url", param)
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError(f"the data URL {_brief(url)} has no ',' before its data", "invalid_image_url", param)
    parts = header.split(";")
    if parts[-1].lower() != "base64":
        raise ImageError(f"the data URL {_brief(url)} is not base64: only {_EXAMPLE} is accepted",
                         "invalid_image_url", param)
    if len(parts) != 2 or not _MEDIA_TYPE.fullmatch(parts[0]):
        raise ImageError(f"the data URL {_brief(url)} must name exactly one media type, as in {_EXAMPLE}",
                         "invalid_image_url", param)
    if not payload.isascii() or len(payload) % 4 or not _BASE64.fullmatch(payload):
        raise ImageError("the data URL's payload is not valid base64: only A-Z, a-z, 0-9, '+' and '/', "
                         "padded with '=' to a multiple of 4 characters, without whitespace",
                         "invalid_image_url", param)
    padding = len(payload) - len(payload.rstrip("="))
    size = len(payload) // 4 * 3 - padding
    if max_bytes is not None and size > max_bytes:
        raise ImageError(f"the image is {size} bytes; this model accepts at most {max_bytes}",
                         "image_too_large", param)
    # With one "=" the last character carries 2 unused bits, with two 4; they must be zero.
    if padding and _ALPHABET.index(payload[-padding - 1]) & (0x3 if padding == 1 else 0xF):
        raise ImageError("the data URL's base64 is not canonical: nonzero bits after the last byte",
                         "invalid_image_url", param)
    try:
        data = binascii.a2b_base64(payload, strict_mode=True)
    except binascii.Error as e:  # the checks above leave nothing for it to find; kept as a guard
        raise ImageError(f"the data URL's payload is not valid base64: {e}", "invalid_image_url", param) from e
    return parts[0].lower(), data


# --- Signatures ----------------------------------------------------------------------

_PNG = b"\x89PNG\r\n\x1a\n"

# Formats recognised only to refuse them by name.
_REFUSED = [
    (b"BM", "BMP"), (b"II*\0", "TIFF"), (b"MM\0*", "TIFF"), (b"\0\0\1\0", "ICO"), (b"qoif", "QOI"),
    (b"8BPS", "Photoshop (PSD)"), (b"%PDF", "PDF"), (b"\xff\x0a", "JPEG XL"),
    (b"\0\0\0\x0cJXL \r\n\x87\n", "JPEG XL"), (b"\0\0\0\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"<svg", "SVG"), (b"<?xml", "XML/SVG"), (b"P7 332", "XV thumbnail"),
] + [(b"P%d" % n, "Netpbm P1-P6 (PBM/PGM/PPM)") for n in range(1, 7)]


def _sniff(data, param, codecs):
    head = bytes(data[:32])
    if not head:
        raise ImageError("the image is empty", "invalid_image", param)
    if head.startswith(_PNG):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith(b"P7\n"):
        return "pam"
    found = next((name for magic, name in _REFUSED if head.startswith(magic)), None)
    if found is None and head[4:8] == b"ftyp":
        found = f"HEIF/AVIF/MP4 (brand {head[8:12].decode('latin-1')!r})"
    what = f"{found} images are not accepted" if found else \
        f"the image is not in a known format (it starts with bytes {head[:8].hex(' ')})"
    raise ImageError(f"{what}: send {_accepted(codecs)}", "unsupported_image", param)


def sniff(data: bytes, param=None) -> str:
    """The format by its signature bytes alone: "png", "jpeg", "gif", "webp" or "pam"
    (P7 and a newline). Anything else raises ImageError, naming it when known."""
    return _sniff(data, param, CODECS)


def _png_chunks(data):
    """(type, offset of data, length) of each whole chunk, up to and including IDAT or IEND."""
    pos = len(_PNG)
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if pos + 12 + length > len(data):
            return
        yield kind, pos + 8, length
        if kind in (b"IDAT", b"IEND"):
            return
        pos += 12 + length


def _riff_chunks(data):
    """(fourcc, offset of data, length) of each whole chunk of a RIFF/WEBP file."""
    pos = 12
    while pos + 8 <= len(data):
        kind, length = struct.unpack_from("<4sI", data, pos)
        if pos + 8 + length > len(data):
            return
        yield kind, pos + 8, length
        pos += 8 + length + (length & 1)


def _gif_frames(data, stop=2):
    """How many image descriptors a GIF holds, counting at most `stop`: the block
    structure is walked without decoding anything. A malformed structure ends the count
    (Pillow then judges the file)."""
    if len(data) < 13:
        return 0
    flags, pos, frames = data[10], 13, 0
    if flags & 0x80:
        pos += 3 << ((flags & 7) + 1)
    while pos < len(data) and frames < stop:
        block = data[pos]
        if block == 0x21:      # extension: a label, then data sub-blocks
            pos += 2
        elif block == 0x2C:    # image descriptor, optional local colour table, LZW code size
            if pos + 10 > len(data):
                break
            frames += 1
            local = data[pos + 9]
            pos += 10 + ((3 << ((local & 7) + 1)) if local & 0x80 else 0) + 1
        else:                  # the trailer, or not a GIF block
            break
        while pos < len(data) and data[pos]:   # sub-blocks end at a zero length
            pos += data[pos] + 1
        pos += 1
    return frames


def animated(data: bytes, fmt: str) -> bool:
    """Whether the container holds an animation, from its structure alone: an APNG
    (an acTL chunk before IDAT, whatever its frame count), a WebP with the VP8X
    animation flag or ANIM/ANMF chunks, or a GIF with more than one image."""
    if fmt == "png":
        return any(kind == b"acTL" for kind, _, _ in _png_chunks(data))
    if fmt == "webp":
        for kind, at, length in _riff_chunks(data):
            if kind in (b"ANIM", b"ANMF") or (kind == b"VP8X" and length and data[at] & 0x02):
                return True
        return False
    if fmt == "gif":
        return _gif_frames(data) > 1
    return False


# --- Limits --------------------------------------------------------------------------

def _check_size(width, height, limits, param, name):
    """The header's geometry against the limits, before any pixel is decoded."""
    if width <= 0 or height <= 0:
        raise ImageError(f"the {name} header states a size of {width}x{height}", "invalid_image", param)
    if max(width, height) > limits.max_dimension:
        raise ImageError(f"the image is {width}x{height}; this model accepts at most "
                         f"{limits.max_dimension} pixels a side", "image_dimensions_too_large", param)
    if width * height > limits.max_pixels:
        raise ImageError(f"the image is {width}x{height} ({width * height} pixels); this model accepts "
                         f"at most {limits.max_pixels} pixels", "image_too_many_pixels", param)


# --- PAM -----------------------------------------------------------------------------

# Tuple type -> (depth, has alpha, MAXVAL must be 1). Netpbm's PAM specification.
_TUPLES = {b"BLACKANDWHITE": (1, False, True), b"GRAYSCALE": (1, False, False), b"RGB": (3, False, False),
           b"BLACKANDWHITE_ALPHA": (2, True, True), b"GRAYSCALE_ALPHA": (2, True, False),
           b"RGB_ALPHA": (4, True, False)}
_PAM_FIELDS = (b"WIDTH", b"HEIGHT", b"DEPTH", b"MAXVAL", b"TUPLTYPE")
_DECIMAL = re.compile(rb"[0-9]{1,10}")


def _pam_header(data, param):
    """The header's fields and where the raster starts.

    After "P7\\n", lines end with "\\n"; a line starting with "#" is a comment and a
    line of only whitespace is empty. Every other line is a tag and one value: WIDTH,
    HEIGHT, DEPTH, MAXVAL and TUPLTYPE exactly once each (Netpbm lets TUPLTYPE repeat
    and be absent; we take one of the six standard types), then ENDHDR."""
    def bad(why):
        return ImageError(f"malformed PAM header: {why}", "invalid_image", param)

    fields, pos = {}, 3
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            raise bad("it ends before ENDHDR")
        line, pos = data[pos:end], end + 1
        if line.startswith(b"#"):
            continue
        tokens = line.split()
        if not tokens:
            continue
        tag = tokens[0]
        if tag == b"ENDHDR":
            if len(tokens) != 1:
                raise bad("ENDHDR takes no value")
            break
        if tag not in _PAM_FIELDS:
            raise bad(f"unknown header line {_brief(line.decode('latin-1'), 24)}")
        if tag in fields:
            raise bad(f"{tag.decode()} appears twice")
        if len(tokens) != 2:
            raise bad(f"{tag.decode()} takes exactly one value")
        fields[tag] = tokens[1]
    missing = [t.decode() for t in _PAM_FIELDS if t not in fields]
    if missing:
        raise bad(f"no {', '.join(missing)}")
    numbers = {}
    for tag in (b"WIDTH", b"HEIGHT", b"DEPTH", b"MAXVAL"):
        if not _DECIMAL.fullmatch(fields[tag]):
            raise bad(f"{tag.decode()} {_brief(fields[tag].decode('latin-1'), 12)} is not a decimal number")
        numbers[tag.decode().lower()] = int(fields[tag])
    if fields[b"TUPLTYPE"] not in _TUPLES:
        raise ImageError(f"PAM tuple type {_brief(fields[b'TUPLTYPE'].decode('latin-1'), 24)} is not "
                         f"supported: use one of {', '.join(t.decode() for t in _TUPLES)}",
                         "unsupported_image", param)
    depth, alpha, binary = _TUPLES[fields[b"TUPLTYPE"]]
    tupltype = fields[b"TUPLTYPE"].decode()
    if numbers["depth"] != depth:
        raise bad(f"TUPLTYPE {tupltype} has depth {depth}, not {numbers['depth']}")
    if not 1 <= numbers["maxval"] <= 65535:
        raise bad(f"MAXVAL {numbers['maxval']} is not from 1 to 65535")
    if binary and numbers["maxval"] != 1:
        raise bad(f"TUPLTYPE {tupltype} requires MAXVAL 1, not {numbers['maxval']}")
    return numbers["width"], numbers["height"], depth, numbers["maxval"], alpha, pos


def _scale_table(maxval):
    """round(v * 255 / maxval) for every v in 0..maxval, halves rounded up, in exact
    integers: floor((510 v + maxval) / (2 maxval))."""
    v = np.arange(maxval + 1, dtype=np.int64)
    return ((510 * v + maxval) // (2 * maxval)).astype(np.uint8)


def decode_pam(data: bytes, limits: Limits = Limits(), param=None) -> tuple[np.ndarray, bool]:
    """(pixels, has alpha) of a PAM file: uint8 RGB (H, W, 3) or RGBA (H, W, 4).

    Samples are one byte, or two big-endian bytes when MAXVAL > 255; each must be at
    most MAXVAL and is scaled by round(v * 255 / MAXVAL). Gray and black-and-white
    become RGB; alpha stays straight (PAM's alpha is not premultiplied). The raster
    must be exactly the header's size: short data rejects, and so do trailing bytes,
    which Netpbm reads as a further image of the same stream (multi-image input)."""
    width, height, depth, maxval, alpha, start = _pam_header(data, param)
    _check_size(width, height, limits, param, "PAM")
    itemsize = 2 if maxval > 255 else 1
    expected = width * height * depth * itemsize
    got = len(data) - start
    if got < expected:
        raise ImageError(f"the PAM raster is {got} bytes; its header describes {expected}", "invalid_image", param)
    if got > expected:
        if data[start + expected:start + expected + 3] == b"P7\n":
            raise ImageError("the PAM file holds more than one image; send one image per part",
                             "animated_image", param)
        raise ImageError(f"the PAM file has {got - expected} bytes after its raster", "invalid_image", param)
    samples = np.frombuffer(data, ">u2" if itemsize == 2 else np.uint8, width * height * depth, start)
    samples = samples.reshape(height, width, depth)
    top = int(samples.max())
    if top > maxval:
        raise ImageError(f"a PAM sample is {top}, above MAXVAL {maxval}", "invalid_image", param)
    scaled = samples if maxval == 255 else _scale_table(maxval)[samples]
    if depth in (1, 2):   # gray (and alpha): the gray level in each of R, G and B
        scaled = scaled[:, :, [0, 0, 0, 1] if alpha else [0, 0, 0]]
    return np.ascontiguousarray(scaled, dtype=np.uint8), alpha


# --- Pillow codecs -------------------------------------------------------------------

def _webp_canvas(data):
    """The canvas size in a WebP's first chunk, read before Pillow (its decoder
    allocates the canvas the moment it is created); None when it cannot be read."""
    kind = data[12:16]
    if kind == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack_from("<HH", data, 26)
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X" and len(data) >= 30:
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _open_jpeg(fp):
    """Pillow's JPEG factory: it reads the MPF index (CIPA DC-007) and returns an
    MpoImageFile when the file holds further pictures."""
    return JpegImagePlugin.jpeg_factory(fp)


# The format's own plugin class, constructed directly: Image.open would try it the
# same way, but it also tries other formats and runs the global bomb check that this
# module's limits replace. Construction reads the header only.
_OPEN = {"png": PngImagePlugin.PngImageFile, "jpeg": _open_jpeg, "gif": GifImagePlugin.GifImageFile,
         "webp": WebPImagePlugin.WebPImageFile}

# EXIF orientation -> the numpy view that shows the picture upright (EXIF 2.32 4.6.4,
# the same transforms as Pillow's ImageOps.exif_transpose).
_ORIENT = {
    2: lambda a: a[:, ::-1],                        # mirrored left-right
    3: lambda a: a[::-1, ::-1],                     # rotated 180
    4: lambda a: a[::-1],                           # mirrored top-bottom
    5: lambda a: a.transpose(1, 0, 2),              # mirrored along the main diagonal
    6: lambda a: a[::-1].transpose(1, 0, 2),        # needs 90 degrees clockwise
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # mirrored along the other diagonal
    8: lambda a: a[:, ::-1].transpose(1, 0, 2),     # needs 90 degrees counter-clockwise
}


def _keyed(values, key):
    """RGBA from gray or RGB values and a tRNS colour key: alpha 0 exactly where every
    channel equals the key."""
    if values.ndim == 2:
        values = values[:, :, None]
    keys = np.atleast_1d(np.asarray(key, dtype=np.int64))
    alpha = np.where((values == keys).all(axis=2), 0, 255).astype(np.uint8)
    rgb = values.astype(np.uint8) if values.shape[2] == 3 else np.repeat(values.astype(np.uint8), 3, axis=2)
    return np.dstack([rgb, alpha])


def _pixels(im, fmt, data, param):
    """The loaded Pillow image as uint8 RGB or RGBA with straight alpha.

    Palette images with transparency become RGBA, others RGB; gray becomes RGB; CMYK
    becomes RGB through Pillow's conversion (JPEG's Adobe inversion is undone by
    Pillow's decoder). 16-bit PNG samples keep their most significant byte, v >> 8,
    which is what Pillow's decoder gives 16-bit colour PNGs and what libpng's
    strip_16 does, so gray and colour 16-bit PNGs agree; it is within one level of
    round(v * 255 / 65535). A tRNS colour key makes RGBA, alpha 0 where it matches.
    Colour management (ICC profiles, gAMA) is not applied: samples are taken as sRGB."""
    mode, key = im.mode, im.info.get("transparency")
    depth = data[24] if fmt == "png" else 8   # IHDR's bit depth; IHDR is the first chunk
    if mode == "P":
        return np.asarray(im.convert("RGB" if key is None else "RGBA"))
    if mode in ("RGBA", "LA"):
        return np.asarray(im.convert("RGBA"))
    if mode == "CMYK":
        return np.asarray(im.convert("RGB"))
    if mode in ("1", "L", "RGB"):
        values = np.asarray(im.convert("L") if mode == "1" else im)   # "1" is 0 / 255, like its key
        if key is None:
            return values if mode == "RGB" else np.repeat(values[:, :, None], 3, axis=2)
        if mode == "RGB" and depth == 16:
            # Pillow keeps only the high bytes of 16-bit colour, so a 16-bit key cannot be matched.
            raise ImageError("16-bit RGB PNGs with a tRNS colour key are not supported: "
                             "send the image with an alpha channel instead", "unsupported_image", param)
        if mode == "L" and depth in (1, 2, 4):
            key = key * 255 // ((1 << depth) - 1)   # Pillow scales low-depth gray samples to 0..255
        return _keyed(values, key)
    if mode.startswith("I;16"):
        values = np.asarray(im).astype(np.uint16)
        if key is not None:
            keyed = _keyed(values, key)
            keyed[:, :, :3] = (values >> 8).astype(np.uint8)[:, :, None]
            return keyed
        return np.repeat((values >> 8).astype(np.uint8)[:, :, None], 3, axis=2)
    raise ImageError(f"the {NAMES[fmt]} decodes to Pillow mode {mode}, which is not converted: "
                     f"send an RGB, RGBA, gray or palette image", "unsupported_image", param)


def _decode_pillow(data, fmt, limits, param):
    name = NAMES[fmt]
    if fmt == "png" and data[8:16] != b"\0\0\0\x0dIHDR":
        # The PNG specification's first chunk; _pixels reads the bit depth from it.
        raise ImageError("the PNG does not start with its IHDR chunk", "invalid_image", param)
    if fmt == "webp":
        canvas = _webp_canvas(data)
        if canvas is None:
            raise ImageError("the WebP header is truncated or malformed", "invalid_image", param)
        _check_size(*canvas, limits, param, name)
    try:
        im = _OPEN[fmt](io.BytesIO(data))
    except Image.DecompressionBombError as e:   # Pillow's own guard, under ours: same answer
        raise ImageError(f"the image is too large: {e}", "image_too_many_pixels", param) from e
    except Exception as e:
        raise _undecodable(name, e, param) from e
    try:
        width, height = im.size
        _check_size(width, height, limits, param, name)
        if isinstance(im, JpegImagePlugin.JpegImageFile) and hasattr(im, "mpinfo"):
            # An MPO: refuse stereo, multi-angle and panorama sets. Large previews and
            # gain maps (Ultra HDR) are further pictures of the same one and are ignored,
            # as viewers do: the primary image is decoded.
            entries = im.mpinfo.get(0xB002, [])[1:]
            if any(str(e["Attribute"]["MPType"]).startswith("Multi-Frame") for e in entries):
                raise ImageError(f"the JPEG is a multi-picture (MPO) set of {im.n_frames} images; "
                                 f"send one image", "animated_image", param)
        elif getattr(im, "is_animated", False):   # behind animated(): Pillow's own count
            raise ImageError(f"animated {name} images are not accepted: send one frame",
                             "animated_image", param)
        im.load()
        if im.size != (width, height):
            raise ImageError(f"the {name} changed size while decoding", "invalid_image", param)
        pixels = _pixels(im, fmt, data, param)
        orientation = im.getexif().get(0x0112) if fmt != "gif" else None
    except ImageError:
        raise
    except Exception as e:
        raise _undecodable(name, e, param) from e
    finally:
        im.close()
    if pixels.dtype != np.uint8 or pixels.shape[:2] != (height, width) or pixels.shape[2] not in (3, 4):
        raise ImageError(f"the {name} decoded to {pixels.dtype} {pixels.shape}, not {height}x{width} pixels",
                         "invalid_image", param)
    # Values outside 1..8 (cameras write 0) mean "as stored", as for Pillow and browsers.
    if orientation in _ORIENT:
        pixels = _ORIENT[orientation](pixels)
    return pixels


def _undecodable(name, e, param):
    detail = str(e) or type(e).__name__
    return ImageError(f"the file looks like {name} but cannot be decoded: {detail[:200]}", "invalid_image", param)


# --- Decoding ------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """What an image's header says, before any pixel is decoded: the format, the upright
    width and height (EXIF orientation applied), and the sha256 hex digest of the bytes."""

    format: str
    width: int
    height: int
    sha256: str

    def identity(self) -> bytes:
        return f"{self.format}:{self.width}x{self.height}:{self.sha256}".encode("ascii")


def _screened(data, mime, limits, codecs, param):
    """The checks that need no pixels (decode's first five, in its order) -> the format."""
    unknown = set(codecs) - set(CODECS)
    if unknown:
        raise ValueError(f"unknown image codecs {sorted(unknown)}: the codecs are {CODECS}")
    if len(data) > limits.max_bytes:
        raise _too_large(len(data), limits, param)
    declared = _DECLARED.get(mime.lower() if isinstance(mime, str) else None)
    if declared is None:
        raise ImageError(f"{_brief(str(mime))} is not an accepted image type: send {_accepted(codecs)}",
                         "unsupported_image", param)
    fmt = _sniff(data, param, codecs)
    if fmt != declared:
        raise ImageError(f"the data URL declares {mime} but the bytes are {NAMES[fmt]}: declare "
                         f"{MIME_TYPES[fmt]}", "image_mime_mismatch", param)
    if fmt != "pam" and not (fmt in codecs and _BUILT[fmt]):
        raise ImageError(f"{NAMES[fmt]} decoding is disabled on this server: send {_accepted(codecs)}",
                         "image_codec_disabled", param)
    if animated(data, fmt):
        raise ImageError(f"animated {NAMES[fmt]} images are not accepted: send one frame",
                         "animated_image", param)
    return fmt


def probe(data: bytes, mime: str, *, limits: Limits = Limits(), codecs=CODECS, param=None) -> Probe:
    """decode's checks up to the header's size against the limits, without decoding a
    pixel: enough to count an image's positions and name it. decode can still refuse
    bytes whose header passes (a broken raster: invalid_image)."""
    data = bytes(data)
    fmt = _screened(data, mime, limits, codecs, param)
    digest = hashlib.sha256(data).hexdigest()
    if fmt == "pam":
        width, height = _pam_header(data, param)[:2]
        _check_size(width, height, limits, param, "PAM")
        return Probe(fmt, width, height, digest)
    if fmt == "webp":
        canvas = _webp_canvas(data)
        if canvas is None:
            raise ImageError("the WebP header is truncated or malformed", "invalid_image", param)
        _check_size(*canvas, limits, param, NAMES[fmt])
    try:
        im = _OPEN[fmt](io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large: {e}", "image_too_many_pixels", param) from e
    except Exception as e:
        raise _undecodable(NAMES[fmt], e, param) from e
    try:
        width, height = im.size
        _check_size(width, height, limits, param, NAMES[fmt])
        # PNG's EXIF may follow the image data, and Pillow decodes the pixels to reach it.
        orientation = _png_orientation(data) if fmt == "png" else \
            im.getexif().get(0x0112) if fmt != "gif" else None
    except ImageError:
        raise
    except Exception as e:
        raise _undecodable(NAMES[fmt], e, param) from e
    finally:
        im.close()
    if orientation in (5, 6, 7, 8):     # a quarter turn: the upright picture is the other way round
        width, height = height, width
    return Probe(fmt, width, height, digest)


def _png_orientation(data):
    """The EXIF orientation of a PNG's eXIf chunk, wherever it is, or None."""
    pos = len(_PNG)
    while pos + 12 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"eXIf" and pos + 8 + length <= len(data):
            exif = Image.Exif()
            exif.load(data[pos + 8:pos + 8 + length])
            return exif.get(0x0112)
        if kind == b"IEND":
            return None
        pos += 12 + length
    return None


def probe_data_url(url, *, limits: Limits = Limits(), codecs=CODECS, param=None) -> tuple[Probe, str, bytes]:
    """parse_data_url, then probe -> (probe, mime, bytes): the bytes to decode later."""
    mime, data = parse_data_url(url, param=param, max_bytes=limits.max_bytes)
    return probe(data, mime, limits=limits, codecs=codecs, param=param), mime, data


def decode(data: bytes, mime: str, *, limits: Limits = Limits(), codecs=CODECS, param=None) -> DecodedImage:
    """An image's bytes, as declared by `mime`, as pixels and their Source.

    In order: more than limits.max_bytes rejects (image_too_large); the declared type
    must be a known image type (unsupported_image), the signature a known format
    (unsupported_image) and the declared type's (image_mime_mismatch); the codec must
    be in `codecs` and built (image_codec_disabled; PAM needs none); animated and
    multi-image files reject (animated_image); the header's size against the limits
    (image_dimensions_too_large, image_too_many_pixels), before any pixel is decoded;
    then broken bytes reject as invalid_image. Nothing else is raised. EXIF orientation
    is applied (the width and height reported are the upright picture's)."""
    data = bytes(data)
    fmt = _screened(data, mime, limits, codecs, param)
    if fmt == "pam":
        pixels, _ = decode_pam(data, limits, param)
    else:
        pixels = _decode_pillow(data, fmt, limits, param)
    pixels = np.ascontiguousarray(pixels)
    pixels.flags.writeable = False
    height, width, channels = pixels.shape
    source = Source(fmt, width, height, "RGBA" if channels == 4 else "RGB", hashlib.sha256(data).hexdigest())
    return DecodedImage(pixels, source)


def decode_data_url(url, *, limits: Limits = Limits(), codecs=CODECS, param=None) -> DecodedImage:
    """parse_data_url, then decode: an image part's url as pixels."""
    mime, data = parse_data_url(url, param=param, max_bytes=limits.max_bytes)
    return decode(data, mime, limits=limits, codecs=codecs, param=param)


# --- PNG output ------------------------------------------------------------------------

def encode_png(pixels: np.ndarray) -> bytes:
    """uint8 RGB (H, W, 3) or RGBA (H, W, 4) as PNG bytes. Deterministic: a fixed
    compression level and no metadata chunks (no time, text or physical size), so the
    same array always gives the same bytes."""
    a = np.asarray(pixels)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] not in (3, 4) or 0 in a.shape[:2]:
        raise ValueError(f"encode_png takes uint8 (height, width, 3 or 4), not {a.dtype} {a.shape}")
    height, width, channels = a.shape
    im = Image.frombytes("RGBA" if channels == 4 else "RGB", (width, height), np.ascontiguousarray(a).tobytes())
    out = io.BytesIO()
    im.save(out, "PNG", compress_level=6, optimize=False)
    return out.getvalue()
