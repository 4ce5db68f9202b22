# cython: language_level=3
"""Fault injection: a runtime table that fails chosen calls of another one.

``FaultyRuntime`` wraps any ``Runtime`` (CUDA, HIP, the simulated one, or
another wrapper).  Its table forwards every entry to a copy of the inner
table, except that ``host_register``, ``host_unregister``, ``host_alloc``
and ``free_host`` first ask a fault plan (``instant_staging.faults.FaultPlan``)
whether the call fails.  A failed call returns the plan's code without
reaching the inner runtime and leaves that code pending, as the real
runtime leaves its own, until ``get_last_error`` reads it.  This is how any
host plays the failing hosts of docs/design.md ("Measured") (``INSTANT_STAGING_FAULTS``).

Like the CUDA runtime, the injected pending error is per thread.  The
adapters run without the GIL and take it only to consult the plan and the
wrapper's bookkeeping; the inner call itself is made without it.
"""

from cpython.exc cimport PyErr_SetInterrupt
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport intptr_t

import sys
import traceback

from instant_staging.faults import as_plan
from instant_staging.runtime._table cimport ERROR_UNKNOWN, Runtime

# Operations a plan can fail, indexing _OP_NAMES.
cdef enum:
    OP_REGISTER = 0
    OP_UNREGISTER = 1
    OP_HOST_ALLOC = 2
    OP_FREE_HOST = 3

_OP_NAMES = ("register", "unregister", "host_alloc", "free_host")


cdef int internal_error(str where) noexcept:
    sys.stderr.write(f"{where}: internal error, the call fails (ERROR_UNKNOWN)\n")
    traceback.print_exc()
    return ERROR_UNKNOWN


cdef class FaultyRuntime(Runtime):
    """FaultyRuntime(inner, plan)
--

    ``inner`` with the faults of ``plan``.

    ``name`` is the inner name plus ``"+faults"``; ``inner`` and ``plan``
    are what it was made from.  Sizes of ``unregister`` and ``free_host``
    calls, for ``>SIZE`` rules, are those recorded when the range was
    registered or allocated through this wrapper (0 when unknown).

    Args:
        inner: the Runtime wrapped (not None).
        plan: a ``FaultPlan`` or a spec string (docs/design.md, "Faults").

    Raises:
        TypeError: ``inner`` is not a Runtime, or ``plan`` neither a spec
            str nor a FaultPlan.
        ValueError: a malformed spec (naming the bad rule).
    """

    def __init__(self, Runtime inner not None, plan):
        self._setup(inner, as_plan(plan), True)

    cdef int _setup(self, Runtime inner, object plan, bint own) except -1:
        # own=False is for a runtime wrapping its own table (SimulatedRuntime
        # with faults=): it owns us, so holding it back would be a cycle.
        self.plan = plan
        self._registered = {}
        self._allocated = {}
        self._pending = {}
        self._ctx.inner = inner.table
        self._ctx.owner = <void*>self
        if own:
            self._owner = inner
            self._inner_borrowed = NULL
        else:
            self._owner = None
            self._inner_borrowed = <void*>inner
        self.name = inner.name + "+faults"

        _fill_table(&self.table, &self._ctx)
        return 0

    @property
    def inner(self):
        """The wrapped runtime."""
        if self._owner is not None:
            return self._owner
        return <object>self._inner_borrowed

    def __repr__(self):
        return f"<FaultyRuntime {self.name!r} plan={str(self.plan)!r}>"

    # -- bookkeeping, called by the adapters with the GIL held ------------
    # All noexcept.  A plan that raises while deciding fails the call
    # (ERROR_UNKNOWN, the traceback on stderr) instead of passing it through
    # to the real runtime: faults fail closed, as the simulator does.

    cdef int _enter(self, int op, void* ptr, size_t size) noexcept:
        """Ask the plan; an injected code becomes this thread's pending error."""
        cdef int code
        try:
            if op == OP_UNREGISTER:
                size = self._registered.get(<intptr_t>ptr, 0)
            elif op == OP_FREE_HOST:
                size = self._allocated.get(<intptr_t>ptr, 0)
            code = self.plan.decide(_OP_NAMES[op], size)
        except KeyboardInterrupt:
            # A signal's, raised in the plan's Python, is no decision of the
            # plan: the call goes through, and the interrupt comes again once
            # it returns, where the caller's state is exact (a real runtime
            # runs no Python inside its calls).  Failed instead, a release's
            # unregister "failed" and retained a registration.
            PyErr_SetInterrupt()
            code = 0
        except BaseException:
            code = internal_error(f"FaultyRuntime.{_OP_NAMES[op]}")
        if code != 0:
            self._pending[PyThread_get_thread_ident()] = code
        return code

    cdef void _leave(self, int op, void* ptr, size_t size, int code) noexcept:
        """Record what the inner call did; a real failure supersedes an injected one."""
        if code != 0:
            self._pending.pop(PyThread_get_thread_ident(), None)
        elif op == OP_REGISTER:
            self._registered[<intptr_t>ptr] = size
        elif op == OP_UNREGISTER:
            self._registered.pop(<intptr_t>ptr, None)
        elif op == OP_HOST_ALLOC:
            if ptr != NULL:
                self._allocated[<intptr_t>ptr] = size
        elif op == OP_FREE_HOST:
            self._allocated.pop(<intptr_t>ptr, None)

    cdef int _take_pending(self) noexcept:
        return self._pending.pop(PyThread_get_thread_ident(), 0)

    cdef int _peek_pending(self) noexcept:
        return self._pending.get(PyThread_get_thread_ident(), 0)


def inject_faults(runtime, plan_or_spec):
    """``runtime`` wrapped in the faults of ``plan_or_spec`` (a FaultPlan or spec str).

    Args:
        runtime: the Runtime to wrap (the real one too).
        plan_or_spec: a FaultPlan, a spec str, or None.

    Returns:
        A ``FaultyRuntime`` around ``runtime``; ``None`` or an empty spec
        returns ``runtime`` itself.

    Raises:
        TypeError: ``runtime`` is not a Runtime, or ``plan_or_spec`` of
            another type.
        ValueError: a malformed spec (naming the bad rule).
    """
    if not isinstance(runtime, Runtime):
        raise TypeError(f"runtime must be a Runtime, not {type(runtime).__name__}")
    if plan_or_spec is None:
        return runtime
    if isinstance(plan_or_spec, str) and not plan_or_spec.strip():
        return runtime
    return FaultyRuntime(runtime, plan_or_spec)


# -- the table's entries ------------------------------------------------------

cdef inline FaultyRuntime _owner_of(void* ctx):
    # Only with the GIL held: the cast takes a reference.
    return <FaultyRuntime>(<FaultCtx*>ctx).owner


cdef inline int _forwarded(void* ctx, int code) noexcept nogil:
    # A failure of the inner runtime is now its latest error; drop an older
    # injected one so get_last_error reports the newest, as the driver does.
    if code != 0:
        with gil:
            _owner_of(ctx)._pending.pop(PyThread_get_thread_ident(), None)
    return code


cdef int _host_register(void* ctx, void* ptr, size_t size,
                        unsigned int flags) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    cdef int code
    with gil:  # the plan is Python
        code = _owner_of(ctx)._enter(OP_REGISTER, ptr, size)
    if code != 0:
        return code  # injected: the inner runtime never sees the call
    code = c.inner.host_register(c.inner.ctx, ptr, size, flags)
    with gil:
        _owner_of(ctx)._leave(OP_REGISTER, ptr, size, code)
    return code


cdef int _host_unregister(void* ctx, void* ptr) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    cdef int code
    with gil:
        code = _owner_of(ctx)._enter(OP_UNREGISTER, ptr, 0)
    if code != 0:
        return code
    code = c.inner.host_unregister(c.inner.ctx, ptr)
    with gil:
        _owner_of(ctx)._leave(OP_UNREGISTER, ptr, 0, code)
    return code


cdef int _host_alloc(void* ctx, void** ptr, size_t size,
                     unsigned int flags) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    cdef int code
    with gil:
        code = _owner_of(ctx)._enter(OP_HOST_ALLOC, NULL, size)
    if code != 0:
        ptr[0] = NULL  # as a failed cudaHostAlloc: nothing to free
        return code
    code = c.inner.host_alloc(c.inner.ctx, ptr, size, flags)
    with gil:
        _owner_of(ctx)._leave(OP_HOST_ALLOC, ptr[0] if code == 0 else NULL, size, code)
    return code


cdef int _free_host(void* ctx, void* ptr) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    cdef int code
    with gil:
        code = _owner_of(ctx)._enter(OP_FREE_HOST, ptr, 0)
    if code != 0:
        return code
    code = c.inner.free_host(c.inner.ctx, ptr)
    with gil:
        _owner_of(ctx)._leave(OP_FREE_HOST, ptr, 0, code)
    return code


cdef int _get_last_error(void* ctx) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    cdef int injected, code
    with gil:
        injected = _owner_of(ctx)._take_pending()
    # Reset the inner runtime's error too: one read leaves nothing pending.
    code = c.inner.get_last_error(c.inner.ctx)
    return injected if injected != 0 else code


cdef int _peek_last_error(void* ctx) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    cdef int injected
    with gil:
        injected = _owner_of(ctx)._peek_pending()
    if injected != 0:
        return injected
    return c.inner.peek_last_error(c.inner.ctx)


# The rest forward unchanged (an injected code's name and string come from
# the inner runtime, which knows the codes).

cdef const char* _error_name(void* ctx, int code) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return c.inner.error_name(c.inner.ctx, code)


cdef const char* _error_string(void* ctx, int code) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return c.inner.error_string(c.inner.ctx, code)


cdef int _runtime_version(void* ctx, int* value) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.runtime_version(c.inner.ctx, value))


cdef int _driver_version(void* ctx, int* value) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.driver_version(c.inner.ctx, value))


cdef int _device_count(void* ctx, int* value) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.device_count(c.inner.ctx, value))


cdef int _get_device(void* ctx, int* value) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.get_device(c.inner.ctx, value))


cdef int _set_device(void* ctx, int value) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.set_device(c.inner.ctx, value))


cdef int _device_name(void* ctx, int device, char* name, size_t length) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.device_name(c.inner.ctx, device, name, length))


cdef int _pointer_type(void* ctx, void* ptr, int* memory_type) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.pointer_type(c.inner.ctx, ptr, memory_type))


cdef int _device_malloc(void* ctx, void** ptr, size_t size) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.device_malloc(c.inner.ctx, ptr, size))


cdef int _device_free(void* ctx, void* ptr) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.device_free(c.inner.ctx, ptr))


cdef int _memcpy_async(void* ctx, void* dst, const void* src, size_t size,
                       int kind, void* stream) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.memcpy_async(c.inner.ctx, dst, src, size, kind, stream))


cdef int _stream_create(void* ctx, void** stream) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.stream_create(c.inner.ctx, stream))


cdef int _stream_destroy(void* ctx, void* stream) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.stream_destroy(c.inner.ctx, stream))


cdef int _stream_synchronize(void* ctx, void* stream) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.stream_synchronize(c.inner.ctx, stream))


cdef int _device_synchronize(void* ctx) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.device_synchronize(c.inner.ctx))


cdef int _event_create(void* ctx, void** event) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.event_create(c.inner.ctx, event))


cdef int _event_destroy(void* ctx, void* event) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.event_destroy(c.inner.ctx, event))


cdef int _event_record(void* ctx, void* event, void* stream) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.event_record(c.inner.ctx, event, stream))


cdef int _event_synchronize(void* ctx, void* event) noexcept nogil:
    cdef FaultCtx* c = <FaultCtx*>ctx
    return _forwarded(ctx, c.inner.event_synchronize(c.inner.ctx, event))


include "_fill.pxi"   # _fill_table: every entry from the adapters above
