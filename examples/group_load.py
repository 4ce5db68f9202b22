"""A group load: every rank of a torch.distributed group loads the same
checkpoint, each reading about 1/N of its bytes, the parts exchanged over
the group; every rank ends with every tensor.

    python examples/group_load.py [CHECKPOINT] [--world 2]    # gloo, on the CPU
    torchrun --nproc-per-node 2 examples/group_load.py CHECKPOINT --nccl   # a GPU per rank

Without CHECKPOINT it writes a small one first.  Plain `python` starts
--world processes itself, on the CPU over gloo.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from instant_staging.loader import load_file


def rank_main(rank, world, source, backend, port):
    if port is not None:            # started here, not by torchrun
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    else:
        dist.init_process_group(backend)
    device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if backend == "nccl" else "cpu"
    tensors = load_file(source, device, process_group=dist.group.WORLD)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {len(tensors)} tensors, {total} bytes "
          f"on {device}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--nccl", action="store_true", help="GPUs, one per rank (under torchrun)")
    args = parser.parse_args()
    source = args.checkpoint
    if source is None:
        from _checkpoint import tiny_checkpoint
        source = tiny_checkpoint()
    backend = "nccl" if args.nccl else "gloo"
    if "RANK" in os.environ:        # torchrun set the group up
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), source, backend, None)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(rank_main, args=(args.world, source, backend, port), nprocs=args.world)


if __name__ == "__main__":
    main()
