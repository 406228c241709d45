"""Testing helpers shipped with the engine.

* ``engine.testing.conformance`` — the conformance kit, a pytest plugin for vendors:
  ``pytest -p engine.testing.conformance --engine-conformance=PLATFORM``.
* ``engine.testing.checks`` — the individual checks (platform, attention backends, kernels).
* ``engine.testing.distributed`` — a real multi-process communicator check.
* ``engine.testing.tiny_models`` — tiny random Hugging Face models for tests.
"""
