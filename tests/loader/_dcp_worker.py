"""One rank of tests/loader/test_dcp.py: a model sharded with FSDP2
(``fully_shard`` on a CPU mesh, gloo) saved through
torch.distributed.checkpoint by DCP's own Hugging Face writer and by
``SafetensorsStorageWriter``, in one group, scenario after scenario.

    python _dcp_worker.py OUT PORT RANK

Writes under OUT: ``expected.pt`` (rank 0: the whole state dict),
``theirs*/``, ``ours*/`` (the two writers' checkpoints), and
``rank<r>.json``: what this rank saw (``reloaded``: DCP's reader loaded
our files back into a sharded model equal to the saved one; ``clash``,
``failed``: the errors of the refused and the failed save; ``before``:
sha256 of every file before the failed save).
"""

import datetime
import hashlib
import json
import os
import sys


def model(torch, seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7))
    m[2].to(torch.bfloat16)
    return m


def shard(torch, m, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)       # 33 rows over 2 ranks: 17 and 16
    fully_shard(m, mesh=mesh)
    return m


def digests(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main(out, port, rank):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from instant_staging.loader import SafetensorsStorageWriter, _save

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    seen = {}
    m = shard(torch, model(torch, 0), mesh)
    sd = m.state_dict()
    full = {k: v.full_tensor() for k, v in sd.items()}
    if rank == 0:
        torch.save(full, os.path.join(out, "expected.pt"))
    mapping = {"0.weight": 1, "0.bias": 2, "2.weight": 1, "2.bias": 2}

    # Each rank its shares, consolidated by the coordinator: both writers.
    for name, writer in (("theirs", dcp.HuggingFaceStorageWriter), ("ours", SafetensorsStorageWriter)):
        dcp.save(sd, storage_writer=writer(os.path.join(out, name), fqn_to_index_mapping=mapping,
                                           save_distributed=True, enable_consolidation=True))

    # DCP's reader loads our ranks' files (resharded by DCP's planner) and our
    # consolidated ones into a model of other values.
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    for source in ("ours/sharded", "ours"):
        other = shard(torch, model(torch, 1), mesh)
        osd = other.state_dict()
        dcp.load(osd, storage_reader=HuggingFaceStorageReader(os.path.join(out, source)))
        seen[f"reloaded {source}"] = all(torch.equal(osd[k].full_tensor(), full[k]) for k in full)

    # Rank 0 saves the whole state dict (DCP's writer without save_distributed).
    whole = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, writer in (("theirs0", dcp.HuggingFaceStorageWriter),
                         ("ours0", SafetensorsStorageWriter)):
        dcp.save(whole, storage_writer=writer(os.path.join(out, name), fqn_to_index_mapping=mapping))

    # Both ranks' shares into one file name: refused before any file is written.
    try:
        dcp.save(sd, storage_writer=SafetensorsStorageWriter(os.path.join(out, "clash")))
        seen["clash"] = None
    except BaseException as e:      # DCP's CheckpointException is a BaseException
        seen["clash"] = str(e)

    # A save that fails in the middle of rank 1's second file.
    target = os.path.join(out, "failed")
    dcp.save(sd, storage_writer=SafetensorsStorageWriter(target, fqn_to_index_mapping=mapping,
                                                         save_distributed=True,
                                                         enable_consolidation=True))
    dist.barrier()
    seen["before"] = digests(target)
    dist.barrier()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1)
    files = []
    real_publish, real_write = _save.publish, _save._pwritev_all

    def publish(plan, path, **kwargs):
        files.append(path)
        return real_publish(plan, path, **kwargs)

    def write(fd, views, offset):
        if rank == 1 and len(files) == 2 and offset > 64:
            raise OSError(28, "No space left on device")
        return real_write(fd, views, offset)
    import instant_staging.loader._dcp as dcp_module
    dcp_module.publish, _save._pwritev_all = publish, write
    try:
        dcp.save(m.state_dict(), storage_writer=SafetensorsStorageWriter(
            target, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True))
        seen["failed"] = None
    except BaseException as e:      # DCP's CheckpointException is a BaseException
        seen["failed"] = str(e)
    finally:
        dcp_module.publish, _save._pwritev_all = real_publish, real_write
    seen["written"] = len(files)

    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    # Out without the interpreter's finalization (torch's hazard,
    # pytorch#190489).  destroy_process_group leaves the gloo group alive
    # (FSDP's mesh info still holds it), and its worker threads drop a
    # finished collective only after the caller saw it complete; a barrier
    # keeps the collectives still in flight when it was called until it is
    # dropped itself.  The last of DCP's broadcast tensors, owned by Python
    # objects, goes then, taking the GIL: a worker thread late enough to do
    # that while the interpreter finalizes is ended by Python inside a C++
    # destructor (std::terminate: "terminate called without an active
    # exception", the rank killed by SIGABRT).  Everything this rank
    # reports is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
