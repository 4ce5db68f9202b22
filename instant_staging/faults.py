"""Fault plans: which runtime calls (and loader reads and copies) fail, and how.

A plan is parsed from the spec of docs/design.md ("Faults"), the value of
``INSTANT_STAGING_FAULTS``::

    SPEC  := RULE (";" RULE)*
    RULE  := OP [ "#" N | ">" SIZE | ">=" SIZE ] "=" ERROR
    OP    := register | unregister | host_alloc | free_host   (the staging runtime)
           | read | copy                                   (the loader's readers)
    N     := 1-based index of that op's call within this plan
    SIZE  := bytes with an optional KiB/MiB/GiB suffix
    ERROR := invalid_value | memory_allocation | not_supported
             | already_registered | not_registered | no_device | <integer>
             (read: an errno name such as EIO, or ``short``: the file ends there)

``FaultyRuntime`` (``instant_staging.runtime._faults``) asks ``plan.decide(op, size)``
before each staging call and, when it answers a code, fails the call with
it instead of calling the runtime; ``#N`` counts those calls in time order,
across the process's threads.  ``read`` and ``copy`` rules are resolved by
the loader's ``Plan`` (``loader/_pipeline.pyx``) by position instead, so they
fail the same chunk whatever the threads do: ``read#N`` is the N-th chunk
of each load and ``copy#N`` its N-th piece (the part of one tensor in one
chunk), both in reading order (file, then offset); ``>SIZE`` compares the
chunk's or the piece's length.  A load takes them from its staging
buffer's runtime (a FaultyRuntime's or SimulatedRuntime's plan), else from
``INSTANT_STAGING_FAULTS``.  Python, apart from the error codes it takes
from ``runtime._table`` (the one table of them).  The variable is read
through ``envs`` (``envs.get(ENV_VAR)`` is its plan); this module does not
import ``envs``, whose table imports this grammar when a spec is parsed.
"""

import errno
import re
import threading
from collections.abc import Iterable
from typing import NamedTuple

from instant_staging._types import parse_size
from instant_staging.runtime._table import ERROR_CODES

__all__ = ["ENV_VAR", "ERROR_CODES", "ERROR_NAMES", "OPERATIONS", "SHORT_READ", "FaultPlan",
           "FaultRule", "as_plan"]

ENV_VAR = "INSTANT_STAGING_FAULTS"

# The operations a rule can name, in the order error messages list them.
OPERATIONS = ("register", "unregister", "host_alloc", "free_host", "read", "copy")

# A ``read`` rule's ``short``: the read finds the end of the file where its
# chunk begins (as if the file had been truncated there).  Errno values
# are positive, so the code cannot be mistaken for one.
SHORT_READ = -1

# ERROR_CODES: the error names a rule may use; the codes are CUDA's and
# HIP's (they agree), tabled once in _table.pxd.
ERROR_NAMES = {code: name for name, code in ERROR_CODES.items()}

_INT_MAX = (1 << 31) - 1           # codes travel as a C int
_OP_RE = re.compile(r"[A-Za-z_]*")
_INT_RE = re.compile(r"[0-9]+")

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _format_size(n: int) -> str:
    # Canonical and exact: the largest unit that divides n, else bytes, so
    # that str(plan) parses back to the same plan.
    for unit, scale in _UNITS:
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


class FaultRule(NamedTuple):
    """One rule: calls of ``op`` selected by ``when`` fail with ``code``.

    ``when`` is ``""`` (every call), ``"#"`` (the ``value``-th call, 1-based),
    ``">"`` or ``">="`` (calls whose size compares so with ``value`` bytes).
    """

    op: str
    when: str
    value: int
    code: int

    def matches(self, index: int, size: int) -> bool:
        """Whether the ``index``-th call of ``op`` (1-based), of ``size`` bytes, fails."""
        if self.when == "#":
            return index == self.value
        if self.when == ">":
            return size > self.value
        if self.when == ">=":
            return size >= self.value
        return True

    def __str__(self) -> str:
        if self.op == "read":
            error = "short" if self.code == SHORT_READ else errno.errorcode.get(self.code, str(self.code))
        else:
            error = ERROR_NAMES.get(self.code, str(self.code))
        if self.when == "#":
            return f"{self.op}#{self.value}={error}"
        if self.when:
            return f"{self.op}{self.when}{_format_size(self.value)}={error}"
        return f"{self.op}={error}"


def _bad(rule: str, why: str) -> ValueError:
    return ValueError(f"bad fault rule {rule!r}: {why}")


def _parse_read_error(rule: str, text: str) -> int:
    text = text.strip()
    if text.lower() == "short":
        return SHORT_READ
    code = getattr(errno, text.upper(), None) if text.upper().startswith("E") else None
    if isinstance(code, int) and code > 0:
        return code
    if _INT_RE.fullmatch(text) and 0 < int(text) <= _INT_MAX:
        return int(text)
    raise _bad(rule, f"unknown read error {text!r} (expected an errno name such as EIO, "
               "'short', or a positive errno number)")


def _parse_error(rule: str, text: str, op: str = "") -> int:
    if op == "read":
        return _parse_read_error(rule, text)
    text = text.strip()
    if not text:
        raise _bad(rule, "missing error after '=' (expected "
                   + ", ".join(ERROR_CODES) + " or an integer code)")
    if text.lower() in ERROR_CODES:
        return ERROR_CODES[text.lower()]
    if _INT_RE.fullmatch(text):
        code = int(text)
        if code == 0:
            raise _bad(rule, "error code 0 is success, not a fault")
        if code > _INT_MAX:
            raise _bad(rule, f"error code {text} does not fit in an int")
        return code
    raise _bad(rule, f"unknown error {text!r} (expected "
               + ", ".join(ERROR_CODES) + " or an integer code)")


def _parse_rule(rule: str) -> FaultRule:
    rule = text = rule.strip()  # errors name the rule as written, less padding
    op = _OP_RE.match(text).group(0)
    rest = text[len(op):].lstrip()
    if not op:
        raise _bad(rule, "missing operation (expected " + ", ".join(OPERATIONS) + ")")
    if op.lower() not in OPERATIONS:
        raise _bad(rule, f"unknown operation {op!r} (expected " + ", ".join(OPERATIONS) + ")")
    op = op.lower()

    # ">=" before ">": the longer selector wins.
    for when in ("#", ">=", ">"):
        if rest.startswith(when):
            break
    else:
        when = ""
    if when:
        arg, eq, error = rest[len(when):].partition("=")
        if not eq:
            raise _bad(rule, "missing '=ERROR'")
        arg = arg.strip()
        if not arg:
            raise _bad(rule, f"missing {'N' if when == '#' else 'SIZE'} after {when!r}")
        if when == "#":
            if not _INT_RE.fullmatch(arg) or int(arg) < 1:
                raise _bad(rule, f"call index {arg!r} is not an integer >= 1")
            value = int(arg)
        else:
            try:
                value = parse_size(arg)
            except (TypeError, ValueError) as e:
                raise _bad(rule, str(e)) from None
    elif rest.startswith("="):
        value, error = 0, rest[1:]
    elif not rest:
        raise _bad(rule, "missing '=ERROR'")
    else:
        raise _bad(rule, f"expected '#N', '>SIZE', '>=SIZE' or '=ERROR' after {op!r}, "
                   f"got {rest!r}")
    return FaultRule(op, when, value, _parse_error(rule, error, op))


class FaultPlan:
    """Rules deciding which runtime calls fail, with per-operation call counters.

    ``FaultPlan.parse("register>2GiB=invalid_value")`` or
    ``FaultPlan([FaultRule("register", ">", 2 << 30, 1)])``.  Every call of
    an operation is counted by ``decide`` (failing or not); the first rule
    that matches gives the code.  Safe to share between threads.

    Args:
        rules: ``FaultRule``s, in the order they are tried; default none.

    Raises:
        TypeError: a rule that is not a FaultRule.
        ValueError: a rule of an unknown operation or selector.
    """

    def __init__(self, rules: Iterable[FaultRule] = ()):
        checked = []
        for rule in rules:
            if not isinstance(rule, FaultRule):
                raise TypeError(f"rules must be FaultRule, not {type(rule).__name__}")
            if rule.op not in OPERATIONS:
                raise ValueError(f"bad fault rule {str(rule)!r}: unknown operation {rule.op!r}")
            if rule.when not in ("", "#", ">", ">="):
                raise ValueError(f"bad fault rule: unknown selector {rule.when!r}")
            checked.append(rule)
        self._rules = tuple(checked)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OPERATIONS, 0)

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        """Parse a spec.

        Whitespace around names, selectors and ``;`` is ignored, and so are
        empty rules (``"register=1;"``); an empty spec has no rules.

        Args:
            spec: rules separated by ``;`` (``"register>2GiB=invalid_value"``).

        Returns:
            The plan.

        Raises:
            TypeError: ``spec`` is not a str.
            ValueError: a malformed rule (naming it).
        """
        if not isinstance(spec, str):
            raise TypeError(f"a fault spec must be a str, not {type(spec).__name__}")
        return cls(_parse_rule(part) for part in spec.split(";") if part.strip())

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        return self._rules

    @property
    def counts(self) -> dict:
        """How many calls of each operation ``decide`` has seen since the last reset."""
        with self._lock:
            return dict(self._counts)

    def decide(self, op: str, size: int = 0) -> int:
        """Count this call of ``op`` and return the code it fails with.

        Args:
            op: the operation called.
            size: the call's bytes, for ``>``/``>=`` rules; default 0.

        Returns:
            The code of the first rule that matches, 0 for none.

        Raises:
            ValueError: an unknown operation.
        """
        with self._lock:
            try:
                self._counts[op] += 1
            except KeyError:
                raise ValueError(f"unknown operation {op!r} (expected "
                                 + ", ".join(OPERATIONS) + ")") from None
            index = self._counts[op]
        for rule in self._rules:
            if rule.op == op and rule.matches(index, size):
                return rule.code
        return 0

    def reset(self) -> None:
        """Start counting calls from 1 again."""
        with self._lock:
            for op in self._counts:
                self._counts[op] = 0

    def __str__(self) -> str:
        return ";".join(str(rule) for rule in self._rules)

    def __repr__(self) -> str:
        return f"FaultPlan.parse({str(self)!r})"

    def __eq__(self, other):
        if not isinstance(other, FaultPlan):
            return NotImplemented
        return self._rules == other._rules

    __hash__ = None  # mutable counters: equal plans are not interchangeable keys


def as_plan(plan_or_spec):
    """The one way to turn what a caller passes into a plan.

    Args:
        plan_or_spec: a spec string (parsed) or a FaultPlan (returned as it
            is).

    Returns:
        The FaultPlan.

    Raises:
        TypeError: anything else.
        ValueError: a malformed spec (naming the bad rule).
    """
    if isinstance(plan_or_spec, str):
        return FaultPlan.parse(plan_or_spec)
    if isinstance(plan_or_spec, FaultPlan):
        return plan_or_spec
    raise TypeError("faults must be a spec str or a FaultPlan, "
                    f"not {type(plan_or_spec).__name__}")
