"""Every ```python block of README.md and docs/ (the home page and the
guides) runs, as written, against files of the names it uses, so that no
example a user copies fails (issue 55: the reload guide's first one raised
MissingNameError).

A block runs unless the line before it is a marker saying why not::

    <!-- example: skip (needs a bucket) -->

for what this machine cannot give it (object storage, vLLM, torchrun over
GPUs).  A block of an ``--8<--`` include is one of examples/, which
tests/examples/test_examples.py runs.  Without a GPU a block's "cuda:N"
runs as "cpu" (the one change made to a block): the same call, on the
device this host has.

The files it names (``Llama-3-8B/``, ``step-1000/``, ``model.safetensors``,
...) are tiny ones of those names, made once: a two-layer Llama saved by
transformers, its tensors in the shard files the blocks name, and a
huggingface_hub cache holding it under the Hub ids, revisions and file
names the blocks use (offline: nothing is fetched).  All the blocks run in one child process, one after
the other (torch and transformers imported once: seconds, not a process
per block), each in fresh globals; each test reports its own block.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from support import ROOT, child_env

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the files the blocks name are a transformers model")
safetensors_torch = pytest.importorskip("safetensors.torch")

PAGES = ["README.md", "docs/index.md", *sorted(os.path.relpath(p, ROOT) for p in
                                                glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- example: skip \(([^)]+)\) -->\s*$")
HUB_ID = "meta-llama/Meta-Llama-3-8B"      # the Hub id the transformers guide names
# the Hub ids, revisions and files the hub guide names: {id: (files, refs)}
HUB_REPOS = {HUB_ID: (("model.safetensors", "model-00001-of-00004.safetensors"), ("main",)),
             "Qwen/Qwen2.5-0.5B": (("model.safetensors",), ("main", "v1.0"))}


def blocks():
    """[(id, code, skip reason or None)] of every python block of PAGES."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for m in BLOCK.finditer(text):
            code = m.group(1)
            if code.lstrip().startswith("--8<--"):
                continue                                  # an examples/ file: test_examples.py
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            found.append((f"{page}:{line}", code, skip.group(1) if skip else None))
    return found


BLOCKS = blocks()


def on_this_host(code):
    """The block with each "cuda:N" this host lacks made "cpu"."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return re.sub(r'"cuda:(\d+)"', lambda m: m.group(0) if int(m.group(1)) < gpus else '"cpu"', code)


def _files(root):
    """The files the blocks name, under ``root``; returns the hub cache."""
    from support.models import save
    llama, _ = save(root, "llama", sharded=False, name="Llama-3-8B")
    for name, seed in (("step-1000", 0), ("step-1200", 1), ("model_dir", 0)):
        save(root, "llama", sharded=False, seed=seed, name=name)
    weights = llama / "model.safetensors"
    for name in ("model.safetensors", "model-00001-of-00004.safetensors"):
        shutil.copy(weights, root / name)
    tensors = safetensors_torch.load_file(str(weights))
    names = sorted(tensors)
    for k, part in enumerate((names[::2], names[1::2]), 1):
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(root / f"model-{k}.safetensors"))
    for k, (hub_id, (files, refs)) in enumerate(HUB_REPOS.items()):
        repo = root / "hub" / ("models--" + hub_id.replace("/", "--"))
        commit = "c" * 39 + str(k)
        shutil.copytree(llama, repo / "snapshots" / commit)
        for name in files:
            shutil.copy(weights, repo / "snapshots" / commit / name)
        (repo / "refs").mkdir()
        for ref in refs:
            (repo / "refs" / ref).write_text(commit)
    return root / "hub"


CHILD = r"""
import json, sys, traceback
blocks, out = json.load(open(sys.argv[1])), {}
for name, code in blocks:
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        out[name] = None
    except BaseException:
        out[name] = traceback.format_exc()
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs-examples")
    hub = _files(root)
    runnable = [(name, on_this_host(code)) for name, code, skip in BLOCKS if skip is None]
    (root / "blocks.json").write_text(json.dumps(runnable))
    env = child_env({"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root / "blocks.json"), str(root / "out.json")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((root / "out.json").read_text())


@pytest.mark.parametrize("name, code, skip", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_the_block_runs(results, name, code, skip):
    if skip is not None:
        pytest.skip(skip)
    assert results[name] is None, f"{name}:\n{code}\n{results[name]}"


def test_the_blocks_are_found():
    # the pages the blocks come from, and a marker's reason read: a test
    # that found no block (or skipped every one) would prove nothing
    assert len(BLOCKS) >= 15, [b[0] for b in BLOCKS]
    ran = [b for b in BLOCKS if b[2] is None]
    assert len(ran) >= 10 and {b[0].split(":")[0] for b in ran} >= {"README.md", "docs/guides/reload.md"}
    assert SKIP.search("<!-- example: skip (needs a bucket) -->").group(1) == "needs a bucket"
    assert on_this_host('load_file(p, "cuda:7")') == 'load_file(p, "cpu")'


def test_a_failing_block_is_reported(tmp_path):
    # the child's report of a block that raises: the runner cannot pass by
    # running nothing
    (tmp_path / "blocks.json").write_text(json.dumps([["ok", "x = 1"], ["bad", "raise KeyError('gone')"]]))
    subprocess.run([sys.executable, "-c", CHILD, "blocks.json", "out.json"], cwd=tmp_path, check=True,
                   env=child_env(), timeout=60)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["ok"] is None and "KeyError: 'gone'" in out["bad"]
