"""The package's warnings reach a program that configured no logging
(logging's last-resort handler prints them on stderr: the package adds no
handler, not even a NullHandler, which would silence them there), and one
that configured logging gets each once, through its own handler."""

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


def test_the_package_logger_has_no_handler_of_its_own():
    assert logging.getLogger(instant_staging.__name__).handlers == []


def test_an_unconfigured_program_and_a_configured_one_each_get_the_warning_once():
    assert _stderr().count("a warning of the loader") == 1
    assert _stderr("logging.basicConfig()\n").count("a warning of the loader") == 1
