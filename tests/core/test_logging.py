"""The package's logger follows the logging HOWTO's convention for
libraries: a NullHandler on ``instant_staging``, so that a program that
configures no logging gets none of its records on stderr from logging's
last-resort handler, and one that does (``logging.basicConfig``) gets them."""

import logging
import subprocess
import sys

import instant_staging

from support import PACKAGE_PARENT, child_env

WARN = ("import logging, instant_staging\n"
        "{configure}"
        "logging.getLogger('instant_staging.loader').warning('a warning of the loader')\n")


def _stderr(configure=""):
    proc = subprocess.run([sys.executable, "-c", WARN.format(configure=configure)], cwd=PACKAGE_PARENT,
                          env=child_env(), capture_output=True, text=True, timeout=120, check=True)
    return proc.stderr


def test_the_package_logger_has_a_null_handler():
    handlers = logging.getLogger(instant_staging.__name__).handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers), handlers


def test_unconfigured_program_gets_nothing_and_a_configured_one_gets_the_warning():
    assert "a warning of the loader" not in _stderr()
    assert "a warning of the loader" in _stderr("logging.basicConfig()\n")
