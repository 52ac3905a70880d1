"""Every OpenCL CPU driver this machine has, side by side on the same kernels: prints figures, asserts nothing.

For each driver (Intel's runtime from .venv, each system driver in
/etc/OpenCL/vendors, and the PoCL of pocl-binary-distribution where it is
installed beside pyopencl), runs
bench/llama.py in a fresh process with that driver the only one the ICD
loader sees (OCL_ICD_VENDORS naming a folder with just its .icd; a PoCL beside
pyopencl cannot be hidden, so each run also selects its driver with --device).
Drivers whose probe fails here are listed with the reason and skipped. Rounds
alternate drivers, so drift on a noisy machine hits each alike; the summary
prints prefill and decode tok/s per weight type and driver, and each
driver's ratio to the first column.

    python bench/drivers.py [--rounds 1] [--dtypes F16,Q8_0,Q4_0] [--decode 32] [--script llama.py]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.device import SYSTEM_VENDORS, _intel_runtime  # noqa: E402


def configurations(scratch):
    """(label, --device selector, vendors folder) for every driver installed."""
    found = []
    intel = _intel_runtime()
    if intel is not None:
        folder = Path(scratch, "intel")
        folder.mkdir()
        (folder / "intel.icd").write_text(f"{intel}\n")
        found.append(("intel (.venv)", "intel", folder))
    system = Path(os.environ.get("OPENCL_VENDOR_PATH") or SYSTEM_VENDORS)
    for icd in sorted(system.glob("*.icd")) if system.is_dir() else ():
        if "intel" in icd.name:
            continue
        folder = Path(scratch, icd.stem)
        folder.mkdir()
        (folder / icd.name).write_text(icd.read_text())
        driver = "pocl" if "pocl" in icd.read_text() else icd.stem
        found.append((f"{icd.stem} ({icd.parent})", driver, folder))
    bundled = Path(scratch, "bundled")
    bundled.mkdir()                  # nothing but what pyopencl's loader adds by itself
    found.append(("pocl (beside pyopencl)", "pocl", bundled))
    return found


def probe(selector, folder):
    """(usable, the --list-devices table) with only `folder`'s drivers visible."""
    env = dict(os.environ, OCL_ICD_VENDORS=str(folder))
    run = subprocess.run([sys.executable, "-m", "loom", "--list-devices", "--device", selector],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return run.returncode == 0, run.stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dtypes", default="F16,Q8_0,Q4_0")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--script", default="llama.py", help="the bench/ script to run per driver (llama.py or kernels.py)")
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="loom-bench-drivers-") as scratch:
        drivers = []
        for label, selector, folder in configurations(scratch):
            usable, table = probe(selector, folder)
            print(f"== {label}: {'usable' if usable else 'skipped'}\n{table}\n")
            if usable:
                drivers.append((label, selector, folder))
        figures = {}   # (dtype, label) -> [(prefill, decode)]
        for r in range(args.rounds):
            for label, selector, folder in drivers:
                cmd = [sys.executable, str(ROOT / "bench" / args.script), "--device", selector] + extra
                if args.script == "llama.py":
                    cmd += ["--dtypes", args.dtypes, "--decode", str(args.decode), "--rows", ""]
                env = dict(os.environ, OCL_ICD_VENDORS=str(folder))
                print(f"== round {r + 1}, {label}: {' '.join(cmd[1:])}", flush=True)
                run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                print(run.stdout + run.stderr[-2000:], flush=True)
                for m in re.finditer(r"^(F16|F32|Q8_0|Q4_0)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", run.stdout, re.M):
                    figures.setdefault((m.group(1), label), []).append((float(m.group(2)), float(m.group(3))))
        if not figures:
            return
        labels = [label for label, _, _ in drivers]
        print("summary: best of rounds, tok/s (ratio to the first driver)")
        print(f"{'weights':8} {'stage':8} " + " ".join(f"{label[:24]:>32}" for label in labels))
        for dtype in args.dtypes.split(","):
            for stage, i in (("prefill", 0), ("decode", 1)):
                best = [max((f[i] for f in figures.get((dtype, label), [])), default=None) for label in labels]
                if best[0] is None:
                    continue
                cells = [f"{b:10.1f} ({b / best[0]:4.2f}x)" if b is not None else "-" for b in best]
                print(f"{dtype:8} {stage:8} " + " ".join(f"{c:>32}" for c in cells))


if __name__ == "__main__":
    main()
