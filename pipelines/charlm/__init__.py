"""The charlm workload: a small character-level transformer language model trained on
Python's own standard-library sources, in three ports.

``train_torch`` is the reference (PyTorch, CPU standing in for a GPU), ``train_jax`` and
``train_xla`` are the migrated ports (JAX on 1 or 4 devices, PyTorch/XLA on PJRT).  All
three read :mod:`pipelines.charlm.config`, start from the same named initial weights
(:mod:`pipelines.charlm.model`) and see the same batches and dropout masks
(:mod:`pipelines.charlm.data`), so they do the same math.
"""
