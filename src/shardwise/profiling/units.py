"""Number formatting shared by the profiling reports: SI prefixes for counts, binary ones for bytes."""

from __future__ import annotations

_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def si(value: float, unit: str = "", digits: int = 3) -> str:
    """`si(1.5e9, "FLOPS")` → "1.5 GFLOPS"; small values print without a prefix."""
    for scale, prefix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}".rstrip()


def binary_bytes(n: float) -> str:
    for scale, suffix in _BINARY:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{int(n)} B"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
