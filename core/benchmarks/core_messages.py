"""What one engine-core step's message costs to build, encode and decode.

    python -m engine.benchmarks.core_messages [--batch-sizes 64,256,512]

Per batch size B: an ``EngineCoreOutputs`` with B decode outputs (one new token each, request
ids as the server makes them), as the core sends once per step; microseconds to build the
Structs, to encode them to msgpack and to decode them in the front end, and the bytes on the
wire. Then the same for an ``AddRequests`` of one 256-token request (sent once per request).
"""

from __future__ import annotations

import argparse
import time
import uuid


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(100):
            fn()
        best = min(best, (time.perf_counter() - start) / 100)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    from engine.engine_core.messages import (
        AddRequests,
        Codec,
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
    )
    from engine.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="64,256,512")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    codec = Codec()
    print("| outputs per step | build us | encode us | decode us | bytes |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(batch)]

        def build(ids: list[str] = ids) -> EngineCoreOutputs:
            return EngineCoreOutputs([EngineCoreOutput(rid, [1234]) for rid in ids])

        message = build()
        data = codec.encode(message)
        build_us = _best(build, args.repeats)
        encode_us = _best(lambda message=message: codec.encode(message), args.repeats)
        decode_us = _best(lambda data=data: codec.from_core.decode(data), args.repeats)
        print(f"| {batch} | {build_us:.1f} | {encode_us:.1f} | {decode_us:.1f} | {len(data)} |")
    req = AddRequests(
        [
            EngineCoreRequest(
                f"cmpl-{uuid.uuid4().hex}-0",
                list(range(1000, 1256)),
                SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True),
                time.monotonic(),
            )
        ]
    )
    data = codec.encode(req)
    encode_us = _best(lambda: codec.encode(req), args.repeats)
    decode_us = _best(lambda: codec.to_core.decode(data), args.repeats)
    print(
        f"AddRequests, one 256-token request: encode {encode_us:.1f} us, decode "
        f"{decode_us:.1f} us, {len(data)} bytes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
