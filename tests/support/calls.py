"""Stand-ins that fail on purpose, for the tests that end a load at one
step (loader/test_skeleton.py in this process, loader/_dist_worker.py in a
rank's)."""


def raising(exc):
    """A callable that raises ``exc`` whatever it is given."""
    def f(*args, **kwargs):
        raise exc
    return f


def raise_on_call(n, exc, real):
    """``real``, except that its ``n``-th call raises ``exc``."""
    calls = []

    def f(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)
    return f
