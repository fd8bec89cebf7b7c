"""pytest plugin and fixtures for gradient gates in a migration's CI (see docs/gradcheck.md).

Installed with refrun (entry point ``pytest11: refrun = refrun.testing``), so every
pytest run loads it: this module imports only pytest at import time; numpy, torch and
jax are imported when a fixture is used.

The ``refrun_gradcheck`` fixture runs refrun's checks as assertions::

    def test_loss_gradient(refrun_gradcheck):
        refrun_gradcheck.known_answer(params=1.0, args=([1.0, 2.0], [0.0, 0.0]),
                                      expected_loss=2.5, expected_grad=5.0,
                                      torch_fn=torch_loss, jax_fn=jax_loss)
        refrun_gradcheck.rejects(check, jax_loss, [stop_gradient_mutation()])

Each method returns the result and raises ``AssertionError`` (message naming the
framework, quantity and parameter) when the check fails.  With
``--refrun-gradcheck-record=URI`` every test's results are also recorded as an MLflow
run with role ``gradcheck`` (workload from ``--refrun-gradcheck-workload``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refrun", "refrun gradient gates")
    group.addoption("--refrun-gradcheck-record", metavar="URI", default=None,
                    help="record refrun_gradcheck results as MLflow runs (role gradcheck) "
                         "in this tracking store")
    group.addoption("--refrun-gradcheck-workload", metavar="NAME", default="gradcheck",
                    help="workload name of recorded gradcheck runs (default: gradcheck)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gradcheck: a refrun gradient gate")


class GradcheckGate:
    """The fixture object: refrun's checks as assertions, results kept for recording."""

    def __init__(self) -> None:
        self.results: list[Any] = []

    def _keep(self, result: Any, ok: bool | None = None) -> Any:
        self.results.append(result)
        if not (result.passed if ok is None else ok):
            raise AssertionError(result.summary())
        return result

    def known_answer(self, **kwargs: Any) -> Any:
        """:func:`refrun.gradcheck.oracle.check_known_answer`, asserted."""
        from refrun.gradcheck.oracle import check_known_answer

        return self._keep(check_known_answer(**kwargs))

    def parity(self, a: Any, b: Any, mapping: Any = None, **kwargs: Any) -> Any:
        """:func:`refrun.gradcheck.parity.compare_by_name`, asserted."""
        from refrun.gradcheck.parity import compare_by_name

        return self._keep(compare_by_name(a, b, mapping, **kwargs))

    def finite_diff(self, fn: Callable[..., Any], params: Any, args: Sequence[Any] = (),
                    expect: str = "verified", **kwargs: Any) -> Any:
        """:func:`refrun.gradcheck.finite_diff.check_finite_differences`; asserts the
        verdict equals ``expect``."""
        from refrun.gradcheck.finite_diff import check_finite_differences

        r = check_finite_differences(fn, params, args, **kwargs)
        return self._keep(r, ok=r.verdict == expect)

    def finite(self, fn: Callable[..., Any], points: Any, args: Sequence[Any] = (),
               **kwargs: Any) -> Any:
        """:func:`refrun.gradcheck.nans.hunt_nonfinite`, asserted (no NaN/Inf)."""
        from refrun.gradcheck.nans import hunt_nonfinite

        return self._keep(hunt_nonfinite(fn, points, args, **kwargs))

    def precision(self, fn: Callable[..., Any], params: Any, args: Sequence[Any] = (),
                  **kwargs: Any) -> Any:
        """:func:`refrun.gradcheck.precision.precision_drift`, asserted (drift <= tol)."""
        from refrun.gradcheck.precision import precision_drift

        return self._keep(precision_drift(fn, params, args, **kwargs))

    def update_delta(self, *args: Any, **kwargs: Any) -> Any:
        """:func:`refrun.gradcheck.update_delta.update_delta_parity`, asserted."""
        from refrun.gradcheck.update_delta import update_delta_parity

        return self._keep(update_delta_parity(*args, **kwargs))

    def rejects(self, check: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any],
                mutations: Sequence[Any], name: str = "check") -> Any:
        """:func:`refrun.gradcheck.mutations.self_test_gate`, asserted: ``check`` passes
        ``fn`` and fails every mutation of it."""
        from refrun.gradcheck.mutations import self_test_gate

        return self._keep(self_test_gate(check, fn, mutations, name))


@pytest.fixture
def refrun_gradcheck(request: pytest.FixtureRequest) -> Iterator[GradcheckGate]:
    """A :class:`GradcheckGate`; its results are recorded at teardown when
    ``--refrun-gradcheck-record`` is given."""
    gate = GradcheckGate()
    yield gate
    uri = request.config.getoption("--refrun-gradcheck-record", default=None)
    if uri and gate.results:
        from refrun import schema
        from refrun.gradcheck.record import record_gradcheck

        record_gradcheck(gate.results, tracking_uri=uri, run_name=request.node.name,
                         workload=request.config.getoption("--refrun-gradcheck-workload"),
                         tags={schema.TAG_GRADCHECK_TEST: request.node.nodeid})
