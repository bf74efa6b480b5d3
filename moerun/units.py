"""Byte sizes as people write them: 24GiB, 512MiB, 64GB, 1000000."""
from __future__ import annotations

import os
import re

from moerun.errors import UsageError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str) -> int:
    """'24GiB' -> 25769803776; a ValueError naming `flag` for anything else."""
    match = SIZE.match(text)
    if not match or match[2].lower() not in UNITS:
        raise UsageError(f"{flag}: cannot read size {text!r} (write e.g. 24GiB, 512MiB, 64GB)")
    return int(float(match[1]) * UNITS[match[2].lower()])


def available_host_bytes() -> int:
    """Memory the host can still give out without swapping (MemAvailable on Linux)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(nbytes: int) -> str:
    """25769803776 -> '24.00 GiB', 3145728 -> '3.0 MiB'."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
