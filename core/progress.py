"""Progress display for slow start-up steps (tqdm on stderr, as the weight loaders use).

``copy_with_progress`` copies files with a byte-count bar; ``activity`` shows a running clock
for a step whose progress cannot be measured from outside (a library call that reports
nothing), so that a first start is never a silent wait.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def copy_with_progress(
    sources: Iterable[Path], out: IO[bytes], desc: str, digest: Any = None
) -> int:
    """Append every file of ``sources`` to ``out`` under one tqdm bar in bytes; feed
    ``digest`` (a ``hashlib`` object) with the same bytes. Returns the bytes written."""
    from tqdm.auto import tqdm

    sources = list(sources)
    total = sum(p.stat().st_size for p in sources)
    written = 0
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for path in sources:
            with path.open("rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
                    if digest is not None:
                        digest.update(block)
                    written += len(block)
                    bar.update(len(block))
    return written


@contextmanager
def activity(desc: str, refresh_s: float = 1.0) -> Iterator[None]:
    """A tqdm line ``desc: <elapsed>`` that ticks every ``refresh_s`` while the block runs."""
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}")
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(refresh_s):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.close()
