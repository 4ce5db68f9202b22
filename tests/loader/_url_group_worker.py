"""One rank of tests/loader/test_url_group.py: loads URL sources with
``process_group=`` in a gloo group and writes what it saw to
OUT/rank<r>.json.

    python _url_group_worker.py SPEC.json RANK

SPEC.json: {"world", "port", "out", "options" (storage_options, less its retry_config: fast_retry_config()),
"scenarios": [{"name", "url", "local", "delay_others"}]}.  A scenario
records {"ok", "equal" (bit for bit against safetensors' load of
"local"), "read_bytes", "error", "message", "ranks"}; ranks other than 0
wait "delay_others" seconds before they load (rank 0 opens first).
"""

import datetime
import json
import sys
import time


def main(spec_path, rank):
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file as st_load

    from instant_staging.loader import iter_load

    from support.remote_servers import fast_retry_config

    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    pg = dist.new_group(list(range(world)), backend="gloo")
    options = {**spec["options"], "retry_config": fast_retry_config()}
    records = []
    for sc in spec["scenarios"]:
        dist.barrier(pg)
        if rank and sc.get("delay_others"):
            time.sleep(sc["delay_others"])
        rec = {"name": sc["name"]}
        try:
            with iter_load(sc["url"], "cpu", process_group=pg, storage_options=options) as it:
                got = dict(it)
                rec["read_bytes"] = it.read_bytes
            ref = st_load(sc["local"])
            rec["ok"] = True
            rec["equal"] = set(got) == set(ref) and all(
                got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape and
                torch.equal(got[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8))
                for k in ref)
            del got, ref
        except Exception as e:
            rec.update(ok=False, error=type(e).__name__, message=str(e),
                       ranks=sorted(getattr(e, "ranks", None) or []))
        records.append(rec)
    with open(f"{spec['out']}/rank{rank}.json", "w") as f:
        json.dump(records, f)
    dist.barrier(pg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
