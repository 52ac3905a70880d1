"""The image component of a text deployment: images projected into the decoder's input.

A text document may carry ``"components": {"image": {"sources": [...], "checkpoint": ...}}``:
a package of its own (models/smolvlm/vision.loom: SmolVLM's vision tower and connector) on
its own checkpoint, prepared, checked and proven with the deployment, whose parameters
are their own residency component ("image", beside "primary").

Its stage contract:

    project(tiles, features, N)
        tiles: float32 [N, CH, TILE, TILE], preprocessed tiles of one or more images;
        features: float32 [N * SEQ, TEXT_D], each tile's rows of language-model input.

specs CH, TILE, SEQ (positions per tile) and TEXT_D, which must equal the primary
package's embedding width D. The primary package then needs the stage

    advance_media(tokens, pos, row_of, pages, last, features, feature_at, logits, T, R)

advance with rows of `features` (float32 [*, D]) as the inputs of the positions t
where feature_at[t] >= 0 (int32 [T]; -1 keeps the token's embedding).
"""

import bisect
import collections
import hashlib
import math
import re
import secrets

import numpy as np
from PIL import Image

from . import images, kinds
from .errors import Problem
from .runtime import run_stage
from .scheduler import CohortEngine

STAGE = "project"
MEDIA_STAGE = "advance_media"     # the primary package's way in for features


DETAILS = ("auto", "low", "high")
RESAMPLE = {0: Image.NEAREST, 1: Image.LANCZOS, 2: Image.BILINEAR, 3: Image.BICUBIC}
MAX_RESIZED = 4096      # the processor's cap on either edge after its first resize
STEP_TILES = 32         # tiles per projection step (a request with more runs alone)
# The component's options that bound an image (images.Limits' fields).
LIMIT_OPTIONS = {"max_image_bytes": "max_bytes", "max_image_dimension": "max_dimension",
                 "max_image_pixels": "max_pixels"}


class Processor:
    """SmolVLM's image processing (Idefics3ImageProcessor) under the checkpoint's
    preprocessor_config.json, and the package's detail policy: `low` is the global image
    alone (one tile), `high` the processor's split (rows x cols tiles, then the global
    image), `auto` high when the image is larger than one tile. Runs on the CPU executor."""

    def __init__(self, config, tile):
        self.config, self.tile = dict(config or {}), tile
        self.longest = self.config.get("size", {}).get("longest_edge", tile)
        self.resample = RESAMPLE.get(self.config.get("resample", 1), Image.LANCZOS)
        self.splitting = self.config.get("do_image_splitting", True)
        self.scale = float(self.config.get("rescale_factor", 1 / 255))
        self.mean = np.asarray(self.config.get("image_mean", [0.5] * 3), np.float64)
        self.std = np.asarray(self.config.get("image_std", [0.5] * 3), np.float64)

    def _sizes(self, height, width, detail):
        """(the first resize, the split's resize or None, rows, cols) for an image of this size."""
        resized = _fit_longest(height, width, self.longest) if self.config.get("do_resize", True) else (height, width)
        if not (self.splitting and (detail == "high" or (detail == "auto" and max(height, width) > self.tile))):
            return resized, None, 0, 0
        split = _tile_multiple(*resized, self.tile)
        if split[0] > self.tile or split[1] > self.tile:
            return resized, split, split[0] // self.tile, split[1] // self.tile
        return resized, split, 0, 0

    def grid(self, height, width, detail):
        """(rows, cols) an image of this size is cut into: its tiles are rows * cols + 1, or
        1 when rows == cols == 0. Known from the header alone, before any pixel is decoded."""
        return self._sizes(height, width, detail)[2:]

    def tiles(self, pixels, detail):
        """RGB8 or straight-alpha RGBA8 [H, W, C] -> (float32 [N, 3, TILE, TILE], rows, cols):
        tiles row-major and the global image last (N = rows * cols + 1), or the global image
        alone (N = 1, rows = cols = 0)."""
        resized, split, rows, cols = self._sizes(*pixels.shape[:2], detail)
        img = self._resize(Image.fromarray(_flatten_alpha(pixels)), *resized)
        frames = []
        if split is not None:
            img = self._resize(img, *split)
            frames = [img.crop((c * self.tile, r * self.tile, (c + 1) * self.tile, (r + 1) * self.tile))
                      for r in range(rows) for c in range(cols)]
        frames.append(self._resize(img, self.tile, self.tile))         # the global image
        return np.stack([self._normalize(f) for f in frames]), rows, cols

    def _resize(self, img, height, width):
        return img if (img.height, img.width) == (height, width) else img.resize((width, height), self.resample)

    def _normalize(self, img):
        x = np.asarray(img, np.float64) * self.scale
        return ((x - self.mean) / self.std).transpose(2, 0, 1).astype(np.float32)


def _flatten_alpha(pixels):
    """Straight alpha composited onto white, as the processor's convert_to_rgb does."""
    if pixels.shape[-1] == 3:
        return np.ascontiguousarray(pixels)
    c, a = pixels[..., :3].astype(np.int64), pixels[..., 3:].astype(np.int64)
    return ((c * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def _fit_longest(height, width, longest):
    """The processor's first resize: the longest edge to `longest`, the other by the aspect
    ratio (truncated, then made even), both then kept under MAX_RESIZED."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_RESIZED:
        width, height = MAX_RESIZED, int(MAX_RESIZED / aspect)
    elif height > width and height > MAX_RESIZED:
        height, width = MAX_RESIZED, int(MAX_RESIZED * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple(height, width, tile):
    """The longer edge rounded up to a multiple of the tile, the other from the aspect ratio, rounded up too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def prompt_pieces(rows, cols, seq):
    """What the processor puts in place of one image, as (text, is_image) pieces: the
    markers are text the tokenizer encodes (SmolVLM's added tokens where it has them),
    each is_image piece one image position, SEQ of them per tile, in tile order."""
    fake, image = "<fake_token_around_image>", [("", True)] * seq
    pieces = []
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            pieces += [(f"{fake}<row_{r}_col_{c}>", False)] + image
        pieces.append(("\n\n" if r == rows else "\n", False))
    return pieces + [(f"{fake}<global-img>", False)] + image + [(fake, False)]


# -- images in a prompt ---------------------------------------------------------------


def with_marks(messages):
    """The messages with each image part replaced by a text part holding a mark no client
    can write (a fresh nonce in private-use characters), for the chat framing to place;
    -> (messages, the marks in part order)."""
    nonce = secrets.token_hex(8)
    marks = []

    def part(p):
        if p["type"] != "image_url":
            return p
        marks.append(f"\ue000{nonce}:{len(marks)}\ue001")
        return {"type": "text", "text": marks[-1]}

    shown = [dict(m, content=[part(p) for p in m["content"]]) if isinstance(m.get("content"), list) else m
             for m in messages]
    return shown, marks


def _position_ids(identity, count, vocab):
    """Ids for an image's positions, past the vocabulary and derived from its identity
    and each position's index: a conversation's ids then name its images exactly, so
    every reuse path that compares ids (idle rows, sessions, the prefix cache,
    checkpoints) compares the images too, and one changed byte replays."""
    span = (1 << 31) - 1 - vocab
    return [vocab + int.from_bytes(hashlib.sha256(identity + i.to_bytes(4, "little")).digest()[:8], "little") % span
            for i in range(count)]


def tokens(tok, rendered, marks, parts, component, context):
    """On the CPU executor: the rendered prompt's ids with each mark expanded into its
    image's pieces (markers as text, one id per image position). Each image is only
    probed here (its header: format, upright size, digest); its pixels are decoded when
    its positions must be computed -> (ids, Media). Raises images.ImageError (4xx)."""
    vocab = component.text_vocab
    seq = component.spec("SEQ")
    pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
    ids, positions, sources = [], [], []
    for piece in pieces:
        if piece not in marks:
            ids += tok.encode(piece, add_special=False, limit=context) if piece else []
            continue
        param, part = parts[marks.index(piece)]
        param += ".image_url.url"
        probe, mime, data = images.probe_data_url(part["image_url"]["url"], limits=component.image_limits,
                                                  codecs=component.image_codecs, param=param)
        detail = part["image_url"].get("detail", "auto")
        rows, cols = component.processor.grid(probe.height, probe.width, detail)
        sources.append((mime, data, detail, param, probe))
        identity = hashlib.sha256(b"%s|%s|%d" % (probe.identity(), detail.encode(), len(sources))).digest()
        own = iter(_position_ids(identity, (rows * cols + 1) * seq, vocab))
        for text, is_image in prompt_pieces(rows, cols, seq):
            if is_image:
                positions.append(len(ids))
                ids.append(next(own))
            else:
                ids += tok.encode(text, add_special=False)
        if len(ids) > context:
            break
    return ids, Media(positions, sources, component)


class Media:
    """A prompt's image positions (prompt indices, in order) and their images; decoded
    into tiles only when some position must be computed (a retained prefix that covers
    them all skips both decoding and projection); once projected, `features` holds
    their rows on the device, in the same order."""

    def __init__(self, positions, sources, component):
        self.positions, self.sources, self.component = positions, sources, component
        self.ordinal = {p: i for i, p in enumerate(positions)}
        self.tiles = None
        self.features = None
        self.projection = None     # the request in the projection engine, once asked
        self.error = None

    def decode(self):
        """On the CPU executor: every image's pixels, cut into tiles. Raises images.ImageError."""
        out = []
        for mime, data, detail, param, probe in self.sources:
            decoded = images.decode(data, mime, limits=self.component.image_limits,
                                    codecs=self.component.image_codecs, param=param)
            if (decoded.source.width, decoded.source.height) != (probe.width, probe.height):
                raise images.ImageError(f"the image decodes to {decoded.source.width}x{decoded.source.height}, "
                                        f"not the {probe.width}x{probe.height} its header states",
                                        "invalid_image", param)
            out.append(self.component.processor.tiles(decoded.pixels, detail)[0])
        self.tiles = out
        self.component.images_decoded += len(out)

    def wanted(self, fed):
        """Whether positions from `fed` on still need features the device does not hold."""
        return bool(self.positions) and self.positions[-1] >= fed and self.features is None

    def project(self, engine, wake):
        """Ask the projection engine for every image's features (once), decoding them first
        on the CPU executor if that has not happened yet; wake() when they arrive."""
        if self.projection is not None:
            return

        def done(features, error):      # (a request gone by then never gets here: its rows go back)
            self.features, self.error = features, error
            wake()

        def decoded(_result, error):
            if error is not None:
                self.error = error
                wake()
            elif not self.projection.gone:
                self.projection.tiles = np.concatenate(self.tiles)
                engine.submit(self.projection)

        self.projection = Projection(None, len(self.sources), done)
        if self.tiles is None:
            engine.loop.run_in_executor(self.decode, decoded)
        else:
            decoded(None, None)

    def within(self, start, n):
        """Whether prompt positions start .. start + n - 1 hold an image position."""
        i = bisect.bisect_left(self.positions, start)
        return i < len(self.positions) and self.positions[i] < start + n

    def row(self, index):
        """The features row of prompt position `index`, or -1 for a token."""
        i = self.ordinal.get(index)
        return -1 if i is None else self.features.start + i

    def release(self):
        """The prefill is past the images (or the request is over): the rows go back."""
        if self.projection is not None:
            self.projection.gone = True
        if self.features is not None:
            self.features.release()
            self.features = None


class ImageInput(kinds.Component):
    probes = [(STAGE, {"N": 1})]
    inputs = ("image",)

    def trial(self, binding, command, geometry):
        s, n = binding.specs, geometry["N"]
        return ({"tiles": np.zeros(n * s["CH"] * s["TILE"] * s["TILE"], np.float32)},
                {"features": (np.float32, n * s["SEQ"] * s["TEXT_D"])})

    def check(self, primary, component):
        if MEDIA_STAGE not in {c.name for c in primary.module.commands}:
            raise Problem(f"the text package has no {MEDIA_STAGE!r} command to take image features", "contract",
                          quotes=False)
        commands = {c.name for c in component.module.commands}
        if STAGE not in commands:
            raise Problem(f"the image component's package has no {STAGE!r} command (it has: "
                          f"{', '.join(sorted(commands)) or 'none'})", "contract")
        missing = [name for name in ("CH", "TILE", "SEQ", "TEXT_D") if component.spec(name) is None]
        if missing:
            raise Problem(f"the image component's package lacks the specs {', '.join(missing)}", "contract",
                          quotes=False)
        width, expected = component.spec("TEXT_D"), primary.spec("D")
        if width != expected:
            # the widths come from the checkpoints (server files): the operator's stderr has them
            raise Problem("the image component's projection width (its spec TEXT_D) is not the text model's "
                          "embedding width (its spec D)", "contract", quotes=False,
                          private=f"the image component projects to {width} channels; the text model's embeddings "
                                  f"have {expected}")
        config = component.binding.metadata.get("preprocessor") or {}
        tile = config.get("max_image_size", {}).get("longest_edge", component.spec("TILE"))
        if tile != component.spec("TILE"):
            raise Problem(f"preprocessor_config.json cuts {tile}-pixel tiles; the vision tower takes "
                          f"{component.spec('TILE')}", "contract")
        component.processor = Processor(config, tile)
        component.text_vocab = primary.spec("V")
        component.images_decoded = 0        # for /v1/status: a retained prefix decodes nothing
        options = component.binding.options
        try:
            component.image_limits = images.Limits(**{field: options[name] for name, field in LIMIT_OPTIONS.items()
                                                      if name in options})
        except (TypeError, ValueError) as e:
            raise Problem(f"image limits: {e}", "invalid_option", quotes=False) from None
        codecs = options.get("image_codecs", list(images.CODECS))
        if not isinstance(codecs, list) or any(c not in images.CODECS for c in codecs):
            raise Problem(f"option image_codecs must be a list drawn from {', '.join(images.CODECS)} "
                          "(PAM is always accepted)", "invalid_option", quotes=False)
        component.image_codecs = tuple(codecs)


IMAGE = ImageInput()


# -- projection cohorts --------------------------------------------------------------


class Projection:
    """One request's images on their way through the component: `tiles` float32
    [N, CH, TILE, TILE] of `images` images; done(features, error) on the loop, with a
    Features handle on the rows. A request that leaves first sets `gone`: its rows are
    released as they arrive, and its peers' rows stay theirs."""

    def __init__(self, tiles, images, done):
        self.tiles, self.images, self.done = tiles, images, done
        self.gone = False


class Features:
    """Rows [start, start + count) of a projection step's output buffer, [*, TEXT_D] on the
    device: one request's image positions, in order. The buffer is shared by the step's
    requests and freed when the last of them releases its rows."""

    def __init__(self, shared, start, count):
        self._shared, self.start, self.count = shared, start, count

    @property
    def buffer(self):
        return self._shared["buffer"]

    def release(self):
        if self._shared is not None:
            shared, self._shared = self._shared, None
            shared["users"] -= 1
            if shared["users"] == 0:
                shared["buffer"].release()


class ProjectionEngine(CohortEngine):
    """Tiles of every waiting request through `project`, STEP_TILES at a time, the
    features kept on the device for the requests' prefills."""

    def __init__(self, component, loop):
        super().__init__(component, loop)
        self.queue = collections.deque()
        self.images = self.tiles = 0        # projected, for /v1/status

    def submit(self, projection):
        if self.failed:
            projection.done(None, Problem(self.failed, "step_timeout"))
            return
        self.queue.append(projection)
        self.kick()

    def backlog(self):
        return len(self.queue)

    def stats(self):
        return dict(super().stats(), waiting=len(self.queue), images_projected=self.images,
                    tiles_projected=self.tiles)

    def form(self):
        work, tiles = [], 0
        while self.queue:
            job = self.queue[0]
            if job.gone:
                self.queue.popleft()
                continue
            if work and tiles + len(job.tiles) > STEP_TILES:
                break
            work.append(self.queue.popleft())
            tiles += len(job.tiles)
        self.requests += len(work)
        return work or None

    def launch(self, work, done):
        p = self.prepared
        n = sum(len(job.tiles) for job in work)
        tiles = np.concatenate([job.tiles for job in work]).astype(np.float32, copy=False)
        run_stage(p, self.loop, STAGE, {"N": n}, {"tiles": tiles.ravel()},
                  {"features": (np.float32, n * p.spec("SEQ") * p.spec("TEXT_D"))}, done,
                  keep=("features",), on_submit=self.submitted)

    def apply(self, work, values, error):
        if error is not None:
            for job in work:
                job.done(None, error)
            return
        seq = self.prepared.spec("SEQ")
        shared = {"buffer": values["features"], "users": len(work)}
        at = 0
        for job in work:
            rows = len(job.tiles) * seq
            features = Features(shared, at, rows)
            at += rows
            self.images += job.images
            self.tiles += len(job.tiles)
            if job.gone:
                features.release()
            else:
                job.done(features, None)
