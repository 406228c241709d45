"""The engine core and how front ends reach it.

- ``core``: ``EngineCore``, the scheduler / KV-cache / model-runner / sampler loop that takes
  token ids and returns token-level outputs per step;
- ``messages``: the msgspec messages between front ends and cores;
- ``client``: the clients front ends use (in-process, or engine-core processes over ZMQ);
- ``proc``: the engine-core process (its busy loop and I/O threads);
- ``processes``: starting child processes that never outlive their parent, watching them;
- ``routing``: data-parallel routing (least loaded, prefix-cache aware).

Nothing here imports the server; the core never imports a plugin.
"""
