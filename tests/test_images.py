"""Image input and output (loom/images.py): data URLs, signatures, PAM, Pillow codecs, limits, PNG.

Files are real ones written by Pillow, or built byte by byte below where Pillow
cannot write them (16-bit colour PNGs, colour keys, low bit depths, lying
headers, every PAM). Expected pixels come from the source arrays through
numpy written here, never from the decoder under test.
"""
import base64
import dataclasses
import hashlib
import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import GifImagePlugin, Image, ImageFile, ImageOps, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from loom import images
from loom.errors import Error, STATUS
from loom.images import ImageError, Limits, decode, decode_data_url, decode_pam, encode_png, parse_data_url, sniff

RNG = np.random.default_rng(20250101)
PARAM = "messages[0].content[1].image_url.url"
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAM_MIME = "image/x-portable-arbitrarymap"


def rejects(code, status, fn, *args, **kwargs):
    """fn(*args, param=PARAM) raises ImageError `code` with PARAM, answered with `status`."""
    kwargs.setdefault("param", PARAM)
    with pytest.raises(ImageError) as info:
        fn(*args, **kwargs)
    e = info.value
    assert e.code == code, e.message
    assert e.param == PARAM
    assert Error.of(e).status == status == STATUS[code]
    return e.message


def decoded(data, mime, **kwargs):
    image = decode(data, mime, param=PARAM, **kwargs)
    p = image.pixels
    assert p.dtype == np.uint8 and p.ndim == 3 and p.flags.c_contiguous and not p.flags.writeable
    assert image.source.mode == ("RGBA" if p.shape[2] == 4 else "RGB")
    assert (image.source.height, image.source.width) == p.shape[:2]
    return p


def gradient(h, w, channels):
    """A smooth image (JPEG keeps it within a few levels) with a little structure."""
    y, x = np.mgrid[0:h, 0:w]
    planes = [(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 255 // max(1, h + w - 2)),
              np.full((h, w), 200)]
    return np.stack(planes[:channels], axis=2).astype(np.uint8)


def pillow(array, fmt, mode=None, **save):
    a = np.asarray(array)
    im = Image.frombytes(mode or {1: "L", 3: "RGB", 4: "RGBA"}[a.shape[2] if a.ndim == 3 else 1],
                         (a.shape[1], a.shape[0]), np.ascontiguousarray(a).tobytes())
    out = io.BytesIO()
    im.save(out, fmt, **save)
    return out.getvalue()


def gray_rgb(g):
    return np.repeat(np.asarray(g)[:, :, None], 3, axis=2)


# --- PNG and PAM built by hand --------------------------------------------------------

def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(samples, depth, color_type, before_idat=(), ihdr_size=None):
    """A PNG of (H, W, C) integer samples at `depth` bits, every row filter 0."""
    h, w = samples.shape[:2]
    rows = []
    for row in samples.reshape(h, -1):
        if depth == 16:
            raw = row.astype(">u2").tobytes()
        elif depth == 8:
            raw = row.astype(np.uint8).tobytes()
        else:
            raw = np.packbits(np.unpackbits(row.astype(np.uint8)[:, None], axis=1)[:, 8 - depth:]).tobytes()
        rows.append(b"\0" + raw)
    width, height = ihdr_size or (w, h)
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0)
    return (images._PNG + chunk(b"IHDR", ihdr) + b"".join(before_idat)
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))


def pam(samples, maxval, tupltype, header=None):
    h, w, d = samples.shape
    head = header or f"P7\nWIDTH {w}\nHEIGHT {h}\nDEPTH {d}\nMAXVAL {maxval}\nTUPLTYPE {tupltype}\nENDHDR\n"
    raster = samples.astype(">u2" if maxval > 255 else np.uint8).tobytes()
    return head.encode() + raster


def scaled(v, maxval):
    """The expectation: round(v * 255 / maxval), halves up, in float64 (exact here)."""
    return np.floor(np.asarray(v, np.float64) * 255 / maxval + 0.5).astype(np.uint8)


# --- PAM ------------------------------------------------------------------------------

PAM_TYPES = [("BLACKANDWHITE", 1, False), ("GRAYSCALE", 1, False), ("RGB", 3, False),
             ("BLACKANDWHITE_ALPHA", 2, True), ("GRAYSCALE_ALPHA", 2, True), ("RGB_ALPHA", 4, True)]


@pytest.mark.parametrize("tupltype,depth,alpha,maxval", [
    (*kind, maxval) for kind in PAM_TYPES
    for maxval in ([1] if kind[0].startswith("BLACKANDWHITE") else [1, 7, 255, 256, 1000, 65535])])
def test_pam_every_tuple_type_and_depth(tupltype, depth, alpha, maxval):
    samples = RNG.integers(0, maxval + 1, (5, 7, depth))
    samples[0, 0] = maxval   # both ends are present
    samples[0, 1] = 0
    want = scaled(samples, maxval)
    if depth in (1, 2):
        want = np.concatenate([np.repeat(want[:, :, :1], 3, axis=2), want[:, :, 1:]], axis=2)
    got = decoded(pam(samples, maxval, tupltype), PAM_MIME)
    assert got.shape == (5, 7, 4 if alpha else 3)
    assert np.array_equal(got, want)
    pixels, has_alpha = decode_pam(pam(samples, maxval, tupltype))
    assert has_alpha == alpha and np.array_equal(pixels, want)


def test_pam_scaling_is_round_half_up_over_every_sample():
    for maxval in (2, 3, 6, 100, 254, 257, 4095, 65534):
        v = np.arange(maxval + 1).reshape(1, -1, 1)
        got = decoded(pam(v, maxval, "GRAYSCALE"), PAM_MIME, limits=Limits(max_dimension=65536))[0, :, 0]
        want = [(v * 255 * 2 + maxval) // (2 * maxval) for v in range(maxval + 1)]   # exact integers
        assert got.tolist() == want
    assert decoded(pam(np.array([[[1]]]), 2, "GRAYSCALE"), PAM_MIME)[0, 0, 0] == 128   # 127.5 rounds up
    assert decoded(pam(np.array([[[1]]]), 6, "GRAYSCALE"), PAM_MIME)[0, 0, 0] == 43    # 42.5 rounds up


def test_pam_header_comments_blank_lines_and_whitespace():
    samples = RNG.integers(0, 256, (2, 3, 3))
    header = ("P7\n# made by hand\nWIDTH\t3\n\n   \nHEIGHT   2 \n#DEPTH 9\nDEPTH 3\n# a comment with \xff\n"
              "MAXVAL 255\nTUPLTYPE RGB\n# last\nENDHDR\n")
    data = header.encode("latin-1") + samples.astype(np.uint8).tobytes()
    assert np.array_equal(decoded(data, PAM_MIME), samples)
    assert np.array_equal(decoded(pam(samples, 255, "RGB", "P7\nWIDTH 0003\nHEIGHT 2\nDEPTH 3\nMAXVAL 255\n"
                                                            "TUPLTYPE RGB\nENDHDR\n"), PAM_MIME), samples)


def pam_header(**fields):
    values = {"WIDTH": "2", "HEIGHT": "2", "DEPTH": "3", "MAXVAL": "255", "TUPLTYPE": "RGB"}
    values.update(fields)
    return "P7\n" + "".join(f"{k} {v}\n" for k, v in values.items() if v is not None) + "ENDHDR\n"


MALFORMED_PAM = {
    "no ENDHDR": "P7\nWIDTH 2\nHEIGHT 2\nDEPTH 3\nMAXVAL 255\nTUPLTYPE RGB\n",
    "ENDHDR with a value": pam_header().replace("ENDHDR", "ENDHDR 1"),
    "unknown tag": pam_header() .replace("ENDHDR", "COLORS 3\nENDHDR"),
    "lower-case tag": pam_header().replace("WIDTH", "width"),
    "duplicate WIDTH": pam_header().replace("HEIGHT", "WIDTH 2\nHEIGHT"),
    "duplicate TUPLTYPE": pam_header().replace("ENDHDR", "TUPLTYPE RGB\nENDHDR"),
    "two values": pam_header(WIDTH="2 2"),
    "no value": pam_header(WIDTH=""),
    "missing WIDTH": pam_header(WIDTH=None),
    "missing HEIGHT": pam_header(HEIGHT=None),
    "missing DEPTH": pam_header(DEPTH=None),
    "missing MAXVAL": pam_header(MAXVAL=None),
    "missing TUPLTYPE": pam_header(TUPLTYPE=None),
    "negative width": pam_header(WIDTH="-2"),
    "signed width": pam_header(WIDTH="+2"),
    "hex width": pam_header(WIDTH="0x2"),
    "decimal point": pam_header(HEIGHT="2.0"),
    "width 0": pam_header(WIDTH="0"),
    "height 0": pam_header(HEIGHT="0"),
    "huge number": pam_header(WIDTH="1" * 11),
    "MAXVAL 0": pam_header(MAXVAL="0"),
    "MAXVAL 65536": pam_header(MAXVAL="65536"),
    "DEPTH disagrees": pam_header(DEPTH="4"),
    "DEPTH 1 for RGB": pam_header(DEPTH="1"),
    "BLACKANDWHITE MAXVAL 255": pam_header(DEPTH="1", TUPLTYPE="BLACKANDWHITE"),
    "BLACKANDWHITE_ALPHA MAXVAL 3": pam_header(DEPTH="2", MAXVAL="3", TUPLTYPE="BLACKANDWHITE_ALPHA"),
    "comment not at line start": pam_header().replace("ENDHDR", " # note\nENDHDR"),
}


@pytest.mark.parametrize("header", MALFORMED_PAM.values(), ids=MALFORMED_PAM.keys())
def test_pam_malformed_headers_reject(header):
    data = header.encode() + bytes(12)
    message = rejects("invalid_image", 400, decode, data, PAM_MIME)
    assert "PAM" in message


@pytest.mark.parametrize("tupltype", ["CMYK", "rgb", "RGB_ALPHA_PREMULTIPLIED", "GRAYSCALE RGB", ""])
def test_pam_unknown_tuple_types_are_unsupported(tupltype):
    header = pam_header(TUPLTYPE=tupltype)   # two values, or none, are malformed rather than unknown
    code = "invalid_image" if " " in tupltype or not tupltype else "unsupported_image"
    rejects(code, STATUS[code], decode, header.encode() + bytes(12), PAM_MIME)


def test_pam_samples_above_maxval_reject():
    samples = np.array([[[3, 1, 0]]])
    assert "above MAXVAL 2" in rejects("invalid_image", 400, decode, pam(samples, 2, "RGB"), PAM_MIME)
    samples16 = np.array([[[1000], [1001]]])
    rejects("invalid_image", 400, decode, pam(samples16, 1000, "GRAYSCALE"), PAM_MIME)
    bw = np.array([[[1, 2]]])
    rejects("invalid_image", 400, decode, pam(bw, 1, "BLACKANDWHITE_ALPHA"), PAM_MIME)


def test_pam_raster_must_be_exact():
    data = pam(RNG.integers(0, 60000, (3, 4, 3)), 60000, "RGB")
    assert len(decoded(data, PAM_MIME)) == 3
    assert "describes 72" in rejects("invalid_image", 400, decode, data[:-1], PAM_MIME)
    rejects("invalid_image", 400, decode, data[:-2], PAM_MIME)
    assert "after its raster" in rejects("invalid_image", 400, decode, data + b"\0", PAM_MIME)
    assert "after its raster" in rejects("invalid_image", 400, decode, data + b"\n", PAM_MIME)
    # Netpbm reads a second header after the raster as the next image of the stream.
    assert "more than one image" in rejects("animated_image", 415, decode, data + data, PAM_MIME)


def test_pam_header_limits_apply_before_the_raster():
    header = b"P7\nWIDTH 100000\nHEIGHT 100000\nDEPTH 4\nMAXVAL 65535\nTUPLTYPE RGB_ALPHA\nENDHDR\n"
    rejects("image_dimensions_too_large", 413, decode, header, PAM_MIME)
    limits = Limits(max_dimension=200000)
    rejects("image_too_many_pixels", 413, decode, header, PAM_MIME, limits=limits)


# --- PNG ----------------------------------------------------------------------------

def test_png_rgb_and_rgba_round_trip():
    for channels in (3, 4):
        a = RNG.integers(0, 256, (9, 13, channels), dtype=np.uint8)
        assert np.array_equal(decoded(pillow(a, "PNG"), "image/png"), a)


def test_png_gray_and_gray_alpha():
    g = RNG.integers(0, 256, (6, 5), dtype=np.uint8)
    assert np.array_equal(decoded(pillow(g, "PNG", "L"), "image/png"), gray_rgb(g))
    la = RNG.integers(0, 256, (6, 5, 2), dtype=np.uint8)
    got = decoded(pillow(la, "PNG", "LA"), "image/png")
    assert np.array_equal(got, np.dstack([gray_rgb(la[:, :, 0]), la[:, :, 1]]))


def test_png_palette_with_trns():
    palette = RNG.integers(0, 256, (16, 3), dtype=np.uint8)
    alpha = RNG.integers(0, 256, 16, dtype=np.uint8)
    index = RNG.integers(0, 16, (7, 9), dtype=np.uint8)
    im = Image.frombytes("P", (9, 7), index.tobytes())
    im.putpalette(palette.tobytes())
    for transparency, a in ((alpha.tobytes(), alpha), (3, np.where(np.arange(16) == 3, 0, 255))):
        out = io.BytesIO()
        im.save(out, "PNG", transparency=transparency)
        got = decoded(out.getvalue(), "image/png")
        assert np.array_equal(got, np.dstack([palette[index], np.asarray(a, np.uint8)[index]]))
    out = io.BytesIO()
    im.save(out, "PNG")
    assert np.array_equal(decoded(out.getvalue(), "image/png"), palette[index])


def test_png_16_bit_keeps_the_high_byte():
    v = RNG.integers(0, 65536, (4, 6, 4))
    v[0, 0] = [0, 255, 511, 65535]
    for color_type, channels in ((0, 1), (4, 2), (2, 3), (6, 4)):
        s = v[:, :, :channels]
        got = decoded(png(s, 16, color_type), "image/png")
        high = (s >> 8).astype(np.uint8)
        want = high if channels in (3, 4) else (gray_rgb(high[:, :, 0]) if channels == 1
                                                else np.dstack([gray_rgb(high[:, :, 0]), high[:, :, 1]]))
        assert np.array_equal(got, want), color_type
    # Pillow's own 16-bit gray writer gives the same.
    g = RNG.integers(0, 65536, (3, 5)).astype(np.uint16)
    out = io.BytesIO()
    Image.frombytes("I;16", (5, 3), g.astype("<u2").tobytes()).save(out, "PNG")
    assert np.array_equal(decoded(out.getvalue(), "image/png"), gray_rgb((g >> 8).astype(np.uint8)))


def test_png_low_bit_depths_scale_to_full_range():
    for depth in (1, 2, 4):
        top = (1 << depth) - 1
        s = RNG.integers(0, top + 1, (5, 11, 1))
        got = decoded(png(s, depth, 0), "image/png")
        assert np.array_equal(got, gray_rgb(scaled(s[:, :, 0], top)))


def test_png_colour_keys_become_alpha():
    rgb = RNG.integers(0, 4, (6, 6, 3))
    rgb[0, 0] = [1, 2, 3]
    got = decoded(png(rgb, 8, 2, [chunk(b"tRNS", struct.pack(">HHH", 1, 2, 3))]), "image/png")
    key = (rgb == [1, 2, 3]).all(axis=2)
    assert np.array_equal(got, np.dstack([rgb, np.where(key, 0, 255)]).astype(np.uint8))
    # Gray at 2 bits: the key is a sample value, compared before scaling.
    g = RNG.integers(0, 4, (5, 7, 1))
    got = decoded(png(g, 2, 0, [chunk(b"tRNS", struct.pack(">H", 2))]), "image/png")
    assert np.array_equal(got[:, :, 3], np.where(g[:, :, 0] == 2, 0, 255))
    assert np.array_equal(got[:, :, :3], gray_rgb(scaled(g[:, :, 0], 3)))
    # Gray at 16 bits: the full 16-bit key.
    g16 = RNG.integers(0, 3, (4, 4, 1)) * 300 + 1000
    got = decoded(png(g16, 16, 0, [chunk(b"tRNS", struct.pack(">H", 1300))]), "image/png")
    assert np.array_equal(got[:, :, 3], np.where(g16[:, :, 0] == 1300, 0, 255))
    assert np.array_equal(got[:, :, 0], (g16[:, :, 0] >> 8).astype(np.uint8))
    # 16-bit colour: Pillow keeps only the high bytes, so the key cannot be matched exactly.
    rgb16 = RNG.integers(0, 65536, (2, 2, 3))
    rejects("unsupported_image", 415, decode, png(rgb16, 16, 2, [chunk(b"tRNS", bytes(6))]), "image/png")


def test_png_first_chunk_must_be_ihdr_for_pillow_too():
    good = png(RNG.integers(0, 256, (2, 2, 3)), 8, 2)
    bad = good[:8] + chunk(b"tEXt", b"k\0v") + good[8:]
    rejects("invalid_image", 400, decode, bad, "image/png")


# --- EXIF orientation ------------------------------------------------------------------

# What each EXIF orientation asks a viewer to do, written out independently.
UPRIGHT = {1: lambda a: a, 2: np.fliplr, 3: lambda a: np.rot90(a, 2), 4: np.flipud,
           5: lambda a: np.rot90(np.fliplr(a), 1), 6: lambda a: np.rot90(a, -1),
           7: lambda a: np.rot90(np.fliplr(a), -1), 8: lambda a: np.rot90(a, 1)}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation):
    a = RNG.integers(0, 256, (4, 7, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = pillow(a, "PNG", exif=exif.tobytes())
    got = decode(data, "image/png", param=PARAM)
    want = UPRIGHT[orientation](a)
    assert np.array_equal(got.pixels, want)
    assert (got.source.height, got.source.width) == want.shape[:2]
    # Pillow's ImageOps.exif_transpose agrees.
    assert np.array_equal(got.pixels, np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))))


def test_exif_orientation_in_jpeg_and_out_of_range_values():
    a = gradient(16, 32, 3)
    exif = Image.Exif()
    exif[0x0112] = 6
    got = decoded(pillow(a, "JPEG", quality=95, exif=exif.tobytes()), "image/jpeg")
    assert got.shape == (32, 16, 3)
    assert np.abs(got.astype(int) - np.rot90(a, -1)).max() < 12
    for odd in (0, 9, 65535):
        exif[0x0112] = odd
        assert decoded(pillow(a, "PNG", exif=exif.tobytes()), "image/png").shape == (16, 32, 3)


# --- JPEG, GIF, WebP --------------------------------------------------------------------

def test_jpeg_rgb_gray_and_cmyk():
    a = gradient(24, 40, 3)
    got = decoded(pillow(a, "JPEG", quality=95), "image/jpeg")
    assert got.shape == a.shape and np.abs(got.astype(int) - a).mean() < 2 and np.abs(got.astype(int) - a).max() < 12
    g = a[:, :, 0]
    got = decoded(pillow(g, "JPEG", "L", quality=95), "image/jpeg")
    assert np.array_equal(got[:, :, 0], got[:, :, 1]) and np.array_equal(got[:, :, 0], got[:, :, 2])
    assert np.abs(got[:, :, 0].astype(int) - g).max() < 8
    cmyk = gradient(24, 40, 4)
    cmyk[:, :, 3] = np.arange(40, dtype=np.uint8)[None, :] * 2
    got = decoded(pillow(cmyk, "JPEG", "CMYK", quality=95), "image/jpeg")
    c = cmyk.astype(np.float64)
    want = (255 - c[:, :, :3]) * (255 - c[:, :, 3:]) / 255   # the usual CMYK -> RGB
    assert got.shape == (24, 40, 3) and np.abs(got - want).mean() < 3 and np.abs(got - want).max() < 16


def test_gif_single_frame():
    palette = RNG.integers(0, 256, (32, 3), dtype=np.uint8)
    index = RNG.integers(0, 32, (9, 11), dtype=np.uint8)
    im = Image.frombytes("P", (11, 9), index.tobytes())
    im.putpalette(palette.tobytes())
    out = io.BytesIO()
    im.save(out, "GIF", optimize=False)
    assert np.array_equal(decoded(out.getvalue(), "image/gif"), palette[index])
    out = io.BytesIO()
    im.save(out, "GIF", optimize=False, transparency=5)
    got = decoded(out.getvalue(), "image/gif")
    assert np.array_equal(got[:, :, 3], np.where(index == 5, 0, 255))
    assert np.array_equal(got[index != 5][:, :3], palette[index][index != 5])


def test_webp_lossless_round_trip():
    for channels in (3, 4):
        a = RNG.integers(0, 256, (10, 12, channels), dtype=np.uint8)
        assert np.array_equal(decoded(pillow(a, "WEBP", lossless=True, exact=True), "image/webp"), a)
    lossy = decoded(pillow(gradient(16, 16, 3), "WEBP", quality=90), "image/webp")
    assert lossy.shape == (16, 16, 3)


# --- Sources and identity -----------------------------------------------------------------

def test_source_metadata_and_identity():
    a = RNG.integers(0, 256, (5, 8, 4), dtype=np.uint8)
    data = pillow(a, "PNG")
    one, two = decode(data, "image/png"), decode(data, "IMAGE/PNG")
    assert one.source == two.source and one.identity() == two.identity()
    s = one.source
    assert (s.format, s.width, s.height, s.mode, s.has_alpha) == ("png", 8, 5, "RGBA", True)
    assert s.sha256 == hashlib.sha256(data).hexdigest()
    assert one.identity() == f"png:8x5:RGBA:{s.sha256}".encode()
    other = decode(pillow(a, "PNG", compress_level=1), "image/png")
    assert np.array_equal(other.pixels, one.pixels) and other.identity() != one.identity()
    with pytest.raises(ValueError):
        one.pixels[0, 0, 0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.width = 3


# --- Data URLs -----------------------------------------------------------------------------

def data_url(data, mime="image/png"):
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_data_url_round_trip():
    a = RNG.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    data = pillow(a, "PNG")
    assert parse_data_url(data_url(data)) == ("image/png", data)
    assert parse_data_url("DATA:Image/PNG;BASE64," + base64.b64encode(data).decode()) == ("image/png", data)
    image = decode_data_url(data_url(data), param=PARAM)
    assert np.array_equal(image.pixels, a)
    assert parse_data_url("data:image/png;base64,") == ("image/png", b"")
    rejects("invalid_image", 400, decode_data_url, "data:image/png;base64,")   # empty image


@pytest.mark.parametrize("url,named", [
    ("http://example.com/cat.png", "never fetches http"),
    ("https://example.com/cat.png", "never fetches https"),
    ("HTTPS://example.com/cat.png", "never fetches https"),
    ("ftp://example.com/cat.png", "never fetches ftp"),
    ("file:///etc/passwd", "never reads image files"),
    ("file:cat.png", "never reads image files"),
    ("/tmp/cat.png", "file path"),
    ("cat.png", "file path"),
    ("./cat.png", "file path"),
    ("C:\\images\\cat.png", "file path"),
    ("~/cat.png", "file path"),
    ("", "file path"),
    ("javascript:alert(1)", "not accepted"),
    ("blob:https://x/1", "never fetches blob"),
])
def test_non_data_urls_reject(url, named):
    message = rejects("unsupported_image_url", 400, parse_data_url, url)
    assert named in message and "data:image/png;base64" in message


@pytest.mark.parametrize("url", [
    "data:image/png,iVBORw0KGgo=",                  # not base64 (percent-encoded data)
    "data:image/png;charset=utf-8,abcd",
    "data:image/png;base64",                        # no comma
    "data:;base64,iVBORw0KGgo=",                    # no media type
    "data:png;base64,iVBORw0KGgo=",
    "data:image/png;name=a.png;base64,iVBORw0KGgo=",  # other parameters
    "data:image/png ;base64,iVBORw0KGgo=",
    "data:image/png;base64,iVBORw0KGgo",            # missing padding
    "data:image/png;base64,iVBORw0KGg===",          # three '='
    "data:image/png;base64,iVBORw0KGgo====",        # padding after a full group
    "data:image/png;base64,iVBO=w0KGgo=",           # padding in the middle
    "data:image/png;base64,=VBORw0KGgo=",
    "data:image/png;base64,iVBOR w0KGgo=",          # whitespace
    "data:image/png;base64,iVBORw0K\nGgo=",
    "data:image/png;base64,iVBORw0K-_go=",          # URL-safe alphabet
    "data:image/png;base64,iVBORw0K%2Bgo=",         # percent-encoding
    "data:image/png;base64,iVBORw0KGgp=",           # nonzero bits after the last byte
    "data:image/png;base64,QR==",
    "data:image/png;base64,iVBORw0KGgo\u00e9",       # not ASCII
])
def test_malformed_data_urls_reject(url):
    rejects("invalid_image_url", 400, parse_data_url, url)


def test_data_url_must_be_a_string():
    rejects("invalid_image_url", 400, parse_data_url, b"data:image/png;base64,")
    rejects("invalid_image_url", 400, parse_data_url, None)


def test_data_url_byte_limit_applies_before_decoding():
    data = bytes(1000)
    url = data_url(data)
    assert parse_data_url(url, max_bytes=1000)[1] == data
    assert "1000 bytes" in rejects("image_too_large", 413, parse_data_url, url, max_bytes=999)
    rejects("image_too_large", 413, decode_data_url, url, limits=Limits(max_bytes=999))


# --- Signatures, MIME types and codecs ------------------------------------------------------

SMALL = RNG.integers(0, 256, (6, 8, 3), dtype=np.uint8)
FILES = {"png": pillow(SMALL, "PNG"), "jpeg": pillow(SMALL, "JPEG"), "gif": pillow(SMALL, "GIF"),
         "webp": pillow(SMALL, "WEBP", lossless=True), "pam": pam(SMALL, 255, "RGB")}


def test_sniff_finds_each_format_and_mimes_must_match():
    for fmt, data in FILES.items():
        assert sniff(data) == fmt
        decoded(data, images.MIME_TYPES[fmt])
        for other, mime in images.MIME_TYPES.items():
            if other != fmt:
                message = rejects("image_mime_mismatch", 400, decode, data, mime)
                assert images.MIME_TYPES[fmt] in message
    assert len(decoded(FILES["jpeg"], "image/jpg")) == 6   # the common unregistered alias


@pytest.mark.parametrize("data,named", [
    (b"BM" + bytes(60), "BMP"), (b"II*\0" + bytes(20), "TIFF"), (b"MM\0*" + bytes(20), "TIFF"),
    (b"\0\0\0\x1cftypavif" + bytes(20), "avif"), (b"\0\0\0\x18ftypheic" + bytes(20), "heic"),
    (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"), (b"P6\n2 2\n255\n" + bytes(12), "Netpbm"),
    (b"P7 332\n", "XV"), (b"\xff\x0a" + bytes(10), "JPEG XL"), (b"qoif" + bytes(10), "QOI"),
    (b"hello world", "not in a known format"), (b"\x89PNG\r\n", "not in a known format"),
])
def test_unknown_signatures_reject(data, named):
    message = rejects("unsupported_image", 415, decode, data, "image/png")
    assert named in message and "image/png" in message
    rejects("unsupported_image", 415, sniff, data)


def test_empty_and_unknown_declared_types():
    rejects("invalid_image", 400, decode, b"", "image/png")
    for mime in ("image/bmp", "image/apng", "application/octet-stream", "text/plain", "", "image/svg+xml"):
        rejects("unsupported_image", 415, decode, FILES["png"], mime)


@pytest.mark.parametrize("disabled", images.CODECS)
def test_each_codec_can_be_disabled_alone(disabled):
    codecs = tuple(c for c in images.CODECS if c != disabled)
    message = rejects("image_codec_disabled", 415, decode, FILES[disabled], images.MIME_TYPES[disabled],
                      codecs=codecs)
    assert images.NAMES[disabled] in message and images.MIME_TYPES[disabled] not in message
    for fmt, data in FILES.items():
        if fmt != disabled:
            assert decoded(data, images.MIME_TYPES[fmt], codecs=codecs).shape[:2] == (6, 8)


def test_pam_needs_no_codec():
    assert np.array_equal(decoded(FILES["pam"], PAM_MIME, codecs=()), SMALL)
    for fmt in images.CODECS:
        rejects("image_codec_disabled", 415, decode, FILES[fmt], images.MIME_TYPES[fmt], codecs=())
    with pytest.raises(ValueError):
        decode(FILES["pam"], PAM_MIME, codecs=("pam",))


# --- Animated and multi-image files ---------------------------------------------------------

def frames(fmt, n=2, **save):
    ims = [Image.frombytes("RGB", (8, 6), RNG.integers(0, 256, (6, 8, 3), dtype=np.uint8).tobytes())
           for _ in range(n)]
    out = io.BytesIO()
    ims[0].save(out, fmt, save_all=True, append_images=ims[1:], **save)
    return out.getvalue()


@pytest.mark.parametrize("fmt,mime,save", [("GIF", "image/gif", {}), ("WEBP", "image/webp", {"lossless": True}),
                                           ("PNG", "image/png", {})])
def test_animations_reject(fmt, mime, save):
    data = frames(fmt, **save)
    assert images.animated(data, sniff(data))
    rejects("animated_image", 415, decode, data, mime)
    assert not images.animated(FILES[sniff(data)], sniff(data))


def test_apng_with_one_frame_is_still_apng():
    still = png(RNG.integers(0, 256, (2, 2, 3)), 8, 2)
    actl = chunk(b"acTL", struct.pack(">II", 1, 0))
    apng = still[:33] + actl + still[33:]
    assert images.animated(apng, "png")
    rejects("animated_image", 415, decode, apng, "image/png")


def test_gif_frames_are_counted_from_the_blocks():
    assert images._gif_frames(frames("GIF", 3), stop=10) == 3
    assert images._gif_frames(FILES["gif"], stop=10) == 1
    assert images._gif_frames(b"GIF89a", stop=10) == 0


def test_webp_animation_flag_alone_rejects():
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes([0x02, 0, 0, 0]) + (7).to_bytes(3, "little") * 2
    data = b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x
    rejects("animated_image", 415, decode, data, "image/webp")


def test_mpo_stereo_pair_rejects_but_previews_do_not():
    data = frames("MPO", quality=90)
    # Pillow writes its second picture as type "Undefined" (previews, gain maps): the primary decodes.
    assert decoded(data, "image/jpeg").shape == (6, 8, 3)
    # The MP Index is a little-endian TIFF IFD after "MPF\0"; tag 0xB002 points at 16-byte entries.
    tiff = data.index(b"MPF\0") + 4
    ifd = tiff + struct.unpack_from("<I", data, tiff + 4)[0]
    tags = [struct.unpack_from("<HHII", data, ifd + 2 + 12 * k) for k in range(struct.unpack_from("<H", data, ifd)[0])]
    entries = tiff + next(offset for tag, _, _, offset in tags if tag == 0xB002)
    assert struct.unpack_from("<I", data, entries)[0] == 0x030000   # the primary image
    stereo = data[:entries + 16] + struct.pack("<I", 0x020002) + data[entries + 20:]
    assert "MPO" in rejects("animated_image", 415, decode, stereo, "image/jpeg")


# --- Limits ---------------------------------------------------------------------------------

def test_byte_limit():
    data = FILES["png"]
    decoded(data, "image/png", limits=Limits(max_bytes=len(data)))
    rejects("image_too_large", 413, decode, data, "image/png", limits=Limits(max_bytes=len(data) - 1))


@pytest.mark.parametrize("fmt", images.FORMATS)
def test_dimension_and_pixel_limits(fmt):
    a = RNG.integers(0, 256, (30, 50, 3), dtype=np.uint8)
    save = {"lossless": True} if fmt == "webp" else {}
    data = pam(a, 255, "RGB") if fmt == "pam" else pillow(a, fmt.upper(), **save)
    mime = images.MIME_TYPES[fmt]
    decoded(data, mime, limits=Limits(max_dimension=50, max_pixels=1500))
    assert "49 pixels a side" in rejects("image_dimensions_too_large", 413, decode, data, mime,
                                         limits=Limits(max_dimension=49))
    assert "1499" in rejects("image_too_many_pixels", 413, decode, data, mime, limits=Limits(max_pixels=1499))


class PixelsDecoded(BaseException):
    """Raised by the fixture below; a BaseException, so decode's own handlers let it through."""


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    """Any attempt to decode pixels, or to create WebP's decoder (which allocates its
    canvas), fails the test."""
    def refuse(*args, **kwargs):
        raise PixelsDecoded()
    for cls in (ImageFile.ImageFile, PngImagePlugin.PngImageFile, JpegImagePlugin.JpegImageFile,
                GifImagePlugin.GifImageFile, WebPImagePlugin.WebPImageFile):
        if "load" in vars(cls):
            monkeypatch.setattr(cls, "load", refuse)
    monkeypatch.setattr(WebPImagePlugin._webp, "WebPAnimDecoder", refuse)


def test_the_fixture_notices_decoding(no_pixel_decoding):
    for fmt in images.CODECS:
        with pytest.raises(PixelsDecoded):
            decode(FILES[fmt], images.MIME_TYPES[fmt])


def test_png_claiming_huge_dimensions_rejects_from_its_header(no_pixel_decoding):
    small = RNG.integers(0, 256, (2, 2, 3))
    huge = png(small, 8, 2, ihdr_size=(2**31 - 1, 2**31 - 1))
    rejects("image_dimensions_too_large", 413, decode, huge, "image/png")
    wide = png(small, 8, 6, ihdr_size=(100_000, 100_000))
    rejects("image_too_many_pixels", 413, decode, wide, "image/png", limits=Limits(max_dimension=10**6))
    # Over Pillow's own bomb limit too: ours answers first.
    rejects("image_too_many_pixels", 413, decode, wide, "image/png",
            limits=Limits(max_dimension=10**6, max_pixels=images.PIXELS_CEILING))


def test_other_formats_claiming_huge_dimensions_reject_from_their_headers(no_pixel_decoding):
    # JPEG: a real file whose SOF0 states 60000 x 60000.
    jpeg = bytearray(FILES["jpeg"])
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", 60000, 60000)
    rejects("image_dimensions_too_large", 413, decode, bytes(jpeg), "image/jpeg")
    rejects("image_too_many_pixels", 413, decode, bytes(jpeg), "image/jpeg", limits=Limits(max_dimension=60000))
    # GIF: the logical screen states 65535 x 65535.
    gif = FILES["gif"][:6] + struct.pack("<HH", 65535, 65535) + FILES["gif"][10:]
    rejects("image_dimensions_too_large", 413, decode, gif, "image/gif")
    # WebP: VP8X states a 16384 x 16384 canvas; refused before Pillow's decoder is made.
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4) + (16383).to_bytes(3, "little") * 2
    webp = b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x
    rejects("image_dimensions_too_large", 413, decode, webp, "image/webp")
    rejects("image_too_many_pixels", 413, decode, webp, "image/webp", limits=Limits(max_dimension=16384))


def test_limits_validate_their_values():
    for bad in ({"max_bytes": 0}, {"max_dimension": -1}, {"max_pixels": 1.5}, {"max_pixels": images.PIXELS_CEILING + 1},
                {"max_bytes": True}):
        with pytest.raises(ValueError):
            Limits(**bad)


# --- Broken files -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", images.CODECS)
def test_truncated_and_corrupted_files_reject(fmt):
    data, mime = FILES[fmt], images.MIME_TYPES[fmt]
    for cut in (12, 20, 31, len(data) // 2, len(data) - 3):
        try:
            decoded(data[:cut], mime)
        except ImageError as e:
            assert e.code in ("invalid_image", "unsupported_image") and e.param == PARAM
    rejects("invalid_image", 400, decode, data[:len(data) // 2], mime)


# --- PNG output -------------------------------------------------------------------------------

def test_encode_png_is_deterministic_and_lossless():
    for channels in (3, 4):
        a = RNG.integers(0, 256, (17, 23, channels), dtype=np.uint8)
        data = encode_png(a)
        assert data == encode_png(a.copy()) == encode_png(np.asfortranarray(a))
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), a)
        assert np.array_equal(decoded(data, "image/png"), a)
        kinds, pos = [], 8
        while pos < len(data):
            length = struct.unpack_from(">I", data, pos)[0]
            kinds.append(data[pos + 4:pos + 8])
            pos += 12 + length
        assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and set(kinds[1:-1]) == {b"IDAT"}
    view = RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)[::2, ::-1]
    assert np.array_equal(decoded(encode_png(view), "image/png"), view)


def test_encode_png_rejects_other_arrays():
    for bad in (np.zeros((4, 4), np.uint8), np.zeros((4, 4, 2), np.uint8), np.zeros((4, 4, 3), np.uint16),
                np.zeros((0, 4, 3), np.uint8), np.zeros((4, 4, 3), np.float32)):
        with pytest.raises(ValueError):
            encode_png(bad)


# --- Fuzz -------------------------------------------------------------------------------------

FUZZ_LIMITS = Limits(max_bytes=1 << 16, max_dimension=512, max_pixels=1 << 16)


def decoded_or_refused(data, mime=None):
    """decode() returns uint8 pixels of the shape its Source states, or raises ImageError."""
    if mime is None:
        try:
            mime = images.MIME_TYPES[sniff(data)]
        except ImageError:
            mime = "image/png"
    try:
        image = decode(data, mime, limits=FUZZ_LIMITS, param=PARAM)
    except ImageError as e:
        assert e.code in STATUS and e.param == PARAM
        return None
    p, s = image.pixels, image.source
    assert p.dtype == np.uint8 and p.shape == (s.height, s.width, 4 if s.has_alpha else 3)
    assert s.width * s.height <= FUZZ_LIMITS.max_pixels
    return p


@given(st.binary(max_size=400), st.sampled_from([None, *images.MIME_TYPES.values()]))
@FUZZ
def test_decode_on_arbitrary_bytes(data, mime):
    decoded_or_refused(data, mime)


@given(st.sampled_from(sorted(images.FORMATS)), st.binary(max_size=300))
@FUZZ
def test_decode_on_arbitrary_bytes_behind_each_signature(fmt, tail):
    head = {"png": images._PNG, "jpeg": b"\xff\xd8\xff", "gif": b"GIF89a", "webp": b"RIFF\0\0\0\0WEBP",
            "pam": b"P7\n"}[fmt]
    decoded_or_refused(head + tail)


MUTABLE = [*FILES.values(), pillow(SMALL[:, :, :1].repeat(4, 2), "PNG"), pam(RNG.integers(0, 1000, (3, 3, 4)), 999,
           "RGB_ALPHA"), frames("GIF"), png(RNG.integers(0, 65536, (3, 3, 2)), 16, 4),
           pillow(gradient(8, 8, 4), "JPEG", "CMYK")]


@given(st.sampled_from(MUTABLE), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       st.integers(0, 10**6), st.booleans())
@FUZZ
def test_decode_on_corrupted_and_truncated_files(data, changes, cut, truncate):
    data = bytearray(data)
    for position, value in changes:
        data[position % len(data)] = value
    if truncate:
        data = data[:cut % (len(data) + 1)]
    decoded_or_refused(bytes(data))


tags = st.sampled_from(["WIDTH", "HEIGHT", "DEPTH", "MAXVAL", "TUPLTYPE", "ENDHDR", "#", "", "TUPLTYPE", "width"])
values = st.one_of(st.integers(-2, 70000).map(str), st.sampled_from([t for t, _, _ in PAM_TYPES]),
                   st.sampled_from(["", "1 2", "0x10", "+3", "GRAYSCALE_ALPHA"]))


@given(st.lists(st.tuples(tags, values), max_size=8), st.binary(max_size=200))
@FUZZ
def test_pam_header_grammar(lines, raster):
    header = "P7\n" + "".join(f"{t} {v}\n" for t, v in lines) + "ENDHDR\n"
    decoded_or_refused(header.encode() + raster, PAM_MIME)


@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from(PAM_TYPES), st.integers(1, 65535), st.data())
@FUZZ
def test_pam_valid_files_always_decode(w, h, kind, maxval, data):
    tupltype, depth, alpha = kind
    if tupltype.startswith("BLACKANDWHITE"):
        maxval = 1
    samples = np.array(data.draw(st.lists(st.integers(0, maxval), min_size=w * h * depth, max_size=w * h * depth)))
    samples = samples.reshape(h, w, depth)
    got = decoded_or_refused(pam(samples, maxval, tupltype), PAM_MIME)
    want = scaled(samples, maxval)
    if depth in (1, 2):
        want = np.concatenate([np.repeat(want[:, :, :1], 3, axis=2), want[:, :, 1:]], axis=2)
    assert got is not None and np.array_equal(got, want)


@given(st.one_of(st.text(max_size=80), st.builds(lambda m, p: f"data:{m};base64,{p}",
                                                 st.sampled_from(["image/png", "image/gif", "x", ""]),
                                                 st.text("ABCab01+/=", max_size=24))))
@FUZZ
def test_parse_data_url_on_arbitrary_text(url):
    try:
        mime, data = parse_data_url(url, param=PARAM)
    except ImageError as e:
        assert e.code in ("unsupported_image_url", "invalid_image_url") and e.param == PARAM
        return
    assert isinstance(data, bytes) and "/" in mime
    assert url.split(",", 1)[1] == base64.b64encode(data).decode()   # one spelling per image


# --- Probing: the header alone ------------------------------------------------------------

@pytest.mark.parametrize("fmt", images.FORMATS)
def test_probe_agrees_with_decode_without_decoding_a_pixel(fmt, monkeypatch):
    """probe: the same format, upright size and digest decode resolves, with no pixel decoded,
    and the same rejections before the pixels (codec, MIME, limits)."""
    mime = images.MIME_TYPES[fmt]
    source = decode(FILES[fmt], mime).source
    for cls in (ImageFile.ImageFile, PngImagePlugin.PngImageFile, JpegImagePlugin.JpegImageFile,
                GifImagePlugin.GifImageFile, WebPImagePlugin.WebPImageFile):
        if "load" in vars(cls):
            monkeypatch.setattr(cls, "load", lambda *a, **k: pytest.fail("probe decoded pixels"))
    monkeypatch.setattr(images, "decode_pam", lambda *a, **k: pytest.fail("probe decoded the PAM raster"))
    got = images.probe(FILES[fmt], mime)
    assert (got.format, got.width, got.height, got.sha256) == (source.format, source.width, source.height,
                                                               source.sha256)
    assert got.identity() != images.probe(FILES["png" if fmt != "png" else "gif"],
                                          images.MIME_TYPES["png" if fmt != "png" else "gif"]).identity()
    rejects("image_dimensions_too_large", 413, images.probe, FILES[fmt], mime, limits=Limits(max_dimension=7))
    if fmt != "pam":
        rejects("image_codec_disabled", 415, images.probe, FILES[fmt], mime,
                codecs=[c for c in images.CODECS if c != fmt])
        rejects("image_mime_mismatch", 400, images.probe, FILES[fmt], PAM_MIME)


@pytest.mark.parametrize("orientation", [5, 6, 7, 8])
def test_probe_reports_the_upright_size(orientation):
    a = RNG.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, "PNG", exif=exif)
    got = images.probe(buf.getvalue(), "image/png")
    assert (got.width, got.height) == (6, 10)
    assert decode(buf.getvalue(), "image/png").pixels.shape[:2] == (10, 6)


@FUZZ
@given(st.binary(max_size=400))
def test_probe_fuzz_raises_only_image_errors(data):
    """Any bytes behind any declared type: a Probe of the header's size, or a 4xx ImageError."""
    for mime in ("image/png", PAM_MIME, "image/gif", "image/jpeg", "image/webp"):
        try:
            got = images.probe(data, mime)
        except ImageError as e:
            assert 400 <= STATUS[e.code] < 500
        else:
            assert got.width > 0 and got.height > 0 and got.sha256 == hashlib.sha256(data).hexdigest()
