"""models/smolvlm/vision.loom, SmolVLM's vision side as the image component runs it, against
the numpy reference (tests/smolvlm_numpy.py) on the default catalog's generated weights."""
import importlib.util
import os

import numpy as np
import pytest

from conftest import ROOT, drivers, compiler_for
from loom import runtime
from loom.device import Device

import smolvlm_numpy as ref

SOURCE = os.path.join(ROOT, "models", "smolvlm", "vision.loom")
_gen = importlib.util.spec_from_file_location("smolvlm_generate", os.path.join(ROOT, "models", "smolvlm", "generate.py"))
generate = importlib.util.module_from_spec(_gen)
_gen.loader.exec_module(generate)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("smolvlm")
    generate.generate(str(out))
    return str(out)


@pytest.fixture(scope="module")
def W(folder):
    return ref.load(folder)


@pytest.fixture(scope="module", params=drivers())
def prepared(request, folder):
    dev = Device(request.param)
    p = runtime.prepare("vision", [SOURCE], os.path.join(folder, "model.safetensors"), {}, dev,
                        compiler_for(dev))
    yield p
    p.release()


def project(p, tiles):
    dev = p.device
    n = len(tiles)
    out_rows = n * p.spec("SEQ")
    bufs = {"tiles": dev.pool.alloc(tiles.nbytes, "test", "workspace", host=np.ascontiguousarray(tiles, np.float32)),
            "features": dev.pool.alloc(4 * out_rows * p.spec("TEXT_D"), "test", "workspace")}
    box = {}
    p.plan_async("project", {"N": n}, lambda plan, error: box.update(plan=plan, error=error))
    assert box["error"] is None, box["error"]
    box["plan"].run(bufs).wait()
    got = dev.download(bufs["features"], np.float32, out_rows * p.spec("TEXT_D")).reshape(out_rows, -1)
    for buf in bufs.values():
        buf.release()
    return got


def test_specs_follow_the_checkpoint(prepared, W):
    v = W.config["vision_config"]
    assert prepared.spec("D") == v["hidden_size"] and prepared.spec("L") == v["num_hidden_layers"]
    assert prepared.spec("H") == v["num_attention_heads"] and prepared.spec("F") == v["intermediate_size"]
    assert prepared.spec("TILE") == v["image_size"] and prepared.spec("PATCH") == v["patch_size"]
    assert prepared.spec("SCALE") == W.config["scale_factor"]
    assert prepared.spec("SEQ") == ref.image_seq_len(W.config, W.processor)
    assert prepared.spec("TEXT_D") == 576


def test_tiles_of_an_image_project_as_the_reference(prepared, W):
    """An image preprocessed as SmolVLM does (tiles plus the global image), projected in one step:
    each tile's language rows equal the numpy encoder and connector's."""
    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[0:200, 0:300]
    rgb = np.stack([(xx * 255 // 299), (yy * 255 // 199), rng.integers(0, 256, (200, 300))], -1).astype(np.uint8)
    tiles, rows, cols = ref.preprocess(rgb, "high", W.preprocessor)
    assert len(tiles) == rows * cols + 1 > 2
    want = ref.connector(W, ref.vision_encoder(W, tiles), W.config["scale_factor"]).reshape(-1, 576)
    got = project(prepared, tiles)
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    print(f"{len(tiles)} tiles: max error {err:.2e} of scale {scale:.3f}")
    assert err <= 1e-5 * scale      # float32 sums of at most 768 terms; the reference rounds alike


def test_a_tile_projects_the_same_alone_and_beside_others(prepared, W):
    """Tiles never see each other: one tile's rows are the same alone as in a step of three."""
    rng = np.random.default_rng(5)
    tiles = rng.uniform(-1, 1, (3, 3, prepared.spec("TILE"), prepared.spec("TILE"))).astype(np.float32)
    seq = prepared.spec("SEQ")
    together = project(prepared, tiles)
    alone = project(prepared, tiles[1:2])
    np.testing.assert_allclose(together[seq:2 * seq], alone, rtol=0, atol=1e-6 * float(np.abs(alone).max()))


@pytest.mark.parametrize("size", [(200, 300), (90, 60), (128, 128), (37, 500), (640, 480)])
@pytest.mark.parametrize("detail", ["auto", "low", "high"])
def test_the_servers_image_processing_equals_smolvlms(W, size, detail):
    """loom/vision.py's Processor (Pillow's resampler) against the reference's integer
    re-implementation of SmolVLM's processor: the same tiles, grid and order, pixels within
    one 8-bit level (Pillow 13 may run its two passes in the other order); and the prompt
    pieces spell the processor's text."""
    from loom import vision
    rng = np.random.default_rng(size[0] * size[1])
    rgba = rng.integers(0, 256, (*size, 4), dtype=np.uint8)
    proc = vision.Processor(W.preprocessor, ref.vision_config(W.config)["image_size"])
    got, rows, cols = proc.tiles(rgba, detail)
    want, want_rows, want_cols = ref.preprocess(ref.flatten_alpha(rgba), detail, W.preprocessor)
    assert (rows, cols) == (want_rows, want_cols) and got.shape == want.shape and got.dtype == np.float32
    level = W.preprocessor["rescale_factor"] / W.preprocessor["image_std"][0]
    assert float(np.abs(got - want).max()) <= level * 1.001
    seq = ref.image_seq_len(W.config, W.processor)
    text = "".join("<image>" if is_image else piece for piece, is_image in vision.prompt_pieces(rows, cols, seq))
    assert text == "".join(ref.prompt_tokens(rows, cols, seq))
    assert sum(is_image for _, is_image in vision.prompt_pieces(rows, cols, seq)) == len(got) * seq


def live(prepared):
    """Device bytes in use, not counting released buffers the pool keeps for reuse."""
    usage = prepared.device.pool.usage()
    return usage["used"] - usage["cached_bytes"]


def test_projection_cohorts_share_a_step_and_keep_each_requests_rows(prepared, W):
    """vision.ProjectionEngine: three requests' tiles in one `project` step; each request gets
    its own rows of the device-resident output, equal to projecting it alone; a request that
    left before the step retired gives its rows back at once without moving its peers'; the
    buffer is freed with the last release (the pool back at its baseline)."""
    import time
    from loom import vision
    from loom.loop import Loop
    rng = np.random.default_rng(9)
    S, seq, width = prepared.spec("TILE"), prepared.spec("SEQ"), prepared.spec("TEXT_D")
    requests = [rng.uniform(-1, 1, (n, 3, S, S)).astype(np.float32) for n in (2, 1, 3)]
    loop = Loop(2)
    engine = vision.ProjectionEngine(prepared, loop)
    prepared.release_plans()                # plans keep their scratch: measure without any
    baseline = live(prepared)
    results = {}
    jobs = [vision.Projection(t, 1, lambda f, e, i=i: results.update({i: (f, e)})) for i, t in enumerate(requests)]
    for job in jobs:
        engine.submit(job)
    skipped = vision.Projection(requests[0], 1, lambda f, e: results.update({"skipped": (f, e)}))
    skipped.gone = True                     # left while waiting: never projected
    engine.submit(skipped)
    deadline = time.monotonic() + 60
    while engine.cohort is None and time.monotonic() < deadline:
        loop.call_later(0.01, lambda: None)
        loop.run_once()
    jobs[1].gone = True                     # its client left while the step ran
    while len(results) < 2 and time.monotonic() < deadline:
        loop.call_later(0.01, lambda: None)
        loop.run_once()
    assert sorted(results) == [0, 2] and engine.steps == 1
    stats = engine.stats()
    assert stats["images_projected"] == 3 and stats["tiles_projected"] == 6
    for i in (0, 2):
        features, error = results[i]
        assert error is None and features.count == len(requests[i]) * seq
        got = prepared.device.download(features.buffer, np.float32, 6 * seq * width).reshape(-1, width)
        np.testing.assert_array_equal(got[features.start:features.start + features.count], project(prepared, requests[i]))
    results[0][0].release()
    assert live(prepared) > baseline                            # request 2 still holds the buffer
    results[2][0].release()
    results[2][0].release()                                     # a second release is harmless
    prepared.release_plans()
    assert live(prepared) == baseline
    loop.close()


def test_projected_features_enter_the_decoder_without_leaving_the_device(tmp_path):
    """The whole device path of an image: `project` on the image component keeps its output on
    the device (run_stage keep), and the text package's advance_media takes that buffer as it
    is (run_stage bound): the logits equal those of the same features copied through the host."""
    import time
    from conftest import tiny_scout_dir
    from loom.loop import Loop
    dev = Device(None)
    compiler = compiler_for(dev)
    tower = generate.generate(str(tmp_path / "tower"), text_hidden=128)
    vision_p = runtime.prepare("v", [SOURCE], os.path.join(tower, "model.safetensors"), {}, dev, compiler)
    text_p = runtime.prepare("t", [os.path.join(ROOT, "models", "llama", "llama.loom")],
                             os.path.join(tiny_scout_dir(), "model.safetensors"),
                             {"pages": 4, "page_size": 16, "context_length": 64}, dev, compiler)
    loop = Loop(2)
    try:
        seq, V = vision_p.spec("SEQ"), text_p.spec("V")
        tiles = np.random.default_rng(2).uniform(-1, 1, (2, 3, vision_p.spec("TILE"), vision_p.spec("TILE")))
        box = {}

        def wait(key):
            deadline = time.monotonic() + 60
            while key not in box and time.monotonic() < deadline:
                loop.call_later(0.01, lambda: None)
                loop.run_once()
            values, error = box.pop(key)
            assert error is None, error
            return values

        runtime.run_stage(vision_p, loop, "project", {"N": 2}, {"tiles": tiles.astype(np.float32).ravel()},
                          {"features": (np.float32, 2 * seq * 128)}, lambda v, e: box.update(p=(v, e)),
                          keep=("features",))
        features = wait("p")["features"]
        n = 2 * seq + 3                                    # a token, the image's positions, two tokens
        at = np.array([-1] + list(range(2 * seq)) + [-1, -1], np.int32)
        tokens = np.where(at >= 0, V + 1, 7).astype(np.int32)
        host = {"tokens": tokens, "pos": np.arange(n, dtype=np.int32), "row_of": np.zeros(n, np.int32),
                "pages": np.array([0, 1, 2, 3], np.int32), "last": np.array([n - 1], np.int32), "feature_at": at}
        outputs = {"logits": (np.float32, V)}
        runtime.run_stage(text_p, loop, "advance_media", {"T": n, "R": 1}, host, outputs,
                          lambda v, e: box.update(a=(v, e)), bound={"features": features})
        on_device = wait("a")["logits"]
        copied = dev.download(features, np.float32, 2 * seq * 128)
        runtime.run_stage(text_p, loop, "advance_media", {"T": n, "R": 1}, dict(host, features=copied), outputs,
                          lambda v, e: box.update(b=(v, e)))
        np.testing.assert_array_equal(on_device, wait("b")["logits"])
        assert np.isfinite(on_device).all() and np.abs(on_device).max() > 0
        features.release()
    finally:
        loop.close()
        text_p.release()
        vision_p.release()
