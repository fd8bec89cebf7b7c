"""Framework probes: one design (:mod:`refrun.probes.base`), one backend module per framework.

Import the public entry points from ``refrun.torch``, ``refrun.xla`` and ``refrun.jax``.
"""
