"""What the commands share: how versions, attempts and errors are shown.

probe, doctor and load are siblings; each imports what it needs from here,
never from one another.
"""

import json
import sys

from .._types import StagingError, format_size

# The oldest driver branch each CUDA major version's runtime runs on (the
# build's copy, for its log line, is _build_backend/backends.py's).
MIN_DRIVER = {11: "R450", 12: "R525", 13: "R580"}


def version_text(backend, value):
    """13000 -> '13.0' (CUDA); 50200003 -> '5.2.3' (HIP); 0 -> 'none'."""
    if value is None:
        return "unknown"
    if value == 0:
        return "none"
    if backend == "rocm":  # HIP_VERSION: major * 10^7 + minor * 10^5 + patch
        return f"{value // 10**7}.{value // 10**5 % 100}.{value % 10**5}"
    return f"{value // 1000}.{value % 1000 // 10}"




def driver_problem(backend, runtime_version, driver_version):
    """One line when the driver cannot run this build's runtime, else None.

    CUDA: the driver must support the runtime's major version (a 12.9
    runtime runs on a 12.2 driver; a 13.0 runtime does not run on 12.x,
    every call returning 35 cudaErrorInsufficientDriver).  0 means no driver.
    """
    if backend != "cuda" or not runtime_version:
        return None
    runtime = version_text(backend, runtime_version)
    if not driver_version:
        return (f"no NVIDIA driver found (this build links the CUDA {runtime} runtime, "
                f"which needs driver {MIN_DRIVER.get(runtime_version // 1000, '?')}+)")
    major = runtime_version // 1000
    if driver_version // 1000 >= major:
        return None
    line = (f"the NVIDIA driver supports CUDA {version_text(backend, driver_version)}, too old "
            f"for this build's CUDA {runtime} runtime (needs driver {MIN_DRIVER.get(major, '?')}+): "
            "update the driver")
    if major >= 13:
        line += (" or reinstall built for CUDA 12 (R525+): INSTANT_STAGING_CUDA=12 pip install "
                 "--no-cache-dir --force-reinstall --no-binary instant_staging instant_staging")
    return line


def attempt_dict(attempt):
    """An Attempt as the JSON object of ``attempts[]``."""
    return attempt._asdict()


def describe_attempt(a):
    """One line: step, byte range, result with the runtime's error name, seconds."""
    end = a["offset"] + a["size"]
    where = f"[{format_size(a['offset']) if a['offset'] else '0'}, {format_size(end)})"
    if a["ok"]:
        outcome = "ok"
    else:
        outcome = f"FAILED {a['name'] or 'error'}" + (f" ({a['code']})" if a["code"] else "")
    return f"{a['step']:<17} {where:<24} {outcome:<44} {a['seconds']:.4f} s"


def error_result(command, error):
    """The JSON of a failed run: ``{command, ok: false, error{type, message[, attempts]}}``."""
    out = {"command": command, "ok": False,
           "error": {"type": type(error).__name__, "message": str(error)}}
    if isinstance(error, StagingError):
        out["error"]["attempts"] = [attempt_dict(a) for a in error.attempts]
    return out


class OutputError(Exception):
    """stdout did not take the report (a full disk, a closed descriptor, a
    reader that went away): the run did not deliver what it was for."""


def write_out(text):
    """``text`` and a newline on stdout, flushed: delivered, or OutputError
    (its ``__cause__`` the OSError; none where stdout was closed)."""
    out = sys.stdout
    if out is None:             # started with descriptor 1 closed: Python has no stdout
        raise OutputError("stdout is closed")
    try:
        out.write(text + "\n")
        out.flush()
    except OSError as e:
        raise OutputError(e.strerror or str(e)) from e


def emit(as_json, result, lines):
    """Writes ``result`` as one JSON object, or ``lines`` for a terminal."""
    write_out(json.dumps(result, indent=2) if as_json else "\n".join(lines))
