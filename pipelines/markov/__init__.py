"""The markov workload: a small GRU classifying which of several Markov chains generated a
symbol sequence, in three ports.

``train_torch`` is the reference (PyTorch, CPU standing in for a GPU), ``train_jax`` and
``train_xla`` are the migrated ports (JAX on 1 or 4 devices, PyTorch/XLA on PJRT).  All
three read :mod:`pipelines.markov.config`, start from the same named initial weights
(:mod:`pipelines.markov.model`) and see the same batches (:mod:`pipelines.markov.data`,
generated in the repository from a fixed seed: nothing is downloaded), so a port given a
reference seed does the same math as that seed's reference run.
"""
