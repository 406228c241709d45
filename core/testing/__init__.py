"""Testing helpers shipped with the engine.

* ``engine.testing.conformance`` — the conformance kit, a pytest plugin for vendors registered
  under the ``pytest11`` entry point: ``pytest --engine-conformance=PLUGIN``.
* ``engine.testing.suites`` — what the kit checks (its extension point) and
  ``engine.testing.builtin_suites`` — the platform, communicator, backend and kernel suites.
* ``engine.testing.inputs`` — the kit's random inputs, and ``register_kernel_inputs``.
* ``engine.testing.checks`` — the individual checks (platform, attention backends, kernels).
* ``engine.testing.distributed`` — a real multi-process communicator check.
* ``engine.testing.tiny_models`` — tiny random Hugging Face models for tests.
"""
