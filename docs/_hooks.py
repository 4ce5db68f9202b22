"""mkdocs hooks (mkdocs.yml): pages that are written from the sources at
build time, so that they cannot drift from them.

``<!-- envs-table -->`` in a page becomes the table of every
INSTANT_STAGING_* variable, ``instant_staging/envs.py``'s
``markdown_table()``: the one table of them.  envs.py is read from this
tree, not from an installed package, and without running the package's
``__init__`` (which needs the compiled modules): only envs.py and the two
plain modules it imports are loaded, so the site builds from a bare
checkout.

The site's header names the repository and the version (``on_config``):
the repository is pyproject.toml's ``Homepage`` URL and the version
``instant_staging/_version.py``'s, both read from this tree, so that the
site says which release it documents and cannot name another.
"""

import importlib.util
import os
import re
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


def version():
    """instant_staging/_version.py's ``__version__``, read as text."""
    with open(os.path.join(ROOT, "instant_staging", "_version.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def homepage():
    """pyproject.toml's ``[project.urls]`` Homepage."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        return re.search(r'^Homepage = "([^"]+)"', f.read(), re.M).group(1)


def on_config(config, **kwargs):
    config["repo_url"] = homepage()
    config["repo_name"] = f"instant_staging {version()}"
    config["edit_uri"] = ""          # no "edit this page" links
    return config
