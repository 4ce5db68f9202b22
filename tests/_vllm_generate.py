"""Greedy tokens of vLLM's LLM for one model directory, once per load format.

    python tests/_vllm_generate.py MODEL_DIR

Prints one JSON line {"safetensors": [...], "instant_staging": [...]} (8
tokens each, from the same prompt ids).  Run by tests/test_vllm.py in a
process of its own: vLLM starts its engine in child processes (spawn)."""

import gc
import json
import sys

PROMPT = [1, 5, 7, 9, 11]
FORMATS = ("safetensors", "instant_staging")


def generate(model_dir, load_format):
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True, dtype="float32",
              max_model_len=64, max_num_seqs=2, enforce_eager=True, gpu_memory_utilization=0.05)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0))
        return list(out[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main():
    tokens = {f: generate(sys.argv[1], f) for f in FORMATS}
    print(json.dumps(tokens))


if __name__ == "__main__":
    main()
