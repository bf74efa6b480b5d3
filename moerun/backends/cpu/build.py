"""The CPU kernels (kernels/*.c) compiled at first use with this machine's C compiler ($CC,
else cc, gcc or clang) and cached as cache_dir()/cpu-kernels/<key>/libmoerun_cpu.so, where the
key hashes the sources, the compiler's identity and the flags: a new version or compiler builds
anew, a second process (or run) only loads. Nothing is compiled at install time, so installing
needs no compiler; a machine without one gets KernelsUnavailable and the numpy path.

Each instruction set's file is compiled with its own flags and the library picks among them
at run time (isa.c), so one build serves any CPU of the architecture. A variant the compiler
cannot build (an old compiler without AVX-512, say) is left out; the others still load.
The files compile in parallel: about 1 s on 2 cores with gcc 12.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moerun.errors import MoerunError
from moerun.paths import cache_dir

KERNEL_DIR = Path(__file__).parent / "kernels"
LIBRARY_NAME = "libmoerun_cpu.so"
FLAGS = ("-O3", "-std=c11", "-fPIC", "-pthread", "-fvisibility=hidden", "-ffp-contract=off")
COMMON_SOURCES = ("types.c", "isa.c", "pool.c", "work.c", "ffn.c", "matmul.c", "decode.c", "attention.c", "quantize.c",
                  "serve.c")
AVX2 = ("-mavx2", "-mfma", "-mf16c")
AVX512 = (*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl")
AMX = (*AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16")

logger = logging.getLogger(__name__)


class KernelsUnavailable(MoerunError):
    """The kernels cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Variant:
    name: str
    source: str
    flags: tuple[str, ...] = ()


SCALAR = Variant("scalar", "isa_scalar.c")
VARIANTS = {     # machine -> the instruction sets built for it (isa.c knows the same names)
    "x86_64": (SCALAR, Variant("avx2", "isa_avx2.c", AVX2), Variant("avx512", "isa_avx512.c", AVX512),
               Variant("amx", "isa_amx.c", AMX)),
    "aarch64": (SCALAR, Variant("neon", "isa_neon.c")),
}
MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def variants() -> tuple[Variant, ...]:
    return VARIANTS.get(MACHINES.get(platform.machine().lower(), ""), (SCALAR,))


def compiler() -> list[str]:
    """The C compiler command: $CC, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    raise KernelsUnavailable("no C compiler found (install gcc or clang, or set CC)")


def library_path() -> Path:
    """The compiled library, built first if this sources/compiler/flags combination has none."""
    command = compiler()
    key = _key(command)
    folder = cache_dir() / "cpu-kernels" / key
    library = folder / LIBRARY_NAME
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        _build(command, folder, library)
    return library


def _key(command: list[str]) -> str:
    try:
        identity = subprocess.run([*command, "--version"], capture_output=True, text=True, errors="replace",
                                  timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelsUnavailable(f"cannot run the C compiler {shlex.join(command)}: {err}") from None
    digest = hashlib.sha256()
    for part in (shlex.join(command), identity, *FLAGS, *(f"{v.name} {shlex.join(v.flags)}" for v in variants())):
        digest.update(part.encode() + b"\0")
    for source in sorted(path for path in KERNEL_DIR.iterdir() if path.suffix in (".c", ".h")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:20]


def _build(command: list[str], folder: Path, library: Path) -> None:
    """Compile every file at once, link, and move the library into place in one step (another
    process building the same library at the same time is harmless)."""
    with tempfile.TemporaryDirectory(dir=folder) as work:
        jobs = {f"{Path(source).stem}.o": (source, ()) for source in COMMON_SOURCES}
        jobs |= {f"isa_{v.name}.o": (v.source, v.flags) for v in variants()}
        running = {obj: subprocess.Popen([*command, *FLAGS, *flags, "-c", str(KERNEL_DIR / source), "-o", obj],
                                         cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         errors="replace")
                   for obj, (source, flags) in jobs.items()}
        built = []
        for obj, process in running.items():
            output = process.communicate()[0]
            if process.returncode == 0:
                built.append(obj)
            elif obj.startswith("isa_") and obj != "isa_scalar.o":
                logger.debug(f"CPU kernels: {obj[:-2]} left out, the compiler could not build it:\n{output}")
            else:
                raise KernelsUnavailable(f"the C compiler failed on {jobs[obj][0]}:\n{_tail(output)}")
        linked = Path(work) / LIBRARY_NAME
        link = subprocess.run([*command, "-shared", "-pthread", *built, "-o", str(linked), "-lm"], cwd=work,
                              capture_output=True, text=True, errors="replace")
        if link.returncode != 0:
            raise KernelsUnavailable(f"linking the CPU kernels failed:\n{_tail(link.stdout + link.stderr)}")
        os.replace(linked, library)


def _tail(output: str, lines: int = 20) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])
