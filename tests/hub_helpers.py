"""A local stand-in for the Hugging Face Hub, enough for ``huggingface_hub.snapshot_download``.

``FakeHub({"org/name": {commit_sha: {path: bytes}}})`` serves, on a free local port, the routes
a snapshot download uses: the revision info (``/api/models/<repo>/revision/<rev>``), the file
tree (``/api/models/<repo>/tree/<sha>``) and the files (``/<repo>/resolve/<sha>/<path>``, HEAD
and GET, with the ``X-Repo-Commit`` and ``ETag`` headers). ``main`` is a repository's first
commit. Unknown repositories and revisions answer 404 with the Hub's ``X-Error-Code``, so
huggingface_hub raises its own ``RepositoryNotFoundError`` / ``RevisionNotFoundError``; a
repository given as the string ``"gated"`` answers 403 ``GatedRepo``, as a gated model does
without an accepted licence.
``requests`` records every (method, path). ``use_fake_hub`` points huggingface_hub at it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse
from pathlib import Path


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloaded(self) -> list[str]:
        """The files fetched with GET, in order."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == "GET" and "/resolve/" in p]  # fmt: skip

    def _lookup(self, repo: str, rev: str) -> tuple[str | None, dict[str, bytes] | None, str]:
        """(commit, files, error code) of ``repo`` at ``rev``."""
        revs = self.repos.get(repo)
        if revs is None:
            return None, None, "RepoNotFound"
        if revs == "gated":
            return None, None, "GatedRepo"
        if rev == "main":
            rev = next(iter(revs))
        if rev not in revs:
            return None, None, "RevisionNotFound"
        return rev, revs[rev], ""

    def _handler(hub):  # noqa: N805 - the handler class closes over the hub
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool) -> None:
                path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
                hub.requests.append((self.command, path))
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                for marker in ("revision", "tree") if api else ("resolve",):
                    if marker in parts:
                        break
                else:
                    return self._send(404, head=head)
                i = parts.index(marker)
                repo = "/".join(parts[2:i] if api else parts[:i])
                rev = parts[i + 1] if i + 1 < len(parts) else "main"
                sha, files, error = hub._lookup(repo, rev)
                if sha is None:
                    code = 403 if error == "GatedRepo" else 404
                    return self._send(code, b"{}", {"X-Error-Code": error}, head)
                if marker == "revision":
                    siblings = [{"rfilename": name} for name in files]
                    body = json.dumps({"id": repo, "sha": sha, "siblings": siblings})
                    return self._send(
                        200, body.encode(), {"Content-Type": "application/json"}, head
                    )
                if marker == "tree":
                    entries = [
                        {
                            "type": "file",
                            "path": n,
                            "size": len(b),
                            "oid": hashlib.sha1(b).hexdigest(),
                        }
                        for n, b in files.items()
                    ]
                    body = json.dumps(entries).encode()
                    return self._send(200, body, {"Content-Type": "application/json"}, head)
                name = "/".join(parts[i + 2 :])
                if name not in files:
                    return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)
                data = files[name]
                etag = '"' + hashlib.sha1(data).hexdigest() + '"'
                self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag}, head)

            def do_HEAD(self):  # noqa: N802 - http.server's naming
                self._route(True)

            def do_GET(self):  # noqa: N802
                self._route(False)

        return Handler


def repo_files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def use_fake_hub(monkeypatch, hub: FakeHub, cache: Path) -> None:
    """Point huggingface_hub at ``hub`` (online) with its cache at ``cache``."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
