"""Image generation benchmark: seconds per image and per denoising step, Loom beside numpy;
prints figures, asserts nothing.

Both sides run the default illustrator (a generated model of Stable Diffusion 1.5's
architecture, models/sd/generate.py, in the user's cache) at its default size, steps and
guidance, one prompt and the negative prompt per image (classifier-free guidance: two UNet
evaluations a step).

Loom, end to end: a server subprocess serving only the illustrator (the default device);
C clients post at once (distinct seeds) and the round's wall time is what they waited;
s/image is that wall time over C (4 clients share denoising steps). Loom, a step: the
package's `denoise` stage alone in-process at the batch those clients make (2 latent
images a request), best of --repeat. numpy: tests/sd_numpy.py, the independent reference
the tests check Loom against, one image at a time (numpy's BLAS uses both cores): its
whole pipeline for s/image, and one step's two UNet calls.

    python bench/imagegen.py [--clients 1,4] [--repeat 3]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT, os.path.join(ROOT, "tests")] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import numpy as np  # noqa: E402

import sd_numpy as ref  # noqa: E402
from loom import demo, imagegen, runtime  # noqa: E402
from loom.compiler import Compiler, run_now  # noqa: E402
from loom.device import Device  # noqa: E402

PROMPT = "a red fox in the snow"


def start_server(port):
    doc = next(d for d in demo.catalog(recognizer=False, speaker=False, image=False) if d["model"] == "illustrator")
    catalog = os.path.join(tempfile.mkdtemp(), "catalog.json")
    with open(catalog, "w") as f:
        json.dump([doc], f)
    proc = subprocess.Popen([sys.executable, "-m", "loom", "--listen", f"tcp:127.0.0.1:{port}", "--models", catalog],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"]
            if any(m["id"] == "illustrator" for m in models):
                return proc, next(m for m in models if m["id"] == "illustrator")["loom"]
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not get ready")


def generate(port, seed):
    body = json.dumps({"model": "illustrator", "prompt": PROMPT, "seed": seed}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/images/generations", body,
                                 {"Content-Type": "application/json"})
    json.load(urllib.request.urlopen(req, timeout=600))


def loom_round(port, clients, seed):
    threads = [threading.Thread(target=generate, args=(port, seed + i)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def loom_step(prepared, model, clients, repeat):
    """The denoise stage alone at the batch `clients` requests make."""
    h, w = model.height // model.up, model.width // model.up
    n = 2 * clients
    rng = np.random.default_rng(0)
    dev = prepared.device
    inputs = {"latents": rng.standard_normal(n * h * w * model.latent).astype(np.float32),
              "t_emb": np.stack([imagegen.timestep_embedding(500, model.c0)] * n).ravel(),
              "context": rng.standard_normal(n * model.seq * model.text_d).astype(np.float32),
              "kv_offs": (np.arange(n + 1) * model.seq).astype(np.int32),
              "scales": np.zeros(n * max(1, len(model.loras)), np.float32)}
    bufs = {k: dev.pool.alloc(v.nbytes, "bench", "workspace", host=v) for k, v in inputs.items()}
    bufs["eps"] = dev.pool.alloc(4 * n * h * w * model.latent, "bench", "workspace")
    box = {}
    prepared.plan_async("denoise", {"N": n, "H": h, "W": w}, lambda plan, error: box.update(plan=plan, error=error))
    assert box["error"] is None, box["error"]
    box["plan"].run(bufs).wait()        # warm
    best = min(_timed(lambda: box["plan"].run(bufs).wait()) for _ in range(repeat))
    for b in bufs.values():
        b.release()
    return best


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=8097)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    folder = demo.illustrator_folder()
    W = ref.load(folder)

    dev = Device()
    doc = next(d for d in demo.catalog(recognizer=False, speaker=False, image=False) if d["model"] == "illustrator")
    options = imagegen.KIND.options(doc, dict(doc["options"]))
    prepared = runtime.prepare("illustrator", [os.path.join(ROOT, "models", "sd", "sd.loom")], folder, options, dev,
                               Compiler(dev, run_now), extend=imagegen.KIND.extend(doc, options, folder))
    model = imagegen.Model.of(prepared)
    steps_loom = {c: loom_step(prepared, model, c, args.repeat) for c in clients}
    prepared.release()     # before the server starts: the two never share the cores
    proc, cap = start_server(args.port)
    try:
        generate(args.port, 0)          # compiles nothing new (the probes did), warms the plans
        rounds = {c: min(loom_round(args.port, c, 100 * r) for r in range(args.repeat)) for c in clients}
    finally:
        proc.terminate()
        proc.wait(30)

    h, w = model.height // model.up, model.width // model.up
    ids, neg = ref.tokenize(W, PROMPT), ref.tokenize(W, "")
    context = ref.text_encoder(W, ids)
    latents = np.random.default_rng(0).standard_normal((4, h, w)).astype(np.float32)
    np_step = min(_timed(lambda: [ref.unet(W, latents, 500.0, context) for _ in range(2)])
                  for _ in range(args.repeat))
    np_image = min(_timed(lambda: ref.generate(W, ids, neg, latents, cap["steps"], cap["guidance_scale"]))
                   for _ in range(max(1, args.repeat - 1)))

    print(f"illustrator {cap['size']}, {cap['steps']} Euler steps, guidance {cap['guidance_scale']} "
          f"(2 UNet images a request a step); device: {dev.info['name']} ({dev.info['driver']} "
          f"{dev.info['driver_version']})")
    print(f"{'clients':>7} | {'Loom s/round':>12} | {'Loom s/image':>12} | {'numpy s/image':>13} | ratio | "
          f"{'Loom s/step':>11} | {'numpy s/step':>12} | ratio")
    for c in clients:
        per_image_np, per_step_np = np_image, np_step * c      # numpy runs the requests one after another
        print(f"{c:>7} | {rounds[c]:>12.3f} | {rounds[c] / c:>12.3f} | {per_image_np:>13.3f} | "
              f"{per_image_np / (rounds[c] / c):>5.1f} | {steps_loom[c]:>11.4f} | {per_step_np:>12.4f} | "
              f"{per_step_np / steps_loom[c]:>5.1f}")


if __name__ == "__main__":
    main()
