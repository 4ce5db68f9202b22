"""RL updates through the weight-transfer engine ``instant_staging`` in a
vLLM that generates (vLLM's CPU build): one engine updated again and
again, then a fresh engine of each version.

    python tests/integrations/_vllm_transfer.py STEPS.json TP

STEPS.json: ``{"start": MODEL_DIR, "versions": {version: MODEL_DIR},
"updates": [[source, version, refused], ...]}``.  The engine starts on ``start``
(load format safetensors, weight_transfer_config backend instant_staging,
``init_info`` its version "step-0"); each update is one session through
the worker methods vLLM's ``LLM`` reaches by ``collective_rpc``
(``start_weight_update``, ``update_weights``, ``finish_weight_update``:
vLLM 0.32's ``LLM`` has no methods of its own for them, its ``AsyncLLM``
calls the same).  An update expected to be refused is sent through
``collective_rpc`` with a function that calls the worker's own
``update_weights`` and returns what it raised, per worker: vLLM 0.32's
multiprocess executor (tensor-parallel > 1) raises at the first worker's
failure and leaves the other workers' replies queued, so every later
``collective_rpc`` would read the reply of the call before it.
Prints one JSON line:

- "updated": one entry per stage (the start, then each update), each
  ``{"version": the update's, "error": None, or each worker's refusal
  ("Type: message"),
  "held": str(engine.state) of every worker, "out": {"tokens",
  "logprobs"}}`` (``_vllm_generate.py``'s greedy results);
- "fresh": ``{version: out}``, a fresh engine of load format safetensors
  on each version's directory.

Reading the engines' state through ``collective_rpc`` with a function
needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment."""

import json
import sys

# (the same prompt, generation and shutdown as the reload test's child:
# this directory is on sys.path, the script's own)
from _vllm_reload import close, generate


def engine(model_dir, tp, **kw):
    from vllm import LLM
    return LLM(model=model_dir, load_format="safetensors", skip_tokenizer_init=True, dtype="float32",
               max_model_len=64, max_num_seqs=2, enforce_eager=True, gpu_memory_utilization=0.05,
               tensor_parallel_size=tp, **kw)


def held(worker):
    return str(worker.weight_transfer_engine.state)


def try_update(worker, update_info):
    try:
        worker.update_weights(update_info)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def updated(steps, tp):
    llm = engine(steps["start"], tp, weight_transfer_config={"backend": "instant_staging"})
    try:
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"version": "step-0"}})
        stages = [{"version": "step-0", "error": None, "held": llm.collective_rpc(held),
                   "out": generate(llm)}]
        for source, version, refused in steps["updates"]:
            error = None
            info = {"source": source, "version": version}
            llm.collective_rpc("start_weight_update")
            if refused:             # (the worker ends the session itself)
                error = llm.collective_rpc(try_update, args=(info,))
            else:
                llm.collective_rpc("update_weights", kwargs={"update_info": info})
                llm.collective_rpc("finish_weight_update")
                llm.llm_engine.set_weight_version(version)
            stages.append({"version": version, "error": error, "held": llm.collective_rpc(held),
                           "out": generate(llm)})
        return stages
    finally:
        close(llm)


def fresh(model_dir, tp):
    llm = engine(model_dir, tp)
    try:
        return generate(llm)
    finally:
        close(llm)


def main():
    with open(sys.argv[1]) as f:
        steps = json.load(f)
    tp = int(sys.argv[2])
    results = {"updated": updated(steps, tp),
               "fresh": {v: fresh(d, tp) for v, d in steps["versions"].items()}}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
