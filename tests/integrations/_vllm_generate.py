"""Greedy tokens of vLLM's LLM for one model directory, once per load format.

    python tests/integrations/_vllm_generate.py MODEL_DIR TP

Prints one JSON line {"safetensors": ..., "instant_staging": ...} (with
TP > 1 also "instant_staging shared_read": the load format with
{"shared_read": true}), each {"tokens": 8 token ids, "logprobs": the top-5
log-probabilities of each step}, from the same prompt ids.  Run by
tests/integrations/test_vllm.py in a process of its own: vLLM starts its engine in
child processes (spawn)."""

import gc
import json
import sys

PROMPT = [1, 5, 7, 9, 11]


def generate(model_dir, load_format, tp, extra):
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True, dtype="float32",
              max_model_len=64, max_num_seqs=2, enforce_eager=True, gpu_memory_utilization=0.05,
              tensor_parallel_size=tp, model_loader_extra_config=extra)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0].outputs[0]
        return {"tokens": list(out.token_ids),
                "logprobs": [sorted((int(k), v.logprob) for k, v in step.items()) for step in out.logprobs]}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main():
    model_dir, tp = sys.argv[1], int(sys.argv[2])
    runs = {"safetensors": ("safetensors", {}), "instant_staging": ("instant_staging", {})}
    if tp > 1:
        runs["instant_staging shared_read"] = ("instant_staging", {"shared_read": True})
    print(json.dumps({name: generate(model_dir, fmt, tp, extra) for name, (fmt, extra) in runs.items()}))


if __name__ == "__main__":
    main()
