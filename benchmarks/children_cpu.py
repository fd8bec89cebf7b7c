"""CPU seconds of this process's child processes (a run's delivery process), for the
benchmarks that account for what refrun spends beside the training process."""

from __future__ import annotations


def children_cpu_s() -> float:
    """CPU seconds (user + system) so far of this process's live child processes, from
    psutil; a child that exited meanwhile is not counted."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total
