"""GPU tests: marked ``gpu`` and skipped (with the reason) unless torch sees CUDA and CuPy can use it."""
import pytest

from deepspeed_feplb.migrate import cuda_available


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy (tests/gpu/, run by run_device_checks.sh)")


def pytest_collection_modifyitems(config, items):
    skip = None if cuda_available() else pytest.mark.skip(reason="no CUDA device usable by torch and CuPy")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
