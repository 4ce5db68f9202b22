"""Fixtures of the loader's tests."""

import pytest

from instant_staging.loader import empty_cache


@pytest.fixture
def empty_pool(monkeypatch):
    """The staging pool empty before and after the test, and no
    INSTANT_STAGING_KEEP_STAGING from the environment: each test makes
    (and gives back) its own staging buffers."""
    monkeypatch.delenv("INSTANT_STAGING_KEEP_STAGING", raising=False)
    empty_cache()
    yield
    empty_cache()
