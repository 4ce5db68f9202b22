"""The command line: ``python -m instant_staging {probe,doctor,load}``.

Only parsing and printing live here; the work is in ``probe.py``,
``doctor.py`` and ``load.py``, which return dicts.  ``--json`` prints
that dict as one JSON object on stdout.  Exit codes: 0 success, 1 the
staging buffer, the copy check or the load failed (or ``--require-gpu``
without a GPU, or ``doctor`` found a problem, or stdout did not take the
report), 2 bad arguments.
"""

import argparse
import json
import logging
import os
import sys

from .. import defaults
from .._types import StagingError, format_size, parse_size
from ..loader import (
    DTYPE_ALIASES,
    ENV_CHUNK_SIZE,
    ENV_IO_DEPTH,
    ENV_THREADS,
    LoadOptions,
    SafetensorsError,
    default_device,
    resolve_progress,
    schemes_text,
)
from .report import OutputError, attempt_dict, describe_attempt, emit, error_result, write_out

# What --dtype accepts (the loader converts floating tensors only).
FLOAT_NAMES = frozenset(DTYPE_ALIASES.values())


# -- argument types: a bad value is an argparse error (exit code 2) --------------

def size_arg(text):
    """'2GiB', '256MiB', '4096' -> bytes > 0."""
    try:
        value = parse_size(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes: {text!r}")
    return value


def count_arg(text):
    """An int >= 0."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def positive_arg(text):
    value = count_arg(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def dtype_arg(text):
    """A floating dtype's name, checked without importing torch."""
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in FLOAT_NAMES:
        raise argparse.ArgumentTypeError(f"not a floating dtype: {text!r} (one of "
                                         f"{', '.join(sorted(FLOAT_NAMES))})")
    return name


def faults_arg(text):
    """A fault spec (docs/design.md, "Faults"), parsed now so a bad rule is a usage error."""
    from ..faults import FaultPlan
    try:
        return FaultPlan.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def version_line():
    """'instant-staging 0.1.0 (cuda: CUDA 12.9 (PyPI wheels))'."""
    from .._version import __version__
    try:
        from .. import _build_config as config
        build = f"{config.BACKEND}: {config.TOOLCHAIN}"
    except (ImportError, AttributeError):
        build = "not built"
    return f"instant-staging {__version__} ({build})"


# -- verbosity: the package's log lines (logger "instant_staging") on stderr --------

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level_arg(text):
    """A level's name, any case: 'info' -> logging.INFO."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"not a log level: {text!r} (one of {', '.join(LOG_LEVELS)})")
    return getattr(logging, text.upper())


def verbosity_parser(suppress):
    """-v, -q, --log-level: on the command line before the subcommand and
    after it (``suppress``: the subcommand's copy leaves what the main
    parser read, where it is not given again)."""
    unset = argparse.SUPPRESS if suppress else None
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("output")
    g.add_argument("-v", "--verbose", action="count", default=unset if suppress else 0,
                   help="more log lines: -v the package's INFO (where a load goes, the "
                   "defaults it chose), -vv DEBUG")
    g.add_argument("-q", "--quiet", action="store_true", default=unset if suppress else False,
                   help="errors only: no warnings, no progress")
    g.add_argument("--log-level", type=log_level_arg, default=unset, metavar="LEVEL",
                   help=f"the package's log level ({', '.join(LOG_LEVELS)}; default warning)")
    return p


def log_level(args):
    """The level the flags ask for (default WARNING); a usage error (str)
    where they disagree."""
    given = [flag for flag, on in (("-v", args.verbose), ("-q", args.quiet),
                                   ("--log-level", args.log_level is not None)) if on]
    if len(given) > 1:
        return f"{' and '.join(given)} ask for different log levels: give one"
    if args.log_level is not None:
        return args.log_level
    if args.quiet:
        return logging.ERROR
    return {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)


_handler = None     # the handler main() installed (one, however often main() runs)


def configure_logging(level):
    """The ``instant_staging`` logger at ``level``, to stderr; other
    libraries' lines from WARNING up (ERROR up under -q), as before."""
    global _handler
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("instant_staging: %(levelname)s: %(message)s"))
    root.addHandler(_handler)
    root.setLevel(max(level, logging.WARNING))
    logging.getLogger("instant_staging").setLevel(level)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), not the usage
    block followed by the error: ``--help`` shows the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser():
    parser = _Parser(
        prog="instant-staging", parents=[verbosity_parser(suppress=False)],
        description="Pinned host staging buffers: see which path works on this host, and why.")
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    verbosity = [verbosity_parser(suppress=True)]

    p = commands.add_parser("probe", parents=verbosity, help="run the allocation state machine once and "
                            "copy the buffer to the GPU and back")
    p.add_argument("--size", type=size_arg, default=defaults.STAGING_SIZE,
                   help=f"buffer size (default {format_size(defaults.STAGING_SIZE)})")
    p.add_argument("--segment-size", type=size_arg, default=defaults.SEGMENT_SIZE,
                   help="segment size for the segmented retry "
                   f"(default {format_size(defaults.SEGMENT_SIZE)})")
    p.add_argument("--copy-unit", type=size_arg, default=None,
                   help="round the segment size down to a multiple of this")
    p.add_argument("--chunk-size", type=size_arg, default=defaults.CHUNK_SIZE,
                   help=f"bytes per copy in the copy check (default {format_size(defaults.CHUNK_SIZE)})")
    p.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=None,
                   help="MADV_HUGEPAGE before prefaulting, or not (default: "
                   "$INSTANT_STAGING_HUGEPAGES, else where THP allows them and their "
                   "2 MiB blocks are free; `doctor` says what that is here)")
    p.add_argument("--prefault-threads", type=count_arg, default=None, metavar="N",
                   help="threads touching the pages (default: automatic; 0: none)")
    p.add_argument("--allow-pageable", action="store_true",
                   help="accept unpinned memory when nothing can be pinned")
    p.add_argument("--faults", type=faults_arg, default=None, metavar="SPEC",
                   help="make runtime calls fail, e.g. 'register=invalid_value' "
                   "(default: $INSTANT_STAGING_FAULTS)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--simulate", action="store_true",
                       help="use the SimulatedRuntime even when a GPU is present")
    which.add_argument("--require-gpu", action="store_true",
                       help="exit 1 instead of simulating when there is no usable GPU")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    d = commands.add_parser("doctor", parents=verbosity,
                            help="what on this host decides whether pinning works")
    d.add_argument("--json", action="store_true", help="print one JSON object")

    ld = commands.add_parser(
        "load", parents=verbosity, help="load safetensors checkpoints through a staging buffer",
        description="Load safetensors checkpoints through a staging buffer.  Where "
        "--chunk-size, --io-depth, --threads and their variables are all unset, a checkpoint "
        "the page cache lacks gets the cold defaults (larger reads by fewer threads).")
    ld.add_argument("sources", nargs="+", metavar="SOURCE",
                    help="a .safetensors file (or several), a checkpoint directory, "
                    "a model.safetensors.index.json, the same as URLs ("
                    f"{schemes_text()}: the remote extra; hf:// huggingface_hub), or a Hugging Face "
                    "hub id (org/name: the weights from_pretrained reads, from huggingface_hub's "
                    "cache, fetched unless HF_HUB_OFFLINE=1)")
    ld.add_argument("--revision", default=None,
                    help="the revision (branch, tag or commit) of a hub id or hf:// SOURCE "
                    "(default: main)")
    ld.add_argument("--device", default=None,
                    help="where the tensors go: cuda:N or cpu (default: the current CUDA device "
                         "where torch sees one, else cpu)")
    ld.add_argument("--dtype", type=dtype_arg, default=None,
                    help="convert floating tensors to this dtype on the device "
                    "(bfloat16, float16, float32, float64; bf16, fp16, ...)")
    # The defaults this host will use, computed as the loader computes them
    # (the help said 32 slots where a 2-CPU host runs 2 threads of 2 slots).
    cold = "for a checkpoint the page cache lacks"
    ld.add_argument("--chunk-size", type=size_arg, default=None,
                    help=f"bytes per read and copy (default ${ENV_CHUNK_SIZE}, else "
                    f"{format_size(defaults.CHUNK_SIZE)}; "
                    f"{format_size(defaults.COLD_CHUNK_SIZE)} {cold})")
    ld.add_argument("--io-depth", type=positive_arg, default=None,
                    help=f"chunks in flight (default ${ENV_IO_DEPTH}, else "
                    f"{defaults.SLOTS_PER_THREAD} per reader thread: "
                    f"{defaults.io_depth_for(None, None)} on this host; "
                    f"{defaults.io_depth_for(None, defaults.COLD_THREADS)} {cold})")
    ld.add_argument("--threads", type=positive_arg, default=None,
                    help=f"reader threads (default ${ENV_THREADS}, else one per usable CPU, "
                    f"at most {defaults.MAX_THREADS}: {defaults.reader_threads()} on this host; "
                    f"{defaults.COLD_THREADS} {cold})")
    ld.add_argument("--staging-size", type=size_arg, default=None,
                    help="pinned staging buffer of a GPU load (default: io-depth x chunk-size, "
                    "no more than the files hold)")
    ld.add_argument("--allow-pageable", action="store_true",
                    help="accept unpinned staging memory when nothing can be pinned")
    ld.add_argument("--verify", action="store_true", help="check every tensor after loading")
    ld.add_argument("--cache-dir", default=None, metavar="DIR",
                    help="a URL source: a local cache of its objects, filled as they load and "
                    "read by later loads (default $INSTANT_STAGING_CACHE_DIR, else none)")
    ld.add_argument("--max-bytes-per-second", type=size_arg, default=None, metavar="SIZE",
                    help="a URL source: fetch at most this many bytes per second "
                    "(default $INSTANT_STAGING_MAX_BYTES_PER_SECOND, else no cap)")
    ld.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


# -- the commands ---------------------------------------------------------------

def run_probe(args, parser):
    from . import probe
    try:
        result = probe.probe(
            args.size, segment_size=args.segment_size, copy_unit=args.copy_unit,
            hugepages=args.hugepages, prefault_threads=args.prefault_threads,
            allow_pageable=args.allow_pageable, faults=args.faults, simulate=args.simulate,
            require_gpu=args.require_gpu, chunk_size=args.chunk_size)
    except probe.UsageError as e:
        parser.error(str(e))
    emit(args.json, result, probe.format_text(result))
    return probe.exit_code(result)


def run_doctor(args, parser):
    from . import doctor
    report = doctor.diagnose()
    emit(args.json, report, doctor.format_text(report))
    return doctor.exit_code(report)


def run_load(args, parser):
    from . import load as load_cmd
    from . import probe
    failed = None
    try:
        try:
            source = load_cmd.sources(args.sources, args.revision)
        except SafetensorsError as e:
            # a malformed index is a bad file, not a usage error: the load
            # reports it (exit 1)
            source, failed = None, e
        # the flags, else the variables, else the defaults: checked as the loader checks them
        options = LoadOptions.build(chunk_size=args.chunk_size, io_depth=args.io_depth,
                                    threads=args.threads,
                                    max_bytes_per_second=args.max_bytes_per_second)
        probe.env_plan()                # a bad INSTANT_STAGING_FAULTS: as probe, a usage error
    except (OSError, ValueError, TypeError) as e:
        # a missing file or directory, a FIFO, a file named twice, a bad
        # INSTANT_STAGING_* value
        parser.error(str(e))
    if args.staging_size is not None and args.staging_size < options.chunk_size:
        parser.error("--staging-size must hold at least one chunk of --chunk-size")
    try:
        if args.device is None:     # the loader's rule: the current CUDA device, else the CPU
            args.device = default_device()
        bad_device = load_cmd.device_error(args.device)
    except ImportError:         # no torch: the load says so (exit 1)
        bad_device = None
    if bad_device:
        parser.error(bad_device)
    if args.staging_size is not None and load_cmd._is_cpu(args.device):
        # (it would be reported as used: a CPU load stages through ordinary
        # memory of its own, io-depth x chunk-size)
        parser.error("--staging-size sizes the pinned buffer of a GPU load; a load to the "
                     "CPU stages through memory of its own (size it with --io-depth and "
                     "--chunk-size)")
    if failed is None:
        # Opened once: the shards resolved, every header parsed; the load,
        # its knobs and its report all come from this one.
        try:
            checkpoint = load_cmd.open_checkpoint(source, cache_dir=args.cache_dir)
        except load_cmd.UsageError as e:    # a missing file, shard or object; no client for a URL
            parser.error(str(e))
        except (OSError, ValueError, RuntimeError) as e:
            failed = e                      # a bad file (SafetensorsError), a failed read
    if failed is not None:
        return _load_failed(args, failed)
    with checkpoint:
        # As load_file: where every knob is unset, the checkpoint's own
        # (a checkpoint read from disk gets the cold defaults).
        chunk_size, io_depth, threads = load_cmd.knobs(checkpoint, options)
        if args.staging_size is not None and args.staging_size < chunk_size:
            parser.error("--staging-size must hold at least one chunk of --chunk-size "
                         f"({format_size(chunk_size)} for this checkpoint)")
        # The API's progress=True: a bar on a terminal (tqdm's where it is
        # installed), else a line per tenth; none under -q, nor beside --json
        # where stderr is no terminal.
        quiet = args.quiet or (args.json and not sys.stderr.isatty())
        progress = resolve_progress(not quiet)
        try:
            result = load_cmd.load(checkpoint, device=args.device, dtype=args.dtype,
                                   chunk_size=chunk_size, io_depth=io_depth, threads=threads,
                                   verify=args.verify, staging_bytes=args.staging_size,
                                   allow_pageable=args.allow_pageable, progress=progress,
                                   max_bytes_per_second=options.max_bytes_per_second)
        except (ImportError, StagingError, OSError, ValueError, RuntimeError) as e:
            # ImportError: no torch; ValueError: a bad file (SafetensorsError);
            # RuntimeError: a failed read or copy (LoadError), or torch's own
            # (no CUDA device, out of memory).
            _close(progress)
            return _load_failed(args, e)
    _close(progress)
    if not result["ok"]:
        if args.json:
            write_out(json.dumps(result, indent=2))
        else:
            print("\n".join(load_cmd.format_text(result)), file=sys.stderr)
        return 1
    emit(args.json, result, load_cmd.format_text(result))
    return 0


def _close(progress):
    if progress is not None:
        progress.close()


def _load_failed(args, e):
    """A load that failed before its report: one line (and the staging
    attempts), or the JSON of the failure; exit 1."""
    lines = [f"load failed: {type(e).__name__}: {e}"]
    if isinstance(e, StagingError):
        lines += ["  " + describe_attempt(attempt_dict(a)) for a in e.attempts]
    if args.json:
        write_out(json.dumps(error_result("load", e), indent=2))
    else:
        print("\n".join(lines), file=sys.stderr)
    return 1


COMMANDS = {"probe": run_probe, "doctor": run_doctor, "load": run_load}


def main(argv=None):
    """Entry point of ``instant-staging`` and ``python -m instant_staging``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = log_level(args)
    if isinstance(level, str):
        parser.error(level)
    # The state machine logs each fallback once (WARNING), the loader its
    # choices (INFO: -v): on stderr.
    configure_logging(level)
    try:
        try:
            return COMMANDS[args.command](args, parser)
        except KeyboardInterrupt:
            print(f"instant-staging {args.command}: interrupted", file=sys.stderr)
            return 130
        except OutputError:
            raise
        except Exception as e:       # never a traceback: one line, or the JSON report
            if getattr(args, "json", False):
                write_out(json.dumps(error_result(args.command, e), indent=2))
            else:
                print(f"instant-staging {args.command} failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
            return 1
    except OutputError as e:
        # Not delivered, so not a success, and never written again to the
        # stdout that failed: one line on stderr (none for a reader that
        # closed early, | head), exit 1.  What is left in stdout's buffer
        # goes to /dev/null, so the flush at exit cannot fail again.
        if sys.stdout is not None:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(e.__cause__, BrokenPipeError):
            print(f"instant-staging {args.command}: the report could not be written to stdout: {e}",
                  file=sys.stderr)
        return 1

