"""Image input benchmark: decode and projection throughput, Loom beside numpy; prints figures, asserts nothing.

Both sides take the same PNG images (random pixels, --size square) through the same
vision tower: the default scout's generated SmolVLM-architecture component
(models/smolvlm/generate.py, in the user's cache), at detail low (one tile) and
high (SmolVLM's split: a grid of tiles plus the whole image).

Loom: what a chat request runs for its images, in-process on the default device:
images.decode_data_url and vision.Processor on CPU worker threads (the server's
executor), then vision.ProjectionEngine cohorts on the device; N concurrent requests
submit at once, so their tiles share projection steps. numpy: the same decode and
tiling (tests/smolvlm_numpy.py's integer re-implementation of Pillow's resampler),
then its encoder and connector, one image at a time (numpy's BLAS uses both cores);
the last column is numpy's encoder and connector alone, tiles made beforehand.

images/s = images / wall seconds from the first submission to the last features;
best of --repeat runs. The ratio is Loom's over numpy's (higher is faster).

    python bench/vision.py [--clients 1,8] [--repeat 3] [--size 256]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT, os.path.join(ROOT, "tests")] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import argparse  # noqa: E402
import base64  # noqa: E402
import io  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from loom import demo, images, runtime, vision  # noqa: E402
from loom.compiler import Compiler  # noqa: E402
from loom.device import Device  # noqa: E402
from loom.loop import Loop  # noqa: E402


def png_urls(n, size):
    out = []
    for seed in range(n):
        pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def loom_side(component, loop, urls, detail):
    """Decode and tile each image on the executor, project in cohorts; seconds for all."""
    engine = vision.ProjectionEngine(component, loop)
    done = []
    start = time.perf_counter()

    def tiled(result, error):
        assert error is None, error
        engine.submit(vision.Projection(result, 1, lambda features, e: done.append(features)))

    for url in urls:
        loop.run_in_executor(lambda url=url: component.processor.tiles(
            images.decode_data_url(url).pixels, detail)[0], tiled)
    while len(done) < len(urls):
        loop.call_later(0.001, lambda: None)
        loop.run_once()
    wall = time.perf_counter() - start
    for features in done:
        features.release()
    return wall, engine.tiles


def numpy_side(W, urls, detail):
    """(seconds for decode, tiling and encoding every image, seconds of the encoding alone)."""
    import smolvlm_numpy as ref
    start, encoding = time.perf_counter(), 0.0
    for url in urls:
        tiles, _, _ = ref.preprocess(images.decode_data_url(url).pixels, detail, W.preprocessor)
        t = time.perf_counter()
        ref.connector(W, ref.vision_encoder(W, tiles), W.config["scale_factor"])
        encoding += time.perf_counter() - t
    return time.perf_counter() - start, encoding


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args()
    import smolvlm_numpy as ref
    folder = demo.vision_stand_in()
    W = ref.load(folder)
    dev = Device(None)
    loop = Loop(2)
    compiler = Compiler(dev, lambda fn, done: loop.run_in_executor(fn, done))
    text_dims = {"D": 576, "V": 49152}
    component = runtime.prepare("bench/image", [os.path.join(ROOT, "models", "smolvlm", "vision.loom")],
                                os.path.join(folder, "model.safetensors"), {}, dev, compiler)

    class Primary:     # what the contract checks of the text model: its width and vocabulary
        module = type("M", (), {"commands": [type("C", (), {"name": vision.MEDIA_STAGE})]})

        def spec(self, name):
            return text_dims[name]

    vision.IMAGE.check(Primary(), component)
    clients = [int(c) for c in args.clients.split(",")]
    print(f"device: {dev.describe()}; tower: hidden {component.spec('D')}, {component.spec('L')} layers, "
          f"{component.spec('TILE')}-pixel tiles of {component.spec('SEQ')} positions; images {args.size}x{args.size} PNG")
    print(f"\n{'detail':>6} {'clients':>7} {'tiles/img':>9} {'Loom img/s':>11} {'numpy img/s':>12} {'ratio':>6} "
          f"{'numpy encoder alone':>20}")
    for detail in ("low", "high"):
        urls = png_urls(max(clients), args.size)
        loom_side(component, loop, urls[:1], detail)          # compile this geometry's kernels first
        for n in clients:
            loom_side(component, loop, urls[:n], detail)
            best_loom = min(loom_side(component, loop, urls[:n], detail)[0] for _ in range(args.repeat))
            _, tiles = loom_side(component, loop, urls[:n], detail)
            runs = [numpy_side(W, urls[:n], detail) for _ in range(args.repeat)]
            best_np, best_enc = min(r[0] for r in runs), min(r[1] for r in runs)
            print(f"{detail:>6} {n:>7} {tiles // n:>9} {n / best_loom:>11.1f} {n / best_np:>12.1f} "
                  f"{best_np / best_loom:>6.2f} {n / best_enc:>14.1f} img/s")
    component.release()
    loop.close()


if __name__ == "__main__":
    main()
