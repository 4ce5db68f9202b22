"""Shared test setup: GPU tests skip cleanly on a machine without a device."""

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_count():
    """Devices the real runtime of this build sees (0 without a GPU or driver)."""
    try:
        from instant_staging import real_runtime
        code, count = real_runtime().device_count()
    except Exception:
        return 0
    return count if code == 0 else 0


def pytest_collection_modifyitems(config, items):
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a GPU: the real runtime sees no device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu():
    """Skips unless a GPU is present; returns the device count."""
    if gpu_count() == 0:
        pytest.skip("needs a GPU")
    return gpu_count()
