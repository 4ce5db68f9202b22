# The one list of runtime-table entries, included by every module that
# fills a table (_cuda.pyx, _hip.pyx, _faults.pyx, _simulated.pyx, all in this folder).
# Each of those defines one nogil adapter per entry, named after the entry
# with a leading underscore; this assigns them, so no entry is forgotten
# when the table grows.

from instant_staging.runtime._table cimport RuntimeTable


cdef void _fill_table(RuntimeTable* t, void* ctx) noexcept:
    t.ctx = ctx
    t.host_register = _host_register
    t.host_unregister = _host_unregister
    t.host_alloc = _host_alloc
    t.free_host = _free_host
    t.get_last_error = _get_last_error
    t.peek_last_error = _peek_last_error
    t.error_name = _error_name
    t.error_string = _error_string
    t.runtime_version = _runtime_version
    t.driver_version = _driver_version
    t.device_count = _device_count
    t.get_device = _get_device
    t.set_device = _set_device
    t.device_name = _device_name
    t.pointer_type = _pointer_type
    t.device_malloc = _device_malloc
    t.device_free = _device_free
    t.memcpy_async = _memcpy_async
    t.stream_create = _stream_create
    t.stream_destroy = _stream_destroy
    t.stream_synchronize = _stream_synchronize
    t.device_synchronize = _device_synchronize
    t.event_create = _event_create
    t.event_destroy = _event_destroy
    t.event_record = _event_record
    t.event_synchronize = _event_synchronize
