"""The digits workload: a small MLP on scikit-learn's bundled digits, in three ports.

``train_torch`` is the reference (PyTorch, CPU standing in for a GPU), ``train_jax`` and
``train_xla`` are the migrated ports (JAX on 1 or 4 devices, PyTorch/XLA on PJRT).  All
three read :mod:`pipelines.digits.config` and start from the same named initial weights
(:mod:`pipelines.digits.model`) and the same batches (:mod:`pipelines.digits.data`).
"""
