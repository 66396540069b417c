"""pytest plugin: run a test function on N CPU ranks (gloo), the way FEPLB's own suite does.

Registered through the ``pytest11`` entry point when ``deepspeed_feplb`` is installed (or load it
explicitly with ``-p deepspeed_feplb.testing.plugin``). It provides:

* the marker ``@pytest.mark.feplb_ranks(world_size, timeout=None)``: the test function runs on
  ``world_size`` spawned processes that form a gloo group (file store, free port,
  ``OMP_NUM_THREADS=1``, DeepSpeed's shm comm op not built, DeepSpeed's CPU accelerator). The
  test's fixture values and parameters are pickled to the ranks. The first failing rank's
  exception becomes the test failure (``rank 1 of 4 failed: AssertionError: ...`` + its
  traceback; plain ``assert`` statements in the test module are rewritten as pytest does); a
  rank that calls ``pytest.skip`` skips the test; a test running longer than ``timeout`` seconds
  fails, with the Python stacks of the ranks that hung. Every rank is torn down at the end (FEPLB
  shared memory included), whatever happened.
* the fixture ``feplb_run``: ``feplb_run(fn, world_size, *args, timeout=None, **kwargs)`` runs an
  importable function on the ranks and returns the per-rank results (same failure reporting).
* the ini option / command-line flag ``feplb_timeout`` / ``--feplb-timeout`` (default 300 s) and
  the environment variable ``FEPLB_TEST_TIMEOUT``: the default per-test limit.

This module imports only the standard library and pytest, so loading the plugin costs nothing
in test sessions that do not use it.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pickle
import sys
import types

import pytest

MARKER = "feplb_ranks"
DEFAULT_TIMEOUT = 300.0


def pytest_addoption(parser):
    group = parser.getgroup("deepspeed_feplb", "deepspeed_feplb multi-rank tests")
    group.addoption("--feplb-timeout", type=float, default=None, dest="feplb_timeout",
                    help="default limit in seconds for @pytest.mark.feplb_ranks tests (ini: feplb_timeout)")
    parser.addini("feplb_timeout", f"default limit in seconds for @pytest.mark.{MARKER} tests "
                  f"(default {DEFAULT_TIMEOUT:g}; env FEPLB_TEST_TIMEOUT)", default=None)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{MARKER}(world_size, timeout=None): run the test function on world_size CPU ranks (gloo, "
        "spawned processes); the failing rank's error is the test failure, a hang past timeout seconds fails")


def default_timeout(config) -> float:
    for value in (config.getoption("feplb_timeout", None), os.environ.get("FEPLB_TEST_TIMEOUT"),
                  config.getini("feplb_timeout")):
        if value not in (None, ""):
            return float(value)
    return DEFAULT_TIMEOUT


def _marker_args(marker, config) -> tuple[int, float]:
    world_size = marker.kwargs.get("world_size", marker.args[0] if marker.args else None)
    if not isinstance(world_size, int) or world_size < 1:
        raise pytest.UsageError(f"@pytest.mark.{MARKER} needs a positive world_size, e.g. @pytest.mark.{MARKER}(2); "
                                f"got {marker.args} {marker.kwargs}")
    timeout = marker.kwargs.get("timeout", marker.args[1] if len(marker.args) > 1 else None)
    return world_size, float(timeout) if timeout is not None else default_timeout(config)


def _report(run, *args, **kwargs):
    """Call ``run`` (`run_distributed`) and turn rank failures into pytest outcomes."""
    from deepspeed_feplb.testing.launcher import RankFailed, RankSkipped
    try:
        return run(*args, **kwargs)
    except RankFailed as exc:
        failure = f"rank {exc.rank} of {exc.world_size} failed: {exc.summary}\n\n{exc.details}"
    except RankSkipped as exc:
        skip = f"rank {exc.rank}: {exc.reason}"
        failure = None
    except TimeoutError as exc:
        failure = f"TimeoutError: {exc}"
    # outside the except blocks: the report shows the rank's traceback, not a chained one of ours
    if failure is None:
        pytest.skip(skip)
    pytest.fail(failure, pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    from deepspeed_feplb.testing.launcher import run_distributed
    world_size, timeout = _marker_args(marker, pyfuncitem.config)
    funcargs = pyfuncitem.funcargs
    kwargs = {name: funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}  # what pytest itself passes
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - whatever pickle raises, the test fails with the reason
            pytest.fail(f"@pytest.mark.{MARKER}: argument {name!r} ({type(value).__name__}) cannot be sent to the "
                        f"ranks: {exc}. Use picklable fixtures/parameters, or create the object inside the test.",
                        pytrace=False)
    module = pyfuncitem.module
    call = RankCall(str(module.__file__), module.__name__, pyfuncitem.function.__qualname__, pickle.dumps(kwargs))
    _report(run_distributed, call, world_size, timeout=timeout, start_method="forkserver")
    return True


@pytest.fixture
def feplb_run(request):
    """``feplb_run(fn, world_size, *args, timeout=None, **kwargs) -> [result of rank 0, ...]``: run an
    importable ``fn`` on ``world_size`` gloo ranks; a failing rank or a hang fails the test."""
    from deepspeed_feplb.testing.launcher import run_distributed

    def run(fn, world_size: int, *args, timeout: float | None = None, **kwargs):
        limit = default_timeout(request.config) if timeout is None else timeout
        return _report(run_distributed, fn, world_size, *args, timeout=limit, start_method="forkserver", **kwargs)

    return run


class RankCall:
    """A test function as the ranks see it: re-imported from its file (asserts rewritten), then called."""

    def __init__(self, path: str, module_name: str, qualname: str, kwargs: bytes):
        self.path, self.module_name, self.qualname, self.kwargs = path, module_name, qualname, kwargs

    def __call__(self):
        module = load_test_module(self.path, self.module_name)
        *owners, name = self.qualname.split(".")
        obj = module
        for owner in owners:
            obj = getattr(obj, owner)
        fn = getattr(obj() if owners else module, name)  # a test class gets a fresh instance, as in pytest
        fn(**pickle.loads(self.kwargs))


def load_test_module(path: str, name: str) -> types.ModuleType:
    """Import the test file ``path`` as module ``name`` with pytest's assertion rewriting."""
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "") or "") == os.path.realpath(path):
        return loaded
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
        rewrite_asserts(tree, source, path, None)
    except Exception:  # noqa: BLE001 - plain asserts still work, only with less detail
        pass
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    sys.modules[name] = module
    try:
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
