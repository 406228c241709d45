"""Build the wheel and sdist of the engine and its five plugins, then `twine check --strict`
them: what would be uploaded to the package index (`tox -e dist`).

    python .ci/build_dists.py [OUTDIR]      (default: dist/)

Builds use the running environment's setuptools (`--no-isolation`; it needs setuptools >= 77 for
the SPDX license strings, and `build` and `twine`), so nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    ROOT,
    *(ROOT / "plugins" / f"engine-{p}" for p in ("cpu", "cuda", "rocm", "tpu", "triton")),
]
DISTRIBUTIONS = [
    "engine_llm",
    *(f"engine_llm_{p}" for p in ("cpu", "cuda", "rocm", "tpu", "triton")),
]


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "dist"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("engine_llm*"):
        old.unlink()
    for source in SOURCES:
        subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
            check=True,
        )
    built = sorted(out.glob("engine_llm*"))
    names = {p.name for p in built}
    missing = [
        f"{d}-0.1.0{ext}"
        for d in DISTRIBUTIONS
        for ext in ("-py3-none-any.whl", ".tar.gz")
        if f"{d}-0.1.0{ext}" not in names
    ]
    if missing:
        print(f"build_dists: not built: {missing}", file=sys.stderr)
        return 1
    subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, built)], check=True
    )
    print(f"build_dists: {len(built)} files in {out}, all pass twine check")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
