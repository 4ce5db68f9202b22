"""A local server that answers as the Hugging Face Hub does, for the few
endpoints huggingface_hub (0.2x to 2.x) and the loader ask: point
``HF_ENDPOINT`` at ``HubServer.url`` and ``snapshot_download``,
``hf_hub_download`` and a resolve URL read from it.

    GET  /api/models/<org>/<name>/revision/<revision>   repo_info: sha, siblings
    GET  /api/models/<org>/<name>/tree/<revision>[/<path>]
                                            list_repo_tree: files, sizes, blob and LFS ids
    HEAD /<org>/<name>/resolve/<revision>/<path>
    GET  /<org>/<name>/resolve/<revision>/<path>
         a .safetensors file (stored in LFS on the Hub) answers 302 to
         /lfs/<sha256> (an absolute URL, as the Hub's redirect to its CDN,
         which huggingface_hub does not follow for a HEAD) with
         X-Linked-Etag and X-Linked-Size; any other file 200 with its bytes; both with
         X-Repo-Commit and ETag
    GET  /lfs/<sha256>      (on ``cdn``, another port) the bytes, Range and If-Match honoured

A revision is a branch or tag name (``refs``), a commit (40 hex digits),
percent-encoded where it holds '/'.  A repo made with ``token=`` answers
401 (RepoNotFound, as the Hub does for a private repo) without
``Authorization: Bearer <token>``.  ``requests``: ``(method, path)`` of
each request, for tests that say nothing was asked.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import pathlib
import threading
import urllib.parse

from .remote_servers import _etag_in, _Handler, _parse_range, _reason, _Threaded


def _lfs(name):
    return name.endswith(".safetensors")


class HubServer(_Threaded):
    """Hub repos of files on disk: ``add(repo_id, directory, refs)`` gives a
    commit of every file under ``directory`` (read when asked, not copied)."""

    def __init__(self):
        super().__init__()
        self.repos = {}         # repo id -> {"commits": {sha: {path: file}}, "refs": {}, "token"}
        self.blobs = {}         # sha256 -> file (the LFS store)
        self.requests = []
        self._lock = threading.Lock()
        self.cdn = _Cdn(self)       # another origin: the Hub's LFS redirects leave the Hub

    def start(self):
        self.cdn.start()
        return super().start()

    def stop(self):
        super().stop()
        self.cdn.stop()

    def add(self, repo_id, directory, refs=("main",), token=None):
        """Commits every file under ``directory`` to ``repo_id``; each of
        ``refs`` (branches, tags) names the commit.  Returns its sha."""
        root = pathlib.Path(directory)
        files = {p.relative_to(root).as_posix(): str(p) for p in sorted(root.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode())
        for path, file in files.items():
            digest.update(path.encode() + b"\0" + _sha256(file).encode())
        sha = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, {"commits": {}, "refs": {}, "token": token})
        repo["commits"][sha] = files
        for ref in refs:
            repo["refs"][ref] = sha
        for path, file in files.items():
            if _lfs(path):
                self.blobs[_sha256(file)] = file
        return sha

    def commit(self, repo_id, revision):
        """The sha ``revision`` names in ``repo_id``, else None."""
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        if revision in repo["commits"]:
            return revision
        return repo["refs"].get(revision)

    def asked(self, part=""):
        """The requests so far whose path holds ``part``."""
        with self._lock:
            return [r for r in self.requests if part in r[1]]


_sums = {}


def _sha256(file):
    st = os.stat(file)
    key = (file, st.st_mtime_ns, st.st_size)
    if key not in _sums:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _sums[key] = h.hexdigest()
    return _sums[key]


def _blob_id(file):
    # git's blob id (what the Hub's tree gives as "oid" for a small file)
    h = hashlib.sha1(b"blob %d\0" % os.path.getsize(file))
    with open(file, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


class _Cdn(_Threaded):
    """The LFS blobs' origin (GET /lfs/<sha256>), apart from the Hub's."""

    def __init__(self, hub):
        super().__init__()
        self.hub = hub


class _HubHandler(_Handler):

    def do_GET(self):
        self._serve(body=True)

    def do_HEAD(self):
        self._serve(body=False)

    def _json(self, status, obj, extra=()):
        data = json.dumps(obj).encode()
        self.write_head(status, _reason(status), [("Content-Type", "application/json"),
                                                  ("Content-Length", len(data)), *extra])
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status, code, message):
        self._json(status, {"error": message}, [("X-Error-Code", code), ("X-Error-Message", message)])

    def _serve(self, body):
        hub = getattr(self.server.owner, "hub", self.server.owner)
        self.read_body()
        path = urllib.parse.urlsplit(self.path).path
        with hub._lock:
            hub.requests.append((self.command, path))
        parts = [urllib.parse.unquote(p) for p in path.split("/")[1:]]
        if parts[:1] == ["lfs"] and len(parts) == 2:
            return self._blob(hub.blobs.get(parts[1]), body)
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, what, revision, rest = "/".join(parts[2:4]), parts[4], parts[5], parts[6:]
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, what, revision, rest = "/".join(parts[:2]), "resolve", parts[3], parts[4:]
        else:
            return self._error(404, "EntryNotFound", "no such route")
        # a revision with '/' comes encoded as one part (refs%2Fpr%2F1), or not
        repo = hub.repos.get(repo_id)
        if repo is None or (repo["token"] and self.headers.get("Authorization") != f"Bearer {repo['token']}"):
            return self._error(401, "RepoNotFound", "Repository Not Found")
        sha = hub.commit(repo_id, revision)
        if sha is None and what == "resolve":
            for n in range(1, len(rest)):       # refs/pr/1/model.safetensors, unencoded
                sha = hub.commit(repo_id, "/".join([revision, *rest[:n]]))
                if sha is not None:
                    rest = rest[n:]
                    break
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo["commits"][sha]
        if what == "revision":
            return self._json(200, {"id": repo_id, "modelId": repo_id, "sha": sha,
                                    "private": bool(repo["token"]),
                                    "siblings": [{"rfilename": p} for p in files]})
        if what == "tree":
            prefix = "/".join(rest)
            return self._json(200, [self._tree_entry(p, f) for p, f in files.items()
                                    if not prefix or p.startswith(prefix + "/")])
        if what != "resolve":
            return self._error(404, "EntryNotFound", "no such route")
        name = "/".join(rest)
        file = files.get(name)
        if file is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {revision}")
        common = [("X-Repo-Commit", sha), ("Accept-Ranges", "bytes")]
        if _lfs(name):
            oid = _sha256(file)
            self.write_head(302, "Found", [*common, ("Location", f"{hub.cdn.url}/lfs/{oid}"),
                                           ("X-Linked-Etag", f'"{oid}"'),
                                           ("X-Linked-Size", os.path.getsize(file)),
                                           ("ETag", f'"{_blob_id(file)}"'), ("Content-Length", 0)])
            return
        return self._file(file, body, f'"{_blob_id(file)}"', common)

    @staticmethod
    def _tree_entry(path, file):
        entry = {"type": "file", "oid": _blob_id(file), "size": os.path.getsize(file), "path": path}
        if _lfs(path):
            entry["lfs"] = {"oid": _sha256(file), "size": os.path.getsize(file), "pointerSize": 134}
        return entry

    def _blob(self, file, body):
        if file is None:
            return self._error(404, "EntryNotFound", "no such blob")
        return self._file(file, body, f'"{_sha256(file)}"', [("Accept-Ranges", "bytes")])

    def _file(self, file, body, etag, common):
        with open(file, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            common = [*common, ("ETag", etag),
                      ("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))]
            if_match = self.headers.get("If-Match")
            if if_match is not None and not _etag_in(if_match, etag):
                return self._json(412, {"error": "precondition failed"}, common)
            rng = self.headers.get("Range")
            span = _parse_range(rng, size) if rng else None
            if span == "unsatisfiable":
                return self._json(416, {"error": "range"}, [("Content-Range", f"bytes */{size}")])
            start, length = self.write_file_head(size, span, common)
            if body and length > 0:
                f.seek(start)
                self.write_from(f, length)


HubServer._handler = _Cdn._handler = _HubHandler
