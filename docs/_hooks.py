"""mkdocs hooks (mkdocs.yml): pages that are written from the sources at
build time, so that they cannot drift from them.

``<!-- envs-table -->`` in a page becomes the table of every
INSTANT_STAGING_* variable, ``instant_staging/envs.py``'s
``markdown_table()``: the one table of them.  envs.py is read from this
tree, not from an installed package, and without running the package's
``__init__`` (which needs the compiled modules): only envs.py and the two
plain modules it imports are loaded, so the site builds from a bare
checkout.
"""

import importlib.util
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- envs-table -->"
# A package name of its own, so that an installed instant_staging (or one
# imported by another plugin) is neither used nor disturbed.
PACKAGE = "_instant_staging_docs"


def _envs():
    if PACKAGE + ".envs" in sys.modules:
        return sys.modules[PACKAGE + ".envs"]
    source = os.path.join(ROOT, "instant_staging")
    package = types.ModuleType(PACKAGE)
    package.__path__ = [source]          # submodules resolve in the tree; __init__ never runs
    sys.modules[PACKAGE] = package
    spec = importlib.util.spec_from_file_location(PACKAGE + ".envs", os.path.join(source, "envs.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown, page, config, files, **kwargs):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, _envs().markdown_table())
