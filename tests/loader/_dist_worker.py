"""One rank of tests/loader/test_distributed.py: runs every scenario in one gloo
group, in order, and writes what each rank saw to OUT/rank<r>.json.

    python _dist_worker.py SPEC.json RANK

SPEC.json: {"world", "port", "out", "files": {...}, "scenarios": [names]}.
Each scenario records {"ok": bool, "error": type name, "message",
"ranks": failed ranks (DistributedLoadError), "equal": the loaded tensors
equal safetensors' own load of the same selection bit for bit, "names",
"kinds", "read_bytes", "warnings"}.  Scenarios after a failure check that
the group is still usable.  The ``leak_*`` scenarios make rank 1 fail at
one step of the load (``probe``) and record what each rank's load left:
its tensors alive, its files open, its staging buffer held, registrations.
"""

import datetime
import json
import logging
import os
import shutil
import sys
import time


def main(spec_path, rank):
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file as st_load

    import instant_staging as ist
    from instant_staging.loader import iter_load, load_file
    from instant_staging.testing import SimulatedRuntime

    world, files = spec["world"], spec["files"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    pg = dist.new_group(list(range(world)), backend="gloo")
    sub = dist.new_group(list(range(1, world)), backend="gloo")   # every rank but 0
    # A group of its own for the load a rank leaves mid-exchange: the others'
    # broadcasts it never matched stay queued there, out of every later load's way.
    mid = dist.new_group(list(range(world)), backend="gloo")
    chunk = 2 * 4096

    warnings = []

    class Catch(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("instant_staging").addHandler(Catch(level=logging.WARNING))

    def reference(paths, names=None):
        ref = {}
        for p in paths:
            ref.update(st_load(p))
        keep = names if callable(names) else (lambda k: names is None or k in names)
        return {k: v for k, v in ref.items() if keep(k)}

    def equal(got, ref):
        if list(got) != sorted(got, key=list(ref).index) or set(got) != set(ref):
            return False
        return all(got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
                   and torch.equal(got[k].reshape(-1).view(torch.uint8),
                                   ref[k].reshape(-1).view(torch.uint8)) for k in ref)

    def owns_memory(got):
        ptrs = [t.untyped_storage().data_ptr() for t in got.values() if t.numel()]
        return len(ptrs) == len(set(ptrs))

    def run(paths, names=None, expect=None, **kw):
        """Loads through iter_load; records the outcome."""
        del warnings[:]
        rec = {}
        try:
            it = iter_load(paths, "cpu", names=names, process_group=pg, chunk_size=chunk, **kw)
            with it:
                got = dict(it)
                rec.update(kinds=[k.name if k is not None else None for k in it.staging_kinds],
                           read_bytes=it.read_bytes)
            ref = reference(paths, expect if expect is not None else names)
            rec.update(ok=True, equal=equal(got, ref), names=list(got), owns=owns_memory(got))
        except Exception as e:
            rec.update(ok=False, error=type(e).__name__, message=str(e),
                       ranks=sorted(getattr(e, "ranks", {}) or {}))
        rec["warnings"] = list(warnings)
        return rec

    def open_files(paths):
        real, n = {os.path.realpath(p) for p in paths}, 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}") in real
            except OSError:
                pass
        return n

    def probe(paths, patches=(), fail_allocate=None, faults=None, take=None, group=pg, **kw):
        """A load through iter_load with a simulated staging buffer, with
        ``patches`` ((object, name, value)) and, where set, the
        ``fail_allocate``-th tensor's allocation failing and ``faults``
        (read rules) on rank 1 only; ``take`` tensors consumed before a
        close (None: all).  Records the outcome and what the load left."""
        import gc
        import weakref

        from instant_staging.loader import _target
        mine = rank == 1
        rt = SimulatedRuntime(faults=faults if mine else None)
        buf = ist.StagingBuffer(16 * chunk, copy_unit=chunk, runtime=rt)
        refs, got, error = [], [], None
        real_allocate = _target._TorchTarget.allocate

        def allocate(self, entry, dtype):
            if mine and fail_allocate is not None and len(refs) + 1 == fail_allocate:
                raise MemoryError(f"injected: allocation {fail_allocate} failed")
            t, ptr = real_allocate(self, entry, dtype)
            refs.append(weakref.ref(t))
            return t, ptr
        patches = [(_target._TorchTarget, "allocate", allocate)] + (list(patches) if mine else [])
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        rec = {}
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            with iter_load(paths, "cpu", process_group=group, chunk_size=chunk, staging=buf,
                           **kw) as it:
                for item in it:
                    got.append(item)
                    if take is not None and len(got) == take:
                        break
            rec.update(ok=True)
        except BaseException as e:      # Ctrl-C (an injected KeyboardInterrupt) too
            error = e
            rec.update(ok=False, error=type(e).__name__, message=str(e),
                       ranks=sorted(getattr(e, "ranks", {}) or {}))
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)
        # (error, and its traceback, kept alive meanwhile: it holds no tensor)
        deadline = time.monotonic() + 10   # (the group's works drop theirs as they finish)
        while True:
            gc.collect()
            alive = sum(r() is not None for r in refs) - len(got)
            if alive == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        rec.update(alive=alive, allocated=len(refs), taken=len(got), open=open_files(paths))
        try:
            buf.close()
            rec["held"] = False
        except BufferError as e:
            rec["held"] = str(e)
        rec["leaks"] = [rt.live_registrations, rt.live_host_allocs]
        del error
        return rec

    from instant_staging.loader import _distributed, _pipeline, _run

    # Buckets far smaller than the default, so that a load of these small
    # files passes many through each rank's slots (and reuses them).
    _distributed.BUCKET_BYTES = _distributed.HOST_BUCKET_BYTES = spec["bucket"]

    from support.calls import raise_on_call as on_call
    from support.calls import raising

    def plan_rows():
        """Each rank its own rows (plan=), some overlapping; compared with
        safetensors' get_slice."""
        from safetensors import safe_open as st_open

        from instant_staging.loader import Checkpoint
        rec = {}
        with Checkpoint.open(shards) as ck:
            rows = {n: ck.info(n).shape[0] for n in ck.names() if len(ck.info(n).shape) == 2}

            def plan_of(r, rows=rows):
                plan = {"scalar": None}
                for j, (n, count) in enumerate(sorted(rows.items())):
                    if (j + r) % 4 == 0:
                        continue                        # not rank r's
                    share = -(-count // world)
                    lo = [r * share, 0, count // 3, r * share][j % 4]
                    hi = [lo + share, count, count, lo + 2 * share][j % 4]
                    plan[n] = slice(lo, hi) if j % 4 != 1 else None
                return plan

            # The bytes some rank wants, each counted once: what the
            # ranks read together.
            wanted = {}
            for r in range(world):
                for n, part in plan_of(r).items():
                    info = ck.info(n)
                    row = (info.nbytes // info.shape[0] if info.shape[0] else 0) if info.shape \
                        else info.nbytes
                    lo, hi = (0, info.shape[0] if info.shape else 1) if part is None else \
                        part.indices(info.shape[0])[:2]
                    wanted.setdefault(n, set()).update(range(lo * row, max(lo, hi) * row))
            rec["union_bytes"] = sum(len(b) for b in wanted.values())
            plan = plan_of(rank)
            try:
                with ck.iter_load("cpu", plan=plan, process_group=pg, chunk_size=chunk) as it:
                    got = dict(it)
                    rec["read_bytes"] = it.read_bytes
                ref = {}
                for path in shards:
                    with st_open(path, "pt") as f:
                        for n in f.keys():  # noqa: SIM118 (safe_open is no dict)
                            if n in plan:
                                part = plan[n]
                                ref[n] = (f.get_tensor(n) if part is None
                                          else f.get_slice(n)[part.start:part.stop])
                order = [n for n in ck.names() if n in ref]      # (reading order)
                rec.update(ok=True, equal=equal(got, {n: ref[n] for n in order}),
                           names=list(got), rows=sum(p is not None for p in plan.values()))
            except Exception as e:
                rec.update(ok=False, error=type(e).__name__, message=str(e),
                           ranks=sorted(getattr(e, "ranks", {}) or {}))
        return rec

    def changed_on_rank_1(name, change):
        """A group load of each rank's own copy of the single file, rank 1's
        changed by ``change(path)`` once the load is prepared."""
        mine = os.path.join(spec["out"], f"{name}{rank}.safetensors")
        shutil.copy(files["single"], mine)
        try:
            it = iter_load([mine], "cpu", process_group=pg, chunk_size=chunk)
            if rank == 1:
                change(mine)
            del warnings[:]
            with it:
                dict(it)
            return dict(ok=True)
        except Exception as e:
            return dict(ok=False, error=type(e).__name__, message=str(e),
                        ranks=sorted(getattr(e, "ranks", {}) or {}))

    def write_back(path):
        time.sleep(0.05)                # (file times move a clock tick at a time)
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(data)

    def count_collectives(*paths):
        """Per load of each path, the collectives this rank called at
        torch.distributed (every function that moves tensors between
        ranks, wrapped), the tensors it sliced (``Tensor.__getitem__``,
        wrapped), and whether the load equals safetensors'."""
        import functools
        names = ["broadcast", "all_gather", "all_gather_into_tensor", "all_reduce", "reduce",
                 "reduce_scatter", "reduce_scatter_tensor", "scatter", "gather", "all_to_all",
                 "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
                 "barrier", "broadcast_object_list", "all_gather_object"]
        calls = []

        def counted(name, real):
            @functools.wraps(real)
            def f(*args, **kwargs):
                calls.append(name)
                return real(*args, **kwargs)
            return f
        saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
        rec = dict(ok=True, counts=[], slices=[], equal=[], bucket=spec["count_bucket"])
        sliced = []
        real_getitem = torch.Tensor.__getitem__

        def getitem(self, key):
            sliced.append(1)
            return real_getitem(self, key)
        bucket = _distributed.HOST_BUCKET_BYTES
        _distributed.HOST_BUCKET_BYTES = spec["count_bucket"]       # (the loads are to the CPU)
        try:
            for n, real in saved.items():
                setattr(dist, n, counted(n, real))
            for path in paths:
                del calls[:]
                torch.Tensor.__getitem__ = getitem
                try:
                    got = load_file(path, process_group=pg, chunk_size=chunk)
                finally:
                    del torch.Tensor.__getitem__        # (TensorBase's again)
                rec["counts"].append(len(calls))
                rec["slices"].append(len(sliced))
                del sliced[:]
                rec["equal"].append(equal(got, reference([path])))
        finally:
            for n, real in saved.items():
                setattr(dist, n, real)
            _distributed.HOST_BUCKET_BYTES = bucket
        return rec

    shards = files["shards"]
    everything = reference(shards)
    out = {}
    for name in spec["scenarios"]:
        t0 = time.monotonic()
        if name == "replicated":
            out[name] = run(shards)
        elif name == "load_file":
            calls = []
            got = load_file(shards, process_group=pg, chunk_size=chunk, threads=2,
                            progress=lambda done, total, calls=calls: calls.append((done, total)))
            out[name] = dict(ok=True, equal=equal(got, everything), owns=owns_memory(got),
                             progress=calls)
        elif name == "progress_true":   # progress=True: the lines each rank prints
            import io
            stderr, sys.stderr = sys.stderr, io.StringIO()
            try:
                got = load_file(shards, process_group=pg, chunk_size=chunk, threads=2,
                                progress=True)
                lines = sys.stderr.getvalue().splitlines()
            finally:
                sys.stderr = stderr
            out[name] = dict(ok=True, equal=equal(got, everything), owns=owns_memory(got),
                             lines=lines)
        elif name == "dtype_and_directory":   # dtype= and a directory source under a group
            got = load_file(os.path.dirname(shards[0]), dtype=torch.float32, process_group=pg,
                            chunk_size=chunk)
            want = {k: v.float() if v.is_floating_point() else v for k, v in everything.items()}
            out[name] = dict(ok=True, equal=equal(got, want), owns=owns_memory(got))
        elif name == "names":
            # Each rank its own third, all ranks the norms, ranks 0 and 1 the embeddings.
            mine = {k for i, k in enumerate(sorted(everything)) if i % world == rank}
            mine |= {k for k in everything if "norm" in k}
            if rank < 2:
                mine |= {k for k in everything if "embed" in k}
            out[name] = run(shards, names=sorted(mine))
        elif name == "predicate":
            out[name] = run(shards, names=lambda k: "layers.1." in k or k.endswith(str(rank)))
        elif name == "nothing_on_one_rank":
            out[name] = run(shards, names=[] if rank == world - 1 else None,
                            expect=[] if rank == world - 1 else None)
        elif name == "tiny":            # more ranks than shards, and than tensors
            out[name] = run([files["tiny"]])
        elif name == "bad_file":        # the last rank's copy is not a safetensors file
            out[name] = run([files["bad"] if rank == world - 1 else files["single"]])
        elif name == "other_layout":
            out[name] = run([files["other"] if rank == 1 else files["single"]])
        elif name == "prefix_sources":  # rank 1's shards are the first of rank 0's
            out[name] = run(shards[:1] if rank == 1 else shards[:2])
        elif name in ("own_copies", "other_data", "unsampled_change", "other_last_page"):
            # Each rank its own copy of one file, at its own path; rank 1's
            # with one byte changed: the first data byte (a sampled page), or
            # one between the sampled pages (only verify= sees it).
            mine = os.path.join(spec["out"], f"{name}-rank{rank}.safetensors")
            shutil.copy(files["single"], mine)
            if rank == 1 and name != "own_copies":
                with open(mine, "r+b") as f:
                    where = 8 + int.from_bytes(f.read(8), "little") + (5000 if name == "unsampled_change"
                                                                        else 0)
                    if name == "other_last_page":           # the file's last byte
                        where = os.path.getsize(mine) - 1
                    f.seek(where)
                    byte = f.read(1)[0]
                    f.seek(where)
                    f.write(bytes([byte ^ 0xFF]))
            out[name] = run([mine], verify=name == "unsampled_change")
        elif name == "other_header":    # the same layout, another __metadata__ value
            out[name] = run([files["meta_b"] if rank == 1 else files["meta_a"]])
        elif name == "other_dtype":
            out[name] = run(shards, dtype=torch.float32 if rank == 1 else None)
        elif name == "unknown_name":
            out[name] = run(shards, names=["no such tensor"] if rank == 0 else None)
        elif name == "plan_rows":       # each rank its own rows (plan=), some overlapping
            out[name] = plan_rows()
        elif name == "truncated":       # rank 1's copy shrinks after validation
            out[name] = changed_on_rank_1(name, lambda mine: os.truncate(mine, 4096))
        elif name == "written":         # rank 1's copy written to (the same bytes) mid-load
            out[name] = changed_on_rank_1(name, write_back)
        elif name == "read_fault":      # the `read` fault rule on rank 1 only
            if rank == 1:
                os.environ["INSTANT_STAGING_FAULTS"] = "read#1=EIO"
            try:
                out[name] = run([files["single"]])
            finally:
                os.environ.pop("INSTANT_STAGING_FAULTS", None)
        elif name == "kinds":           # rank 0's registration refused: RUNTIME_PINNED
            rt = SimulatedRuntime(faults="register=invalid_value" if rank == 0 else None)
            buf = ist.StagingBuffer(16 * chunk, copy_unit=chunk, runtime=rt)
            out[name] = run(shards, staging=buf)
            buf.close()
            out[name]["leaks"] = [rt.live_registrations, rt.live_host_allocs]
        elif name == "staging_unusable":   # rank 1's staging buffer holds no chunk
            rt = SimulatedRuntime()
            buf = ist.StagingBuffer(4096, runtime=rt) if rank == 1 else None
            out[name] = run(shards, staging=buf)
            if buf is not None:
                buf.close()
                out[name]["leaks"] = [rt.live_registrations, rt.live_host_allocs]
        elif name == "subgroup":        # group ranks differ from global ranks; rank 0 outside
            try:
                got = load_file(shards, process_group=sub, chunk_size=chunk)
                out[name] = dict(ok=True, equal=equal(got, everything))
            except Exception as e:
                out[name] = dict(ok=False, error=type(e).__name__, message=str(e))
        elif name == "not_a_group":
            try:
                load_file(shards, process_group="world")
                out[name] = dict(ok=True)
            except Exception as e:
                out[name] = dict(ok=False, error=type(e).__name__, message=str(e))
        elif name == "dropped":         # rank 1 closes its iterator without loading
            if rank == 1:
                iter_load(shards, process_group=pg).close()
                out[name] = dict(ok=None)
            else:
                out[name] = run(shards)
        elif name == "leak_plan":      # step 1: rank 1's share of the reads
            out[name] = probe(shards, [(_distributed, "share_reads",
                                        raising(RuntimeError("injected: plan")))])
        elif name == "leak_pipeline":  # step 2: rank 1's reader pipeline
            out[name] = probe(shards, [(_pipeline, "Pipeline",
                                        raising(RuntimeError("injected: pipeline")))])
        elif name == "leak_allocate":  # step 3: rank 1's fourth tensor (its pipeline made)
            out[name] = probe(shards, fail_allocate=4)
        elif name == "leak_read":      # step 5: a read of rank 1's fails (agreement 3)
            out[name] = probe(shards, faults="read#2=EIO")
        elif name == "leak_exchange":  # step 5: Ctrl-C on rank 1 once every exchange is issued
            out[name] = probe(shards, [(_distributed._Waiter, "until_all", raising(KeyboardInterrupt()))])
        elif name == "leak_midway":    # step 5: Ctrl-C on rank 1 before its second bucket
            out[name] = probe(shards, [(_distributed._Waiter, "until_each",
                                        on_call(2, KeyboardInterrupt(), _distributed._Waiter.until_each))],
                              group=mid)
        elif name == "collectives":    # the same bytes as 100 tensors and as 4,000
            out[name] = count_collectives(files["few"], files["many"])
        elif name == "blocks":          # tensors as views of blocks (a GPU's rule, here on the CPU)
            from instant_staging.loader import _target
            viewable = _target._TorchTarget.joins
            _target._TorchTarget.joins = lambda self, dtype, views: views
            try:
                rec = count_collectives(files["many"])
                got = load_file(shards, process_group=pg, chunk_size=chunk)
                rec.update(storages=len({t.untyped_storage().data_ptr() for t in got.values()}),
                           tensors=len(got), shards_equal=equal(got, everything))
                mine = {k for i, k in enumerate(sorted(everything)) if i % world == rank}
                rec["names"] = run(shards, names=sorted(mine | {k for k in everything if "norm" in k}))
                rec["views_false"] = run(shards, views=False)
                rec["plan_rows"] = plan_rows()      # rows in tensors of their own, beside blocks
            finally:
                _target._TorchTarget.joins = viewable
            out[name] = rec
        elif name == "leak_verify":    # step 5: rank 1's third tensor handed out fails verify=
            from instant_staging.loader import VerifyError
            out[name] = probe(shards, [(_run, "verify_tensor",
                                        on_call(3, VerifyError("injected: verify"), _run.verify_tensor))],
                              verify=True)
        elif name == "leak_close":     # every rank closes its iterator after one tensor
            out[name] = probe(shards, take=1)
        elif name == "after_failures":
            out[name] = run(shards, verify=True)
        elif name == "timeout":         # the last rank never calls: the others name it
            if rank == world - 1:
                time.sleep(float(os.environ["INSTANT_STAGING_DIST_TIMEOUT"]) + 2)
                out[name] = dict(ok=None)
            else:
                out[name] = run(shards)
        else:
            raise SystemExit(f"unknown scenario {name}")
        out[name]["seconds"] = time.monotonic() - t0
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
