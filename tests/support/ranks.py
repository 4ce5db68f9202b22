"""The process groups the tests start: ``world`` Python processes, each
a rank of a gloo group over a free port on 127.0.0.1, run to the end;
every rank's exit checked."""

import os
import socket
import subprocess

from support import PACKAGE_PARENT, TESTS


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra):
    """The environment of a rank: the package and tests/ importable, one
    OpenMP thread, no fault rules of the caller's; ``extra`` on top (a value
    of None removes that variable)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_PARENT, TESTS, os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("INSTANT_STAGING_FAULTS", None)
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_ranks(argv, world, env, cwd=None, timeout=240):
    """Runs ``argv(rank)`` for every rank at once; returns each rank's
    output once all ended (those still running at ``timeout`` are killed),
    every rank's exit status 0 asserted."""
    procs = [subprocess.Popen(argv(r), cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{text[-4000:]}"
    return outputs
