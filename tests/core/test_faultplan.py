"""FaultPlan parsing and decisions, and FaultyRuntime over a SimulatedRuntime."""

import ctypes
import gc
import threading

import pytest

import instant_staging as ist
from instant_staging.testing import FaultPlan, FaultRule, FaultyRuntime, SimulatedRuntime, inject_faults

from support import GiB


def host_buffer(size):
    """A host range for tests: (keep-alive object, address)."""
    buf = ctypes.create_string_buffer(size)
    return buf, ctypes.addressof(buf)


# -- parsing -------------------------------------------------------------------

@pytest.mark.parametrize("spec, rules", [
    ("register=invalid_value", [FaultRule("register", "", 0, 1)]),
    ("register>2GiB=invalid_value", [FaultRule("register", ">", 2 * GiB, 1)]),
    ("register>=512GiB=memory_allocation", [FaultRule("register", ">=", 512 * GiB, 2)]),
    ("register#4=invalid_value;unregister#1=invalid_value",
     [FaultRule("register", "#", 4, 1), FaultRule("unregister", "#", 1, 1)]),
    ("host_alloc=not_supported", [FaultRule("host_alloc", "", 0, 801)]),
    ("free_host=not_registered", [FaultRule("free_host", "", 0, 713)]),
    ("register=already_registered", [FaultRule("register", "", 0, 712)]),
    ("register=no_device", [FaultRule("register", "", 0, 100)]),
    ("register=35", [FaultRule("register", "", 0, 35)]),
    ("host_alloc>1024=2", [FaultRule("host_alloc", ">", 1024, 2)]),
    ("unregister>=4KiB=999", [FaultRule("unregister", ">=", 4096, 999)]),
    ("register>256MiB=1", [FaultRule("register", ">", 256 << 20, 1)]),
    ("  register > 2 GiB = invalid_value ;  unregister # 3 = 713 ",
     [FaultRule("register", ">", 2 * GiB, 1), FaultRule("unregister", "#", 3, 713)]),
    ("REGISTER=INVALID_VALUE", [FaultRule("register", "", 0, 1)]),
    ("register=1;", [FaultRule("register", "", 0, 1)]),
])
def test_parse_rule_forms(spec, rules):
    plan = FaultPlan.parse(spec)
    assert plan.rules == tuple(rules)
    # str() is canonical and parses back to the same rules.
    assert FaultPlan.parse(str(plan)).rules == plan.rules


def test_canonical_str():
    assert str(FaultPlan.parse(" register > 2 GiB = invalid_value ")) == "register>2GiB=invalid_value"
    assert str(FaultPlan.parse("register#4=1;unregister#1=1")) == \
        "register#4=invalid_value;unregister#1=invalid_value"
    assert str(FaultPlan.parse("register>=512GiB=2")) == "register>=512GiB=memory_allocation"
    assert str(FaultPlan.parse("register>4097=35")) == "register>4097=35"
    assert str(FaultPlan.parse("host_alloc>1536=1")) == "host_alloc>1536=invalid_value"
    assert str(FaultPlan.parse("")) == ""


@pytest.mark.parametrize("spec", ["", "   ", ";", " ; ; "])
def test_empty_spec_has_no_rules(spec):
    plan = FaultPlan.parse(spec)
    assert plan.rules == ()
    assert plan.decide("register", 1 << 40) == 0


@pytest.mark.parametrize("rule, why", [
    ("regster=1", "unknown operation 'regster' (expected register, unregister, host_alloc, "
                  "free_host, read, copy)"),
    ("register", "missing '=ERROR'"),
    ("register=", "missing error"),
    ("register=bogus", "unknown error 'bogus'"),
    ("register=-1", "unknown error '-1'"),
    ("register=0", "0 is success"),
    ("register=99999999999", "does not fit"),
    ("register#0=1", "not an integer >= 1"),
    ("register#x=1", "not an integer >= 1"),
    ("register#1.5=1", "not an integer >= 1"),
    ("register#=1", "missing N"),
    ("register>=1", "missing '=ERROR'"),
    ("register>2GiB", "missing '=ERROR'"),
    ("register>=SIZE=1", "not a size"),
    ("register>abc=1", "not a size"),
    ("register>1.5B=1", "not a whole"),
    ("register>=-4=1", "non-negative"),
    ("register<2GiB=1", "expected '#N', '>SIZE', '>=SIZE' or '=ERROR'"),
    ("=1", "missing operation"),
    ("host-alloc=1", "unknown operation 'host'"),
    ("register=1=2", "unknown error '1=2'"),
])
def test_malformed_rule_names_it(rule, why):
    with pytest.raises(ValueError) as info:
        FaultPlan.parse(rule)
    message = str(info.value)
    assert f"bad fault rule {rule.strip()!r}" in message
    assert why in message


def test_malformed_rule_among_good_ones_is_named():
    with pytest.raises(ValueError, match=r"bad fault rule 'unregister#0=1'"):
        FaultPlan.parse("register=1; unregister#0=1 ;free_host=1")


def test_exact_error_message():
    with pytest.raises(ValueError) as info:
        FaultPlan.parse("regster=1")
    assert str(info.value) == ("bad fault rule 'regster=1': unknown operation 'regster' "
                               "(expected register, unregister, host_alloc, free_host, read, copy)")


def test_parse_rejects_non_str():
    with pytest.raises(TypeError):
        FaultPlan.parse(None)
    with pytest.raises(TypeError):
        FaultPlan(["register=1"])


def test_the_variable_is_read_through_envs(monkeypatch):
    from instant_staging import envs
    monkeypatch.delenv("INSTANT_STAGING_FAULTS", raising=False)
    assert envs.get("INSTANT_STAGING_FAULTS") is None
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "  ")
    assert envs.get("INSTANT_STAGING_FAULTS") is None
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "register>2GiB=invalid_value")
    assert str(envs.get("INSTANT_STAGING_FAULTS")) == "register>2GiB=invalid_value"
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "register>2GiB=invalid")
    with pytest.raises(ValueError, match=r"INSTANT_STAGING_FAULTS: .*register>2GiB=invalid"):
        envs.get("INSTANT_STAGING_FAULTS")
    assert envs.get("INSTANT_STAGING_FAULTS", {"INSTANT_STAGING_FAULTS": "free_host=1"}).rules == \
        (FaultRule("free_host", "", 0, 1),)


# -- decisions -------------------------------------------------------------------

def test_every_call_fails():
    plan = FaultPlan.parse("register=invalid_value")
    assert [plan.decide("register", n) for n in (1, 4096, 2 * GiB)] == [1, 1, 1]
    assert plan.decide("unregister", 4096) == 0
    assert plan.decide("host_alloc", 4096) == 0


def test_size_boundaries():
    plan = FaultPlan.parse("register>2GiB=invalid_value;host_alloc>=512GiB=memory_allocation")
    assert plan.decide("register", 2 * GiB) == 0
    assert plan.decide("register", 2 * GiB + 1) == 1
    assert plan.decide("register", 2 * GiB - 1) == 0
    assert plan.decide("host_alloc", 512 * GiB - 1) == 0
    assert plan.decide("host_alloc", 512 * GiB) == 2
    assert plan.decide("host_alloc", 1024 * GiB) == 2


def test_nth_call_counts_failing_calls_too():
    plan = FaultPlan.parse("register#2=invalid_value;register#3=not_supported;unregister#1=1")
    assert [plan.decide("register", 10) for _ in range(5)] == [0, 1, 801, 0, 0]
    assert [plan.decide("unregister", 10) for _ in range(3)] == [1, 0, 0]
    assert plan.counts == {"register": 5, "unregister": 3, "host_alloc": 0, "free_host": 0,
                           "read": 0, "copy": 0}


def test_first_matching_rule_wins():
    plan = FaultPlan.parse("register>1GiB=memory_allocation;register=invalid_value")
    assert plan.decide("register", 2 * GiB) == 2
    assert plan.decide("register", 10) == 1


def test_reset_restarts_counting():
    plan = FaultPlan.parse("free_host#1=invalid_value")
    assert plan.decide("free_host") == 1
    assert plan.decide("free_host") == 0
    plan.reset()
    assert plan.counts["free_host"] == 0
    assert plan.decide("free_host") == 1


def test_decide_unknown_operation():
    with pytest.raises(ValueError, match="unknown operation"):
        FaultPlan.parse("register=1").decide("regster", 1)


def test_decide_is_thread_safe():
    plan = FaultPlan.parse("register#5000=invalid_value")
    hits = []

    def work():
        for _ in range(1000):
            code = plan.decide("register", 1)
            if code:
                hits.append(code)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert plan.counts["register"] == 8000
    assert hits == [1]  # exactly one call was the 5000th


def test_plan_equality_and_repr():
    a = FaultPlan.parse("register = 1")
    assert a == FaultPlan.parse("register=invalid_value")
    assert a != FaultPlan.parse("register=2")
    assert eval(repr(a), {"FaultPlan": FaultPlan}) == a


# -- inject_faults over a SimulatedRuntime --------------------------------------

def test_inject_faults_none_or_empty_returns_runtime():
    sim = SimulatedRuntime()
    assert inject_faults(sim, None) is sim
    assert inject_faults(sim, "") is sim
    assert inject_faults(sim, "  ") is sim


def test_inject_faults_arguments():
    sim = SimulatedRuntime()
    with pytest.raises(ValueError, match="bad fault rule 'register=oops'"):
        inject_faults(sim, "register=oops")
    with pytest.raises(TypeError):
        inject_faults(object(), "register=1")
    with pytest.raises(TypeError):
        inject_faults(sim, 42)
    plan = FaultPlan.parse("register=1")
    wrapped = inject_faults(sim, plan)
    assert isinstance(wrapped, FaultyRuntime)
    assert wrapped.plan is plan
    assert wrapped.inner is sim
    assert wrapped.name == "simulated+faults"
    assert isinstance(inject_faults(sim, "register=1").plan, FaultPlan)


def test_injected_code_pending_then_cleared():
    sim = SimulatedRuntime(backend="cuda")
    rt = inject_faults(sim, "register=invalid_value")
    _keep, ptr = host_buffer(8192)
    assert rt.host_register(ptr, 8192) == 1
    # The inner runtime never saw the call.
    assert sim.live_registrations == 0
    assert [c for c in sim.calls if c[0] == "host_register"] == []
    assert rt.peek_last_error() == 1
    assert rt.peek_last_error() == 1
    assert rt.get_last_error() == 1
    assert rt.get_last_error() == 0
    assert rt.peek_last_error() == 0
    assert rt.error_name(1) == "cudaErrorInvalidValue"
    assert rt.error_string(1) == "invalid argument"


def test_get_last_error_also_clears_the_inner_error():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "host_alloc=memory_allocation")
    assert sim.host_unregister(12345) == 713  # the inner runtime's own pending error
    assert rt.host_alloc(4096) == (2, 0)
    assert sim.live_host_allocs == 0
    assert rt.get_last_error() == 2
    assert sim.pending_error == 0
    assert rt.get_last_error() == 0


def test_a_later_real_failure_supersedes_the_injected_one():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "register=invalid_value")
    _keep, ptr = host_buffer(4096)
    assert rt.host_register(ptr, 4096) == 1
    assert rt.host_unregister(ptr) == 713  # passes through and fails for real
    assert rt.get_last_error() == 713
    assert rt.get_last_error() == 0


def test_calls_after_nth_pass_through():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "register#2=invalid_value")
    _keep, ptr = host_buffer(4 * 4096)
    codes = [rt.host_register(ptr + i * 4096, 4096) for i in range(4)]
    assert codes == [0, 1, 0, 0]
    assert rt.get_last_error() == 1
    assert sim.registered_ranges() == [(ptr, 4096), (ptr + 2 * 4096, 4096), (ptr + 3 * 4096, 4096)]
    assert rt.plan.counts["register"] == 4


def test_segment_and_rollback_failure_scenario():
    # docs/design.md: a segment fails and its rollback fails too.
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "register#4=invalid_value;unregister#1=invalid_value")
    seg = 4096
    _keep, ptr = host_buffer(4 * seg)
    assert [rt.host_register(ptr + i * seg, seg) for i in range(4)] == [0, 0, 0, 1]
    assert rt.get_last_error() == 1
    # Rollback, newest first: the first unregister is refused, the rest work.
    assert [rt.host_unregister(ptr + i * seg) for i in (2, 1, 0)] == [1, 0, 0]
    assert sim.registered_ranges() == [(ptr + 2 * seg, seg)]
    assert sim.host_unregister(ptr + 2 * seg) == 0
    assert sim.live_registrations == 0


@pytest.mark.parametrize("spec, size, code", [
    ("register>4KiB=invalid_value", 4096, 0),
    ("register>4KiB=invalid_value", 4097, 1),
    ("register>=4KiB=invalid_value", 4096, 1),
    ("register>=4KiB=invalid_value", 4095, 0),
    ("register>4096=memory_allocation", 8192, 2),
])
def test_register_size_boundary(spec, size, code):
    sim = SimulatedRuntime()
    rt = inject_faults(sim, spec)
    _keep, ptr = host_buffer(8192)
    assert rt.host_register(ptr, size) == code
    assert sim.live_registrations == (0 if code else 1)


def test_unregister_rule_uses_the_recorded_size():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "unregister>4KiB=not_supported")
    _keep, ptr = host_buffer(3 * 8192)
    big, small, unknown = ptr, ptr + 8192, ptr + 2 * 8192
    assert rt.host_register(big, 8192) == 0
    assert rt.host_register(small, 4096) == 0
    assert sim.host_register(unknown, 8192) == 0  # not through the wrapper: size 0
    assert rt.host_unregister(big) == 801
    assert rt.get_last_error() == 801
    assert rt.host_unregister(small) == 0
    assert rt.host_unregister(unknown) == 0
    assert sim.registered_ranges() == [(big, 8192)]
    # Still recorded after the refused unregister: refused again.
    assert rt.host_unregister(big) == 801


def test_free_host_rule_uses_the_allocated_size():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "free_host>=1MiB=invalid_value")
    code, big = rt.host_alloc(1 << 20)
    assert code == 0 and big
    code, small = rt.host_alloc((1 << 20) - 1)
    assert code == 0 and small
    assert rt.free_host(small) == 0
    assert rt.free_host(big) == 1
    assert sim.live_host_allocs == 1
    assert sim.free_host(big) == 0


def test_host_alloc_rule():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "host_alloc>1MiB=memory_allocation")
    assert rt.host_alloc((1 << 20) + 1) == (2, 0)
    code, ptr = rt.host_alloc(1 << 20)
    assert code == 0 and ptr % 4096 == 0
    assert sim.host_allocations() == [(ptr, 1 << 20)]
    assert rt.free_host(ptr) == 0
    assert sim.live_host_allocs == 0


def test_integer_code_named_by_inner_runtime():
    rt = inject_faults(SimulatedRuntime(backend="cuda"), "register=35")
    _keep, ptr = host_buffer(64)
    assert rt.host_register(ptr, 64) == 35
    assert rt.error_name(rt.peek_last_error()) == "cudaErrorInsufficientDriver"
    assert rt.error_name(12345) == "cudaErrorUnknown(12345)"


def test_other_entries_pass_through():
    sim = SimulatedRuntime()
    rt = inject_faults(sim, "register=1;unregister=1;host_alloc=1;free_host=1")
    assert rt.device_count() == (0, 1)
    assert rt.runtime_version() == sim.runtime_version()
    assert rt.device_name(0) == (0, "SimulatedRuntime device")
    code, dev = rt.device_malloc(64)
    assert code == 0 and sim.live_device_allocs == 1
    src = ctypes.create_string_buffer(b"x" * 64, 64)
    assert rt.memcpy_async(dev, ctypes.addressof(src), 64, 1) == 0
    assert rt.device_free(dev) == 0
    assert rt.set_device(3) == 101
    assert rt.get_last_error() == 101
    assert sim.pending_error == 0


def test_wrappers_compose():
    sim = SimulatedRuntime()
    rt = inject_faults(inject_faults(sim, "register#2=1"), "register#3=2")
    _keep, ptr = host_buffer(4 * 64)
    assert [rt.host_register(ptr + i * 64, 64) for i in range(4)] == [0, 1, 2, 0]
    assert rt.name == "simulated+faults+faults"
    assert sim.live_registrations == 2


def test_injected_error_is_per_thread():
    rt = inject_faults(SimulatedRuntime(), "register=invalid_value")
    _keep, ptr = host_buffer(64)
    seen = []

    def other():
        seen.append(rt.host_register(ptr, 64))
        seen.append(rt.peek_last_error())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [1, 1]
    assert rt.get_last_error() == 0  # this thread has nothing pending


def test_wrapper_keeps_inner_alive():
    rt = inject_faults(SimulatedRuntime(), "free_host=1")
    gc.collect()
    code, ptr = rt.host_alloc(4096)
    assert code == 0
    assert rt.inner.live_host_allocs == 1
    assert rt.free_host(ptr) == 1


def test_simulated_with_faults():
    sim = SimulatedRuntime(faults="register=invalid_value")
    _keep, ptr = host_buffer(4096)
    assert sim.name == "simulated+faults"
    assert str(sim.plan) == "register=invalid_value"
    assert sim.host_register(ptr, 4096) == 1
    assert sim.live_registrations == 0
    assert sim.pending_error == 1
    assert sim.get_last_error() == 1
    assert sim.pending_error == 0
    assert sim.get_last_error() == 0
    # Other operations run on the simulation.
    code, hptr = sim.host_alloc(4096)
    assert code == 0 and sim.live_host_allocs == 1
    assert sim.free_host(hptr) == 0
    assert sim.plan.counts["register"] == 1


def test_simulated_with_plan_object_and_without_faults():
    plan = FaultPlan.parse("unregister#1=not_registered")
    sim = SimulatedRuntime(faults=plan)
    assert sim.plan is plan
    _keep, ptr = host_buffer(64)
    assert sim.host_register(ptr, 64) == 0
    assert sim.host_unregister(ptr) == 713
    assert sim.live_registrations == 1
    assert sim.host_unregister(ptr) == 0
    assert SimulatedRuntime().plan is None
    assert SimulatedRuntime(faults="").plan is None
    with pytest.raises(ValueError, match="bad fault rule"):
        SimulatedRuntime(faults="register>x=1")


def test_simulated_with_faults_makes_no_reference_cycle():
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            sim = SimulatedRuntime(faults="register=1")
            sim.host_alloc(4096)
            del sim
        assert gc.collect() == 0
    finally:
        gc.enable()


# -- a broken plan fails closed ---------------------------------------------------

class BrokenPlan(FaultPlan):
    """A plan whose decision raises (a bug in a custom plan)."""

    def decide(self, op, size=0):
        raise RuntimeError("broken plan")


@pytest.mark.parametrize("wrap", ["inject_faults", "simulated"])
def test_a_plan_that_raises_fails_the_call_instead_of_passing_it_through(wrap, capfd):
    plan = BrokenPlan.parse("register#99=invalid_value")
    inner = SimulatedRuntime()
    rt = inject_faults(inner, plan) if wrap == "inject_faults" else SimulatedRuntime(faults=plan)
    counted = inner if wrap == "inject_faults" else rt
    code = rt.host_register(0x10000, 4096)
    assert code == 999 and rt.error_name(code).endswith("ErrorUnknown")
    assert rt.get_last_error() == 999 and rt.get_last_error() == 0
    assert counted.live_registrations == 0          # the real call never happened
    code, ptr = rt.host_alloc(4096)
    assert code == 999 and ptr == 0 and counted.live_host_allocs == 0
    err = capfd.readouterr().err
    assert "FaultyRuntime.register: internal error, the call fails" in err
    assert "RuntimeError: broken plan" in err
    # The state machine sees failures, never a silent success.
    with pytest.raises(ist.StagingError):
        ist.StagingBuffer(1 << 20, prefault_threads=0, runtime=rt)
    assert counted.live_registrations == 0 and counted.live_host_allocs == 0
