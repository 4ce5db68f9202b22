"""The command line of instant_staging: ``probe``, ``doctor`` and ``load``.

Siblings, not a ladder: ``main`` parses and prints; ``probe``, ``doctor``
and ``load`` do the work and return plain dicts; ``report`` holds what they
share (versions, attempts, errors).  ``python -m instant_staging`` and the
``instant-staging`` script both call ``main``.
"""

from .main import main

__all__ = ["main"]
