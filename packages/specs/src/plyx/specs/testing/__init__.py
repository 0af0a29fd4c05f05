"""Conformance kit: behavioural tests of each contract, runnable against any implementation.

Third parties run these on their own plugins; plyx runs them on every
implementation the registry discovers. Submodules import their heavy
dependencies (torch) lazily, so importing this package costs nothing.

- ``plyx.specs.testing.kvcache``: ``check_kvcache(factory)`` for KVCache kinds.
- ``plyx.specs.testing.kernels``: ``check_kernel(...)`` for kernel implementations.
- ``plyx.specs.testing.plugins``: ``check_plugin(obj)`` for hook implementations.
"""
