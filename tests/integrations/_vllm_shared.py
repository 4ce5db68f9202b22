"""One rank of test_vllm.py's shared read: iter_weights over a gloo group.

    python _vllm_shared.py PORT RANK WORLD OUT.json FILE...

Rank r keeps the tensors whose names do not contain ".layers.{r}." (so the
ranks keep different tensors of the same batches); writes whether its pairs
equal safetensors' own load of what it keeps, bit for bit, and the stats.
A file list that differs on one rank (argument "--drop-last" on rank 1)
must be a ValueError on every rank, not a hang."""

import datetime
import json
import sys


def main():
    port, rank, world, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    files = sys.argv[5:]
    drop = "--drop-last" in files
    files = [f for f in files if f != "--drop-last"]
    if drop and rank == 1:
        files = files[:-1]
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from instant_staging.integrations.vllm._options import Options
    from instant_staging.integrations.vllm._weights import Stats, iter_weights
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))

    def keep(name):
        return f".layers.{rank}." not in name
    result = {}
    try:
        stats = Stats()
        pairs = list(iter_weights(files, "cpu", Options(batch_bytes=200 << 10),
                                  keep=keep, process_group=dist.group.WORLD, stats=stats))
        ref = {}
        for f in files:
            ref.update({n: t for n, t in load_file(f).items() if keep(n)})
        got = dict(pairs)
        result["equal"] = (len(got) == len(pairs) and set(got) == set(ref) and all(
            got[n].dtype == ref[n].dtype and torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8))
            for n in ref))
        result.update(batches=stats.batches, tensors=stats.tensors, kinds=stats.kinds)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
