"""A Hugging Face Hub source in every door (issue 55): ``org/name`` and
``hf://org/name[@revision][/path]``, read through huggingface_hub's cache,
against a local server that answers as the Hub does (support/hub_server.py,
``HF_ENDPOINT``): ``revision=``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``,
``HF_TOKEN``, ``HF_HUB_DISABLE_PROGRESS_BARS``; a local path wins."""

import json
import os

import pytest

import support.cli
from support.tensors import assert_same

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
hf = pytest.importorskip("huggingface_hub")

from huggingface_hub import constants

from instant_staging import _hub
from instant_staging.loader import (
    Checkpoint,
    iter_load,
    load_file,
    load_into,
    safe_open,
    schemes_text,
)

from support.hub_server import HubServer


def _tensors(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return {f"l{k}.w": torch.randn(16, 8 + k, generator=g) for k in range(n)}


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """org/tiny: main sharded (an index, two shards, a config and a large
    tokenizer.json the loader must not fetch), the tag v1 one file of other
    weights; org/private the same behind a token."""
    root = tmp_path_factory.mktemp("hub-repos")
    main, v1 = root / "main", root / "v1"
    main.mkdir()
    v1.mkdir()
    tensors = _tensors(0)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        st.save_file({k: tensors[k] for k in keys}, main / shard)
    (main / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    (main / "config.json").write_text("{}")
    (main / "tokenizer.json").write_bytes(b"x" * 100_000)
    other = _tensors(1)
    st.save_file(other, v1 / "model.safetensors")
    with HubServer() as server:
        commits = {"main": server.add("org/tiny", main, refs=("main",)),
                   "v1": server.add("org/tiny", v1, refs=("v1",))}
        server.add("org/private", v1, token="hf_secret")
        yield server, tensors, other, commits


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    """The local Hub as huggingface_hub's endpoint, an empty cache of this
    test's own (HF_HUB_CACHE), no token, online."""
    server = repos[0]
    cache = tmp_path / "hf-cache"
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    for name, value in (("ENDPOINT", server.url), ("HUGGINGFACE_CO_URL_TEMPLATE", template),
                        ("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", False),
                        ("HF_HUB_DISABLE_PROGRESS_BARS", True)):
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))     # no stored login
    server.requests.clear()
    return repos


def _offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# -- every door -------------------------------------------------------------------------

def test_every_door_reads_a_hub_id_and_an_hf_url(hub):
    _, tensors, other, commits = hub
    assert_same(load_file("org/tiny"), tensors)
    assert_same(load_file("hf://org/tiny"), tensors)
    with iter_load("hf://org/tiny/model.safetensors.index.json") as it:
        assert_same(dict(it), tensors)
    with Checkpoint.open("org/tiny", revision="v1") as ck:
        assert ck.names() == sorted(other)
        assert all(f.startswith(str(constants.HF_HUB_CACHE)) for f in ck.files)
        assert_same(ck.load("cpu"), other)
    with safe_open("hf://org/tiny/model-00002-of-00002.safetensors") as f:
        assert list(f.keys()) == ["l2.w"] and torch.equal(f.get_tensor("l2.w"), tensors["l2.w"])
    with safe_open("org/tiny", revision="v1") as f:
        assert sorted(f.keys()) == sorted(other)
    dests = {k: torch.zeros_like(t) for k, t in other.items()}
    load_into(f"hf://org/tiny@{commits['v1']}", dests)
    assert_same(dests, other)
    shards = [f"hf://org/tiny/model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    assert_same(load_file(shards), tensors)


def test_only_the_weights_are_fetched(hub):
    server = hub[0]
    load_file("org/tiny")
    # (config.json and tokenizer.json are not asked for: not even a HEAD)
    fetched = {path.rsplit("/", 1)[-1] for _, path in server.asked("/resolve/")}
    assert fetched == {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                       "model-00002-of-00002.safetensors"}


def test_a_revision_is_a_branch_tag_or_commit(hub):
    _, tensors, other, commits = hub
    assert_same(load_file("org/tiny", revision="main"), tensors)
    assert_same(load_file("org/tiny", revision=commits["v1"]), other)
    assert_same(load_file("hf://org/tiny@v1"), other)
    assert_same(load_file("hf://org/tiny@v1/model.safetensors"), other)
    assert_same(load_file("hf://org/tiny", revision="v1"), other)
    with pytest.raises(ValueError, match="names revision 'v1'"):
        load_file("hf://org/tiny@v1", revision="main")
    with pytest.raises(FileNotFoundError, match=r"org/tiny \(revision v9\).*on the Hub"):
        load_file("org/tiny", revision="v9")


def test_offline_reads_the_cache_and_asks_nothing(hub, monkeypatch):
    server, tensors, _, _ = hub
    load_file("org/tiny")
    _offline(monkeypatch)
    server.requests.clear()
    assert_same(load_file("org/tiny"), tensors)
    assert_same(load_file("hf://org/tiny/model-00001-of-00002.safetensors"),
                {k: tensors[k] for k in ("l0.w", "l1.w")})
    with pytest.raises(FileNotFoundError, match=r"org/tiny \(revision v1\).*HF_HUB_OFFLINE=1"):
        load_file("org/tiny", revision="v1")        # never fetched: not in the cache
    with pytest.raises(FileNotFoundError, match="org/absent"):
        load_file("org/absent")
    assert server.requests == []


def test_a_missing_repo_or_file_is_one_clear_error(hub):
    with pytest.raises(FileNotFoundError, match=r"org/absent .*not a local path, nor a repo") as e:
        load_file("org/absent")
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"holds no nope\.safetensors"):
        load_file("hf://org/tiny/nope.safetensors")


def test_a_token_reads_a_private_repo(hub, monkeypatch):
    _, _, other, _ = hub
    with pytest.raises(FileNotFoundError, match="HF_TOKEN"):
        load_file("org/private")
    assert_same(load_file("org/private", storage_options={"token": "hf_secret"}), other)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert_same(load_file("hf://org/private"), other)


def test_cache_dir_is_huggingface_hubs_cache(hub, tmp_path):
    mine = tmp_path / "elsewhere"
    with Checkpoint.open("org/tiny", cache_dir=mine) as ck:
        assert all(f.startswith(str(mine / "models--org--tiny" / "snapshots")) for f in ck.files)
    assert not os.path.exists(constants.HF_HUB_CACHE)


def test_a_local_path_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    server = hub[0]
    local = _tensors(7)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    st.save_file(local, tmp_path / "org" / "tiny" / "model.safetensors")
    monkeypatch.chdir(tmp_path)
    assert_same(load_file("org/tiny"), local)
    with pytest.raises(ValueError, match="revision applies to a Hub source"):
        load_file("org/tiny", revision="v1")        # a directory here: no Hub source
    assert server.requests == []


@pytest.mark.parametrize("kwargs, message", [
    ({"cache_dir": False}, "cache_dir=False does not apply"),
    ({"storage_options": {"region": "x"}}, "take token and endpoint, not region"),
    ({"revision": 1}, "revision must be a str"),
])
def test_options_that_do_not_apply_are_refused(hub, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        load_file("org/tiny", **kwargs)
    assert hub[0].requests == []


def test_revision_with_another_source_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    st.save_file(_tensors(0), path)
    with pytest.raises(ValueError, match="revision applies to a Hub source"):
        load_file(str(path), revision="main")
    with pytest.raises(ValueError, match="revision applies to a Hub source"):
        Checkpoint.open("s3://bucket/m.safetensors", revision="main")


# -- hf:// as huggingface_hub writes it ------------------------------------------------------

URLS = {
    "hf://org/name": ("org/name", None, "", "model"),
    "hf://models/org/name/a/b.safetensors": ("org/name", None, "a/b.safetensors", "model"),
    "hf://org/name@v1": ("org/name", "v1", "", "model"),
    "hf://org/name@v1/model.safetensors": ("org/name", "v1", "model.safetensors", "model"),
    "hf://org/name@refs/pr/3/model.safetensors": ("org/name", "refs/pr/3", "model.safetensors", "model"),
    "hf://org/name@feature%2Fx/sub": ("org/name", "feature/x", "sub", "model"),
    "hf://datasets/org/data@" + "a" * 40: ("org/data", "a" * 40, "", "dataset"),
    "hf://org/name/file@2.safetensors": ("org/name", None, "file@2.safetensors", "model"),
}


@pytest.mark.parametrize("url", list(URLS))
def test_hf_urls_parse_as_huggingface_hub_parses_them(url):
    assert tuple(_hub.parse_hf_url(url)) == URLS[url]
    parse = getattr(hf, "parse_hf_uri", None)      # (huggingface_hub 1.x and newer)
    if parse is not None:
        theirs = parse(url)
        assert (theirs.id, theirs.revision, theirs.path_in_repo, theirs.type) == URLS[url]


@pytest.mark.parametrize("url", ["hf://", "hf://name", "hf://org/name@", "hf://buckets/org/b/x",
                                 "hf://org/name/../x.safetensors", "hf://org//x"])
def test_a_malformed_hf_url_is_refused(url):
    with pytest.raises(ValueError, match="hf://org/name"):
        load_file(url)


def test_the_schemes_messages_name_hf():
    assert "hf://" in schemes_text()


# -- the CLI, with huggingface_hub's own environment ---------------------------------------

def test_cli_load_with_the_hubs_environment(repos, tmp_path):
    server, tensors, other, _ = repos
    env = {"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
           "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

    def load(*args, **more):
        proc = support.cli.cli("load", *args, "--device", "cpu", "--json", env={**env, **more})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout), proc.stderr
    r, err = load("org/tiny")
    assert r["tensors"] == len(tensors) and "Fetching" not in err and "%|" not in err
    r, _ = load("hf://org/tiny", "--revision", "v1")
    assert r["tensors"] == len(other)
    r, _ = load("hf://org/private", HF_TOKEN="hf_secret")
    assert r["tensors"] == len(other)
    server.requests.clear()
    r, _ = load("org/tiny", HF_HUB_OFFLINE="1")
    assert r["tensors"] == len(tensors) and server.requests == []
    proc = support.cli.cli("load", "org/tiny", "--revision", "v7", "--device", "cpu",
                           env={**env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "org/tiny" in proc.stderr and "Traceback" not in proc.stderr
