"""probe: run the staging state machine once and show which path worked, and why.

``probe()`` picks a runtime (the real one, the real one wrapped in faults,
or the SimulatedRuntime when there is no usable GPU or when asked), makes
one StagingBuffer, and, when a device is there, copies the whole buffer to
it and back in chunks split at registration boundaries (``spans``) and
checks the data.  It returns a plain dict (what ``--json`` prints);
``format_text()`` renders it for a terminal and ``exit_code()`` maps it to
the CLI's status.  Nothing here prints.
"""

import random
import time

from .. import defaults
from .._staging import StagingBuffer
from .._types import RuntimeCallError, StagingError, format_rate, format_size
from .report import attempt_dict, describe_attempt, driver_problem, version_text

H2D = 1  # memcpy kinds of the runtime table
D2H = 2


class UsageError(ValueError):
    """A probe argument the state machine refused before allocating anything."""


# -- choosing the runtime ------------------------------------------------------

def gpu_status(runtime):
    """What ``runtime`` says about devices: a dict with ``available``, ``reason``."""
    status = {"available": False, "code": 0, "error": "", "device_count": 0,
              "device_name": "", "reason": ""}
    try:
        count = runtime.check(*runtime.device_count(), call="device_count")
    except RuntimeCallError as e:
        status.update(code=e.code, error=e.name, reason=str(e))
        return status
    status.update(available=count > 0, device_count=count)
    if count == 0:
        status["reason"] = "the runtime sees 0 devices"
    else:
        try:
            status["device_name"] = runtime.check(*runtime.device_name(0), call="device_name")
        except RuntimeCallError:
            pass
    return status


def _load_real_runtime():
    from ..runtime import real_runtime
    return real_runtime()


def _plan(faults):
    """A fresh FaultPlan from a spec string or plan; None for no faults."""
    from ..faults import FaultPlan
    if faults is None:
        return None
    if isinstance(faults, FaultPlan):
        return faults
    return FaultPlan.parse(faults)


def env_plan():
    from .. import envs
    try:
        return envs.get("INSTANT_STAGING_FAULTS")
    except ValueError as e:
        raise UsageError(str(e)) from None


def select_runtime(*, simulate=False, faults=None, require_gpu=False,
                   real_runtime=_load_real_runtime):
    """(runtime or None, info dict).

    ``faults`` (a spec or FaultPlan) wraps the chosen runtime in a fresh
    plan; without it INSTANT_STAGING_FAULTS applies.  ``real_runtime`` is
    injectable so tests can play a host without a GPU.  Returns None as the
    runtime when ``require_gpu`` and there is no usable GPU.
    """
    plan = _plan(faults)
    info = {"simulated": bool(simulate), "gpu": None, "versions": {},
            "faults": str(plan) if plan is not None else None,
            "faults_from": "--faults" if plan is not None else None}
    if not simulate:
        try:
            real = real_runtime()
            info["gpu"] = gpu_status(real)
            info["versions"] = _versions(real)  # of the real runtime, even when simulating
            if not info["gpu"]["available"]:
                from .. import BACKEND
                problem = driver_problem(BACKEND, info["versions"].get("runtime_version"),
                                         info["versions"].get("driver_version"))
                if problem:  # says why, instead of a bare error 35
                    info["gpu"]["reason"] += f": {problem}"
        except (ImportError, OSError) as e:
            real = None
            info["gpu"] = {"available": False, "code": None, "error": type(e).__name__,
                           "device_count": 0, "device_name": "",
                           "reason": f"the runtime could not be loaded: {e}"}
        if info["gpu"]["available"]:
            return _real_with_faults(real, plan, info), info
        if require_gpu:
            return None, info
        info["simulated"] = True
    if plan is None:
        plan = env_plan()
        if plan is not None:
            info["faults"], info["faults_from"] = str(plan), "INSTANT_STAGING_FAULTS"
    from ..runtime._simulated import SimulatedRuntime
    return SimulatedRuntime(faults=plan), info


def _real_with_faults(real, plan, info):
    if plan is not None:
        from ..runtime._faults import inject_faults
        return inject_faults(real, plan)
    from .. import envs
    from ..runtime import default_runtime
    try:
        env = envs.get("INSTANT_STAGING_FAULTS")
        runtime = default_runtime()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if env is not None:
        info["faults"], info["faults_from"] = str(env), "INSTANT_STAGING_FAULTS"
    return runtime


# -- the buffer ---------------------------------------------------------------

def _make_buffer(size, runtime, options):
    """(buffer or None, result fields); bad arguments raise UsageError."""
    t0 = time.perf_counter()
    try:
        buf = StagingBuffer(size, runtime=runtime, **options)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    except StagingError as e:
        fields = {"ok": False, "kind": None, "pinned": False, "segments": [],
                  "attempts": [attempt_dict(a) for a in e.attempts],
                  "create_seconds": time.perf_counter() - t0,
                  "error": {"type": type(e).__name__, "message": str(e), "code": e.code,
                            "retained_ranges": [list(r) for r in
                                                getattr(e, "retained_ranges", ())]}}
        return None, fields
    fields = {"ok": True, "kind": buf.kind.name, "pinned": buf.pinned,
              "hugepages": {"on": buf.hugepages, "why": buf.hugepages_reason},
              "segment_size": buf.segment_size,
              "segments": [list(s) for s in buf.segments],
              "attempts": [attempt_dict(a) for a in buf.attempts],
              "create_seconds": time.perf_counter() - t0, "error": None}
    return buf, fields


# -- the copy check -------------------------------------------------------------

class _CopyFailed(Exception):
    pass


def _chunks(size, chunk_size):
    for index, offset in enumerate(range(0, size, chunk_size)):
        yield index, offset, min(chunk_size, size - offset)


def _pattern_block(chunk_size):
    # Random bytes, so that a copy of the wrong source or a partial copy
    # cannot match by accident; each chunk also carries its own index.
    return random.Random(0x1A57).randbytes(chunk_size)


def _fill(view, size, chunk_size, block):
    for index, offset, n in _chunks(size, chunk_size):
        view[offset:offset + n] = block[:n]
        head = min(8, n)
        view[offset:offset + head] = index.to_bytes(8, "little")[:head]


def _first_mismatch(view, size, chunk_size, block):
    """The offset of the first chunk that differs from the pattern, or None."""
    tail = block[8:]
    for index, offset, n in _chunks(size, chunk_size):
        head = min(8, n)
        if view[offset:offset + head].tobytes() != index.to_bytes(8, "little")[:head]:
            return offset
        if n > 8 and view[offset + 8:offset + n].tobytes() != (tail if n == chunk_size
                                                                else tail[:n - 8]):
            return offset
    return None


def _copy_all(buf, device_ptr, stream, chunk_size, kind):
    """Copies the buffer chunk by chunk, each chunk split by spans(); the
    number of copies issued and of chunks that had to be split."""
    runtime, base = buf.runtime, buf.ptr
    copies = split = 0
    for _, offset, n in _chunks(buf.size, chunk_size):
        spans = buf.spans(offset, n)
        split += len(spans) > 1
        for ptr, length in spans:
            device = device_ptr + (ptr - base)
            dst, src = (device, ptr) if kind == H2D else (ptr, device)
            direction = "host-to-device" if kind == H2D else "device-to-host"
            runtime.check(runtime.memcpy_async(dst, src, length, kind, stream),
                          call=f"{direction} copy of {format_size(length)} at offset {ptr - base}")
            copies += 1
    runtime.check(runtime.stream_synchronize(stream), call="stream_synchronize")
    return copies, split


def copy_check(buf, chunk_size=defaults.CHUNK_SIZE):
    """Fills ``buf`` with a pattern, copies it to the device and back through
    its own runtime, and compares.  Returns the ``copy`` dict of the result."""
    runtime, size = buf.runtime, buf.size
    result = {"ok": False, "bytes": size, "chunk_size": chunk_size, "chunks": 0,
              "copies": 0, "split_chunks": 0, "h2d_seconds": None, "h2d_gbps": None,
              "d2h_seconds": None, "d2h_gbps": None, "verified": False, "error": None}
    block = _pattern_block(min(chunk_size, size))
    view = memoryview(buf)
    try:
        device_ptr = runtime.check(*runtime.device_malloc(size),
                                   call=f"device_malloc of {format_size(size)}")
    except RuntimeCallError as e:
        view.release()
        result["error"] = str(e)
        return result
    stream = 0
    try:
        stream = runtime.check(*runtime.stream_create(), call="stream_create")
        _fill(view, size, chunk_size, block)
        t0 = time.perf_counter()
        copies, split = _copy_all(buf, device_ptr, stream, chunk_size, H2D)
        result["h2d_seconds"] = time.perf_counter() - t0
        # Clear the host side so that the read-back proves the device held it.
        zeros = bytes(min(chunk_size, size))
        for _, offset, n in _chunks(size, chunk_size):
            view[offset:offset + n] = zeros[:n]
        t0 = time.perf_counter()
        _copy_all(buf, device_ptr, stream, chunk_size, D2H)
        result["d2h_seconds"] = time.perf_counter() - t0
        result.update(chunks=-(-size // chunk_size), copies=copies, split_chunks=split)
        result["h2d_gbps"] = size / max(result["h2d_seconds"], 1e-9) / 1e9
        result["d2h_gbps"] = size / max(result["d2h_seconds"], 1e-9) / 1e9
        bad = _first_mismatch(view, size, chunk_size, block)
        result["verified"] = bad is None
        if bad is not None:
            raise _CopyFailed(f"data read back differs from what was copied, "
                              f"first in the chunk at offset {bad}")
        result["ok"] = True
    except (_CopyFailed, RuntimeCallError) as e:
        result["error"] = str(e)
    finally:
        view.release()
        if stream:
            runtime.stream_destroy(stream)
        runtime.device_free(device_ptr)
        runtime.get_last_error()
    return result


# -- the whole probe -------------------------------------------------------------

def _versions(runtime):
    out = {}
    for key in ("runtime_version", "driver_version"):
        try:
            out[key] = runtime.check(*getattr(runtime, key)(), call=key)
        except RuntimeCallError:
            out[key] = None
    return out


def probe(size=defaults.STAGING_SIZE, *, segment_size=defaults.SEGMENT_SIZE, copy_unit=None,
          hugepages=None, prefault_threads=None, allow_pageable=False, faults=None,
          simulate=False, require_gpu=False, chunk_size=defaults.CHUNK_SIZE, copy=True,
          real_runtime=_load_real_runtime):
    """Runs the state machine once (and the copy check); returns the result dict.

    Raises UsageError for arguments refused before anything is allocated
    and ValueError for a malformed fault spec.
    """
    from .._build_config import BACKEND
    if chunk_size <= 0:
        raise UsageError(f"chunk_size must be > 0, got {chunk_size}")
    runtime, info = select_runtime(simulate=simulate, faults=faults,
                                   require_gpu=require_gpu, real_runtime=real_runtime)
    result = {"command": "probe", "backend": BACKEND, "simulated": info["simulated"],
              "runtime": runtime.name if runtime is not None else None,
              "runtime_version": None, "driver_version": None, "gpu": info["gpu"],
              "faults": info["faults"], "faults_from": info["faults_from"],
              "size": size, "segment_size": segment_size, "copy_unit": copy_unit,
              "chunk_size": chunk_size, "ok": False, "kind": None, "pinned": False,
              "hugepages": None, "segments": [], "attempts": [], "create_seconds": None, "error": None,
              "copy": None}
    result.update(info["versions"])  # the build's runtime beside the driver, GPU or not
    if runtime is None:
        result["error"] = {"type": "NoGPU", "message": "no usable GPU (--require-gpu): "
                           + info["gpu"]["reason"], "code": info["gpu"]["code"],
                           "retained_ranges": []}
        return result
    options = {"segment_size": segment_size, "copy_unit": copy_unit, "hugepages": hugepages,
               "prefault_threads": prefault_threads, "allow_pageable": allow_pageable}
    buf, fields = _make_buffer(size, runtime, options)
    result.update(fields)
    if buf is None:
        return result
    try:
        if copy:
            result["copy"] = copy_check(buf, chunk_size)
            result["ok"] = result["copy"]["ok"]
    finally:
        release = _release(buf)
    result["release"] = release
    if not release["ok"]:
        # The buffer was made, but giving it back failed: the run failed,
        # and its report says what was retained (docs/design.md: leaked on
        # purpose, never freed while it may be registered).
        result["ok"] = False
        result["error"] = release["error"]
    return result


def _release(buf):
    t0 = time.perf_counter()
    try:
        buf.close()
    except StagingError as e:
        return {"ok": False, "seconds": time.perf_counter() - t0,
                "error": {"type": type(e).__name__, "message": str(e), "code": e.code,
                          "retained_ranges": [list(r) for r in getattr(e, "retained_ranges", ())]}}
    return {"ok": True, "seconds": time.perf_counter() - t0, "error": None}


def exit_code(result):
    """0 when the buffer was made (and the copy verified), else 1."""
    return 0 if result["ok"] else 1


# -- text ------------------------------------------------------------------------

def format_text(result):
    """The probe result as lines for a terminal."""
    lines = []
    sim = "SIMULATED " if result["simulated"] else ""
    gpu = result["gpu"]
    if gpu is not None and not gpu["available"]:
        tail = ("" if result["runtime"] is None
                else "; running the same chain on the SimulatedRuntime")
        lines.append(f"no usable GPU: {gpu['reason']}{tail}")
    if result["runtime"] is None:
        lines.append(result["error"]["message"])
        return lines
    if result["simulated"]:
        lines.append("SIMULATED: host memory stands in for the device; "
                     "times and rates are of this host, not of a GPU")
    elif gpu is not None:
        lines.append(f"device 0: {gpu['device_name']} ({result['backend']} runtime "
                     f"{version_text(result['backend'], result.get('runtime_version'))}, "
                     f"driver {version_text(result['backend'], result.get('driver_version'))})")
    if result["faults"]:
        lines.append(f"faults ({result['faults_from']}): {result['faults']}")
    lines.append(f"{sim}staging buffer of {format_size(result['size'])}, "
                 f"segments of {format_size(result['segment_size'])}")
    lines.extend("  " + describe_attempt(a) for a in result["attempts"])
    if result["kind"] is None:
        lines.append(f"{sim}{result['error']['type']}: {result['error']['message']}")
        return lines
    pinned = "pinned" if result["pinned"] else "NOT pinned: copies are several times slower"
    lines.append(f"{sim}kind: {result['kind']} ({pinned}) in {result['create_seconds']:.3f} s")
    huge = result["hugepages"]
    lines.append(f"{sim}pages: {'2 MiB huge pages' if huge['on'] else '4 KiB'} ({huge['why']})")
    lines.extend(_copy_lines(result, sim))
    release = result.get("release")
    if release is not None and not release["ok"]:
        lines.append(f"{sim}release FAILED: {release['error']['type']}: "
                     f"{release['error']['message']}")
    return lines


def _copy_lines(result, sim):
    c = result["copy"]
    if c is None:
        return []
    if c["h2d_gbps"] is None:
        return [f"{sim}copy check FAILED: {c['error']}"]
    head = (f"{sim}copy: {format_size(c['bytes'])} in {c['chunks']} chunks of "
            f"{format_size(c['chunk_size'])} ({c['copies']} copies, {c['split_chunks']} "
            f"chunks split at segment boundaries)")
    speed = (f"{sim}host-to-device {_rate(c['bytes'], c['h2d_seconds'])} ({c['h2d_seconds']:.3f} s)"
             + (f", device-to-host {_rate(c['bytes'], c['d2h_seconds'])}" if c["d2h_gbps"] else ""))
    check = "data verified" if c["ok"] else f"FAILED: {c['error']}"
    return [head, speed, f"{sim}{check}"]


def _rate(nbytes, seconds):
    return format_rate(nbytes / max(seconds, 1e-9))
