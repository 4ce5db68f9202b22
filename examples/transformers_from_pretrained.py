"""from_pretrained: a transformers model whose weights the loader reads,
equal to transformers' own from_pretrained.

    python examples/transformers_from_pretrained.py [MODEL_DIR] [--device cuda:0]

Without MODEL_DIR it saves a tiny random Llama first (no download).  Needs
transformers (pip install transformers); runs on the CPU.
"""

import argparse
import tempfile

import torch
import transformers

from instant_staging.integrations.transformers import from_pretrained


def tiny_llama(folder):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or tiny_llama(scratch)

        model = from_pretrained(model_dir, device=args.device, dtype=torch.float32)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        same = all(torch.equal(p.cpu(), q) for p, q in zip(model.state_dict().values(),
                                                           theirs.state_dict().values()))
        print(type(model).__name__, "on", model.device, "equal to transformers' own:", same)

        prompt = torch.tensor([[1, 5, 7, 9]], device=model.device)
        print("greedy tokens:", model.generate(prompt, max_new_tokens=5, do_sample=False)[0].tolist())


if __name__ == "__main__":
    main()
