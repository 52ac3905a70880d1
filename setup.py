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
        "pocl-binary-distribution>=3.0",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "hypothesis>=6",
            "openai>=1.0",
            "prometheus_client>=0.17",
            "gguf>=0.10",
            "safetensors>=0.4",
            "tokenizers>=0.15",
        ],
    },
    package_data={"loom": ["py.typed"]},
    # The kernel library and reference packages, found by loom.resource() after a regular install.
    data_files=[("share/loom/opencl", glob.glob("opencl/*"))]
    + [(os.path.join("share/loom", d), glob.glob(os.path.join(d, "*"))) for d in glob.glob("models/*")],
    zip_safe=False,
)
