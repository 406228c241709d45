"""AMD GPU architectures (``gfx942``, ``gfx90a``, ``gfx1100``, ...): parsing, families, and what
follows from them. Pure Python: nothing here touches a device.

A gfx name is ``gfx`` + major + minor digit + stepping (a hex digit): gfx942 is 9.4 stepping 2,
gfx90a is 9.0 stepping 10, gfx1100 is 11.0 stepping 0. The KFD topology reports the same as an
integer ``gfx_target_version`` of the form ``MMmmss`` in decimal (90402, 90010, 110000).
The *capability* the engine sees (``Platform.device_capability``) is ``(major, minor)``, as a
ROCm build of torch reports it; the *family* (``gfx94``) keys per-architecture data such as the
Triton tuning tables.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^gfx(\d+)([0-9a-f])([0-9a-f])$")


def parse_gfx(name: str) -> tuple[int, int, int]:
    """``"gfx942:sramecc+:xnack-"`` -> ``(9, 4, 2)`` (feature flags after ``:`` are ignored)."""
    base = name.strip().lower().split(":")[0]
    match = _NAME.match(base)
    if not match:
        raise ValueError(f"not an AMD gfx architecture name: {name!r} (expected e.g. gfx942)")
    major, minor, stepping = match.groups()
    return int(major), int(minor, 16), int(stepping, 16)


def gfx_from_target_version(version: int) -> str:
    """KFD's ``gfx_target_version`` (90402) -> ``"gfx942"``; 90010 -> ``"gfx90a"``."""
    if version <= 0:
        raise ValueError(f"gfx_target_version {version} is not a GPU")
    major, rest = divmod(int(version), 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"


def capability(name: str) -> tuple[int, int]:
    """``(major, minor)``: gfx942 -> (9, 4), gfx1100 -> (11, 0)."""
    major, minor, _ = parse_gfx(name)
    return major, minor


def family(name: str) -> str:
    """The tuning family: the name without its stepping (gfx942 and gfx941 -> ``gfx94``)."""
    major, minor, _ = parse_gfx(name)
    return f"gfx{major}{minor:x}"


# Which float8 flavour each family computes in. CDNA3 (MI300, gfx94x) implements the "fnuz"
# variants (no negative zero, one NaN, exponent bias 8); CDNA4 (MI350, gfx95x) and RDNA4
# (gfx12) implement the OCP formats that NVIDIA uses (e4m3fn). Older GPUs have no fp8 units.
FP8_BY_FAMILY = {
    "gfx94": "float8_e4m3fnuz",
    "gfx95": "float8_e4m3fn",
    "gfx120": "float8_e4m3fn",
}


def fp8_dtype(name: str) -> str | None:
    """The torch float8 dtype name for fp8 weights and caches on ``name``, or None."""
    fam = family(name)
    for prefix, dtype in FP8_BY_FAMILY.items():
        if fam.startswith(prefix):
            return dtype
    return None
