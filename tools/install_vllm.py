"""Installs vLLM VERSION from PyPI into the running Python as vLLM pins its
requirements (``tox -e vllm-0.33``, ``tox -e vllm-0.34``).

    python tools/install_vllm.py 0.34.0 [--without NAME ...]

``--without NAME``: a requirement of vLLM's that PyPI cannot satisfy, left
out (vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, which PyPI does not
have: ``pip install vllm==0.34.0`` fails).  vLLM is then installed without
its dependencies and every other requirement of its metadata (no extras,
markers evaluated for this Python) as it names them.  Nothing is done when
VERSION is installed already; a failed install removes vLLM again, so that
the next run starts over.
"""

import argparse
import importlib
import importlib.metadata
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def installed(name):
    importlib.invalidate_caches()
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip(*args):
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode


def requirements(without):
    """vLLM's installed requirements (no extras), less those named in ``without``."""
    kept, left = [], []
    for text in importlib.metadata.requires("vllm") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        (left if canonicalize_name(req.name) in without else kept).append(str(req).split(";")[0].strip())
    return kept, left


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version")
    parser.add_argument("--without", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    if installed("vllm") == args.version:
        print(f"vllm {args.version} is installed")
        return 0
    if not args.without:
        return pip(f"vllm=={args.version}")
    rc = pip("--no-deps", f"vllm=={args.version}")
    if rc:
        return rc
    kept, left = requirements({canonicalize_name(n) for n in args.without})
    rc = pip(*kept)
    if rc:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "vllm"], check=False)
        return rc
    print(f"vllm {args.version} installed without: {', '.join(left) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
