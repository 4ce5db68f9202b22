"""Reload in place with vLLM: one engine whose weights are replaced by
other checkpoints' through ``reload_weights``.

    python tests/integrations/_vllm_reload.py OLD_DIR NEW_DIR TP FORMAT...
        [--extra JSON] [--reloads PATH,PATH...]

OLD_DIR and NEW_DIR hold one architecture with different weights.  Prints
one JSON line of greedy results ({"tokens", "logprobs"}, as
_vllm_generate.py's), each from the same prompt ids:

- "fresh old", "fresh new": a fresh engine of load format safetensors on
  each checkpoint (the reference);
- for each load format FORMAT (instant_staging, and safetensors for what
  vLLM's own loader does on the same path), "FORMAT before": an engine of
  it on OLD_DIR (with ``--extra`` as its model_loader_extra_config), as
  started;
- "FORMAT discarded": the same engine after ``sleep(level=2)`` and
  ``wake_up()``, with every parameter zeroed where the platform's sleep
  mode does not discard them (vLLM's CPU worker ignores sleep with a
  warning), as a level-2 wake leaves them: garbage until the weights are
  reloaded;
- "FORMAT reload K" (K = 1, 2, ...): after ``collective_rpc("reload_weights",
  kwargs={"weights_path": PATH})`` with the K-th path of ``--reloads``
  (default NEW_DIR,OLD_DIR: a new checkpoint through the disk, the way RL
  trainers hand one over, and back; a path may be a URL).

Run by tests/integrations/test_vllm.py in a process of its own (vLLM
starts its engine in child processes); zeroing the parameters through
``collective_rpc`` with a function needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
in the environment."""

import argparse
import gc
import json

PROMPT = [1, 5, 7, 9, 11]


def engine(model_dir, load_format, tp, extra=None):
    import torch
    from vllm import LLM
    # sleep mode where the platform has it (CUDA); vLLM refuses it elsewhere
    return LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True, dtype="float32",
               max_model_len=64, max_num_seqs=2, enforce_eager=True, gpu_memory_utilization=0.05,
               tensor_parallel_size=tp, enable_sleep_mode=torch.cuda.is_available(),
               model_loader_extra_config=extra or {})


def generate(llm):
    from vllm import SamplingParams
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0].outputs[0]
    return {"tokens": list(out.token_ids),
            "logprobs": [sorted((int(k), v.logprob) for k, v in step.items()) for step in out.logprobs]}


def close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def zero_parameters(worker):
    """Every parameter of a worker's model zeroed (a level-2 sleep's
    discarded weights, where the platform keeps them)."""
    import torch
    with torch.no_grad():
        for p in worker.model_runner.get_model().parameters():
            p.zero_()
    return True


def fresh(model_dir, tp):
    llm = engine(model_dir, "safetensors", tp)
    try:
        return generate(llm)
    finally:
        close(llm)


def reloaded(old, tp, load_format, extra, paths):
    """The results of one engine of ``load_format`` through the sequence."""
    import torch
    results = {}
    llm = engine(old, load_format, tp, extra)
    try:
        results["before"] = generate(llm)
        llm.sleep(level=2)
        llm.wake_up()
        if not torch.cuda.is_available():
            llm.collective_rpc(zero_parameters)
        results["discarded"] = generate(llm)
        for k, path in enumerate(paths, 1):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            results[f"reload {k}"] = generate(llm)
    finally:
        close(llm)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("tp", type=int)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--extra", type=json.loads, default=None)
    ap.add_argument("--reloads", default=None)
    args = ap.parse_args()
    paths = args.reloads.split(",") if args.reloads else [args.new, args.old]
    results = {}
    for load_format in args.formats:
        extra = args.extra if load_format == "instant_staging" else None
        results.update({f"{load_format} {k}": v
                        for k, v in reloaded(args.old, args.tp, load_format, extra, paths).items()})
    results["fresh old"] = fresh(args.old, args.tp)
    results["fresh new"] = fresh(args.new, args.tp)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
