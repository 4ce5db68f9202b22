"""``python -m instant_staging load SOURCE...``: files, a directory, an
index.json, ``--dtype``, environment knobs; user errors are one line and
exit 2, a bad file exit 1, never a traceback."""

import json
import os
import subprocess
import sys

import pytest

import support.cli

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")



def cli(*args, env=None):
    """``python -m instant_staging load ARGS`` against the package under test."""
    return support.cli.cli("load", *args, env=env)


def cli_json(*args, env=None, code=0):
    proc = cli(*args, "--json", env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def ckpt(tmp_path):
    """Three shards and their index; returns (dir, tensors, shard paths)."""
    g = torch.Generator().manual_seed(1)
    weight_map, everything, paths = {}, {}, []
    for k in range(3):
        part = {f"l{k}.w": torch.randn(64, 100 + k, generator=g),
                f"l{k}.ids": torch.arange(50 + k, dtype=torch.int32)}
        name = f"model-{k + 1:05d}-of-00003.safetensors"
        st.save_file(part, tmp_path / name)
        paths.append(str(tmp_path / name))
        everything.update(part)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, everything, paths


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("form", ["directory", "index", "files"])
def test_every_source_form(ckpt, form):
    path, tensors, shards = ckpt
    args = {"directory": [str(path)], "index": [str(path / "model.safetensors.index.json")],
            "files": shards}[form]
    r = cli_json(*args, "--device", "cpu")
    assert r["ok"] is True and r["files"] == shards
    assert r["tensors"] == len(tensors) and r["bytes"] == nbytes(tensors)
    assert r["gbps"] > 0 and r["dtype"] is None


def test_dtype(ckpt):
    path, tensors, _ = ckpt
    r = cli_json(str(path), "--device", "cpu", "--dtype", "bf16")
    assert r["dtype"] == "bfloat16" and r["bytes"] == nbytes(tensors)   # bytes read
    proc = cli(str(path), "--device", "cpu", "--dtype", "float16")
    assert proc.returncode == 0 and "as float16" in proc.stdout and "6 tensors" in proc.stdout


def test_environment_knobs(ckpt):
    path, _, _ = ckpt
    r = cli_json(str(path), "--device", "cpu", env={"INSTANT_STAGING_CHUNK_SIZE": "16KiB",
                                                      "INSTANT_STAGING_IO_DEPTH": "3",
                                                      "INSTANT_STAGING_THREADS": "2"})
    assert (r["chunk_size"], r["io_depth"], r["threads"]) == (16 << 10, 3, 2)
    r = cli_json(str(path), "--device", "cpu", "--chunk-size", "8KiB",
                 env={"INSTANT_STAGING_CHUNK_SIZE": "16KiB"})
    assert r["chunk_size"] == 8 << 10


@pytest.mark.parametrize("make_args, message", [
    (lambda p: [str(p / "absent")], "no such file"),
    (lambda p: [str(p / "empty")], "no model.safetensors.index.json and no"),
    (lambda p: [str(p), "--dtype", "int8"], "not a floating dtype"),
    (lambda p: [str(p / "model.safetensors.index.json"), str(p / "model-00001-of-00003.safetensors")],
     "given twice"),
])
def test_user_errors_exit_2(ckpt, make_args, message):
    path, _, _ = ckpt
    (path / "empty").mkdir()
    proc = cli(*make_args(path), "--device", "cpu")
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_shard_of_index_exits_2(ckpt):
    path, _, _ = ckpt
    os.remove(path / "model-00002-of-00003.safetensors")
    proc = cli(str(path), "--device", "cpu")
    assert proc.returncode == 2 and "model-00002-of-00003.safetensors" in proc.stderr


def test_bad_environment_exits_2(ckpt):
    path, _, _ = ckpt
    proc = cli(str(path), "--device", "cpu", env={"INSTANT_STAGING_IO_DEPTH": "zero"})
    assert proc.returncode == 2 and "INSTANT_STAGING_IO_DEPTH" in proc.stderr


def test_json_file_as_shard_and_bad_index_exit_1(ckpt):
    path, _, _ = ckpt
    copy = path / "copy.safetensors"
    copy.write_bytes((path / "model.safetensors.index.json").read_bytes())
    r = cli_json(str(copy), "--device", "cpu", code=1)
    assert r["ok"] is False and "JSON file" in r["error"]["message"]
    (path / "model.safetensors.index.json").write_text("{not json")
    r = cli_json(str(path), "--device", "cpu", code=1)
    assert r["error"]["type"] == "SafetensorsError" and "not valid JSON" in r["error"]["message"]


# -- URLs: passed to Checkpoint.open as they are -------------------------------------

def test_url_source(ckpt):
    pytest.importorskip("obstore")
    from support.remote_servers import RangeHTTPServer
    path, tensors, shards = ckpt
    with RangeHTTPServer(path) as server:
        index = server.url_for("model.safetensors.index.json")
        r = cli_json(index, "--device", "cpu")
        assert r["ok"] is True and r["files"] == [server.url_for(os.path.basename(s)) for s in shards]
        assert r["tensors"] == len(tensors) and r["bytes"] == nbytes(tensors)
        one = server.url_for(os.path.basename(shards[1]))
        r = cli_json(one, server.url_for(os.path.basename(shards[0])), "--device", "cpu",
                     "--chunk-size", "4KiB")
        assert r["ok"] is True and r["tensors"] == 4 and r["chunk_size"] == 4 << 10
        proc = cli(server.url_for("absent.safetensors"), "--device", "cpu")
        assert proc.returncode == 2 and "absent.safetensors" in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_url_without_the_remote_extra_is_a_usage_error(ckpt):
    from support import PACKAGE_PARENT, child_env
    code = ("import sys; sys.modules['obstore'] = None\n"      # as if the extra were not installed
            "from instant_staging.cli import main\n"
            "sys.exit(main(['load', 's3://bucket/model/', '--device', 'cpu']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE_PARENT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "instant_staging[remote]" in proc.stderr


def test_urls_and_files_together_are_a_usage_error(ckpt):
    _, _, shards = ckpt
    proc = cli(shards[0], "s3://bucket/x.safetensors", "--device", "cpu")
    assert proc.returncode == 2 and "not both" in proc.stderr and "Traceback" not in proc.stderr


# -- a Hugging Face hub id, as from_pretrained takes it --------------------------------

@pytest.fixture
def hub(tmp_path, ckpt):
    """huggingface_hub's cache holding org/tiny (the sharded checkpoint, main)
    and the tag v1 (one file), as snapshot_download leaves it; the
    environment of a run that reads only that cache."""
    pytest.importorskip("huggingface_hub")
    import shutil
    path, tensors, _ = ckpt
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    shutil.copytree(path, repo / "snapshots" / ("a" * 40), ignore=shutil.ignore_patterns("hub"))
    one = repo / "snapshots" / ("b" * 40)
    one.mkdir(parents=True)
    st.save_file({"only.w": torch.ones(8, 8)}, one / "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v1").write_text("b" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return env, tensors, repo


def test_hub_id_from_the_cache(hub):
    env, tensors, repo = hub
    r = cli_json("org/tiny", "--device", "cpu", env=env)
    assert r["ok"] is True and r["tensors"] == len(tensors) and r["bytes"] == nbytes(tensors)
    assert r["files"] == [str(repo / "snapshots" / ("a" * 40) / f"model-{k:05d}-of-00003.safetensors")
                          for k in (1, 2, 3)]
    r = cli_json("org/tiny", "--revision", "v1", "--device", "cpu", env=env)
    assert r["tensors"] == 1 and r["files"] == [str(repo / "snapshots" / ("b" * 40) / "model.safetensors")]


@pytest.mark.parametrize("args, message", [
    (["org/absent"], "org/absent"),
    (["org/tiny", "--revision", "v9"], "org/tiny"),
    (["absent-dir"], "absent-dir"),
])
def test_hub_id_not_there_is_a_usage_error(hub, args, message):
    env, _, _ = hub
    proc = cli(*args, "--device", "cpu", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert message in last and "nor a model on the hub" in last and "Traceback" not in proc.stderr


def test_revision_without_a_hub_id_is_a_usage_error(hub, ckpt):
    env, _, _ = hub
    proc = cli(str(ckpt[0]), "--revision", "v1", "--device", "cpu", env=env)
    assert proc.returncode == 2 and "--revision applies to a hub id" in proc.stderr
