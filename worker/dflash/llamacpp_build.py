"""How llama.cpp is built here: the one definition of its CMake flags.

Read by the Python binding's build (`make setup`, `make wheels`: the Makefile runs this file
as a script, before any environment exists, so it imports nothing but the standard library),
by the llama-server / llama-bench build (`dflash.bench.llamacpp`, which CI uses too) and by
the llama-server image (the portable set).

    python3 worker/dflash/llamacpp_build.py binding     # CMAKE_ARGS for llama-cpp-python
    python3 worker/dflash/llamacpp_build.py tools       # cmake flags for llama-server/-bench
    python3 worker/dflash/llamacpp_build.py portable    # the same, for an image pulled elsewhere
    python3 worker/dflash/llamacpp_build.py digest      # names the binding's flags (the Makefile's stamp)
"""

from __future__ import annotations

import shlex
import sys

# Native code for this CPU, but never AMX: Intel Xeons with AMX offer it and the compiler emits
# it under -march=native, yet on the VMs here its tile instructions fault (SIGSEGV in
# llama_decode on the first batch; the kernel grants the permission, so only running the
# kernel tells). GCC lets an explicit -mno-* win over what -march=native implies.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_COMMON = [
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
]
_NATIVE = ["-DGGML_NATIVE=ON"]
# An image runs on CPUs other than the one that built it: x86-64-v3 (AVX2, FMA, F16C, BMI2),
# which every CPU kind here has (Zen 2 up, every Xeon), instead of this machine's extensions.
_PORTABLE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]
# The binding is only the library: no tools, no server, no multimodal helper.
BINDING = [*_COMMON, *_NATIVE, "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
# llama-server and llama-bench; the web UI would be fetched from the network (the server runs
# without it).
_TOOLS = ["-G", "Ninja", *_COMMON, "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
TOOLS = [*_TOOLS, *_NATIVE]
PORTABLE = [*_TOOLS, *_PORTABLE]
SETS = {"binding": BINDING, "tools": TOOLS, "portable": PORTABLE}


def cmake_args(which: str) -> str:
    """One shell word list (scikit-build-core splits CMAKE_ARGS as a shell does)."""
    return shlex.join(SETS[which])


def digest() -> str:
    """A short name of the binding's flags: a change of them makes `make setup` rebuild it."""
    import hashlib

    return hashlib.sha256(cmake_args("binding").encode()).hexdigest()[:12]


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in (*SETS, "digest"):
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(SETS)}|digest")
    print(digest() if sys.argv[1] == "digest" else cmake_args(sys.argv[1]))
