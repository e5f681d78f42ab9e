"""A loopback stand-in for the Hugging Face Hub's file API, for `HF_ENDPOINT`.

It answers exactly what `huggingface_hub.snapshot_download` (and `model_info`) ask,
the way the Hub answers it (read from huggingface_hub's own code, `hf_api.py`,
`file_download.py`, `utils/_http.py`):

- `GET /api/models/<repo>[/revision/<rev>]`: the repo's info, `sha` (the commit the
  revision names) and `siblings` (its files);
- `GET /api/models/<repo>/tree/<rev>?recursive=...`: the file listing, with git blob ids,
  sizes and, for weights, the LFS sha256;
- `HEAD`/`GET /<repo>/resolve/<rev>/<path>`: the file with `X-Repo-Commit` and `ETag`;
  weights answer 302 to a "CDN" on another origin (`localhost` instead of `127.0.0.1`)
  with `X-Linked-Etag` and `X-Linked-Size`, as the Hub does for LFS files;
- errors carry the Hub's `X-Error-Code`: `RepoNotFound` (401, as the Hub answers for
  a missing or private repo; 404 to a request with a token), `RevisionNotFound` (404),
  `GatedRepo` (401 without a token, 403 with one that has no access), `EntryNotFound`
  (404); a path that is none of the Hub's answers a bare 404, as a web server does.

`FakeHub(repos, revoked={token})` refuses that token on every request, as the Hub
answers a revoked or mistyped token (401, no error code). `FakeHub(repos,
cut_downloads=True)` is a network that drops mid-download: every "CDN"
answer announces the whole file and closes the connection a third of the way into it;
`trickle=0.1` a slow one: a KiB of each every tenth of a second. `failing=429` answers
every request 429 (`retry_after`: with that `Retry-After`; `failing_files`: files'
requests alone, the API answering; `failing_api`: the API's alone, files answering;
`failing_times`: that many requests of each path, then none). `silent_files=True`: files'
requests are never answered (a Hub whose API answers and whose files hang), until it stops.

Every request is recorded (method, path, Authorization header) so tests can say what
went over the wire, or that nothing did.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.hub_cache import HubRepo, etag, git_blob_id, is_lfs

CDN_PREFIX = "/cdn/"


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None


class FakeHub:
    """The stand-in: `with FakeHub([repo]) as hub:` serves on `hub.endpoint`."""

    def __init__(
        self,
        repos: list[HubRepo],
        cut_downloads: bool = False,
        revoked: frozenset[str] = frozenset(),
        failing: int | None = None,
        trickle: float = 0.0,
        changed: int = 0,
        missing: frozenset[str] = frozenset(),
        retry_after: str | None = None,
        failing_files: bool = False,
        failing_times: int | None = None,
        failing_api: bool = False,
        silent_files: bool = False,
    ):
        self.repos = {repo.repo_id: repo for repo in repos}
        self.cut_downloads = cut_downloads
        self.trickle = trickle  # seconds between a "CDN" answer's KiB: a slow network
        self.revoked = revoked  # tokens the Hub refuses on every request (401)
        self.failing = failing  # a status every request gets (the Hub down or overloaded)
        self.changed = changed  # "CDN" answers sent with their last byte changed (a proxy's)
        self.missing = missing  # files the repo lists whose download is 404
        self.retry_after = retry_after  # the Retry-After of `failing` answers
        self.failing_files = failing_files  # `failing` only files' requests, not the API's
        self.failing_api = failing_api  # `failing` only the API's requests, not files'
        self.silent_files = silent_files  # files' requests held unanswered until stop()
        self._stopping = threading.Event()
        # how many requests of each path `failing` answers (None: all)
        self.failing_times = failing_times
        self._failed: dict[str, int] = {}
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seen(self, method: str | None = None, prefix: str = "") -> list[Seen]:
        with self._lock:
            return [
                r
                for r in self.requests
                if (method is None or r.method == method) and r.path.startswith(prefix)
            ]

    def fails_once_more(self, path: str) -> bool:
        """Whether `failing` answers this request to `path` (`failing_times` each)."""
        if self.failing_times is None:
            return True
        with self._lock:
            self._failed[path] = failed = self._failed.get(path, 0) + 1
            return failed <= self.failing_times

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # (the requests held unanswered end)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what the Hub answers -----------------------------------------------------------

    def find_repo(self, parts: list[str]) -> tuple[HubRepo | None, list[str]]:
        """The repo named by the first one or two path parts, and the parts after it."""
        for size in (2, 1):
            repo = self.repos.get("/".join(parts[:size]))
            if repo is not None:
                return repo, parts[size:]
        return None, parts[2:]

    def blob_for(self, sha256: str) -> bytes | None:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for path, content in files.items():
                    if is_lfs(path) and etag(path, content) == sha256:
                        return content
        return None


@dataclass(frozen=True)
class Reply:
    """An answer for `_respond` to send."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def hub_error(status: int, code: str, message: str, commit: str | None = None) -> Reply:
    headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
    if commit:
        headers["X-Repo-Commit"] = commit
    body = json.dumps({"error": message}).encode()
    return Reply(status, body, {**headers, "Content-Type": "application/json"})


def json_reply(document: Any) -> Reply:
    return Reply(200, json.dumps(document).encode(), {"Content-Type": "application/json"})


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._respond()

        def do_HEAD(self) -> None:  # noqa: N802
            self._respond()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # the test's output stays clean; requests are recorded instead

        def _respond(self) -> None:
            hub.record(Seen(self.command, self.path, self.headers.get("Authorization")))
            if hub.silent_files and not self.path.startswith("/api/"):
                hub._stopping.wait()
                self.close_connection = True
                return
            reply = self._answer()
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            if "Content-Length" not in reply.headers:
                self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if hub.cut_downloads and self.path.startswith(CDN_PREFIX):
                self.wfile.write(reply.body[: len(reply.body) // 3])
                self.close_connection = True
                return
            if hub.changed and self.path.startswith(CDN_PREFIX) and reply.body:
                with hub._lock:
                    hub.changed -= 1
                self.wfile.write(reply.body[:-1] + bytes([reply.body[-1] ^ 1]))
                return
            if hub.trickle and self.path.startswith(CDN_PREFIX):
                for start in range(0, len(reply.body), 1024):
                    self.wfile.write(reply.body[start : start + 1024])
                    self.wfile.flush()
                    time.sleep(hub.trickle)
                return
            self.wfile.write(reply.body)

        def _answer(self) -> Reply:
            path = urlsplit(self.path).path
            api = path.startswith("/api/")
            if (
                hub.failing is not None
                and not (hub.failing_files and api)
                and not (hub.failing_api and not api)
                and hub.fails_once_more(path)
            ):
                failed = hub_error(hub.failing, "", "Internal Error")
                if hub.retry_after is not None:
                    failed.headers["Retry-After"] = hub.retry_after
                return failed
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if token in hub.revoked:  # the Hub's answer to a token it does not know
                return hub_error(401, "", "Invalid credentials in Authorization header")
            if path.startswith(CDN_PREFIX):
                content = hub.blob_for(path.removeprefix(CDN_PREFIX))
                return Reply(200, content) if content is not None else Reply(404)
            parts = [unquote(part) for part in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"]:
                return self._api(parts[2:])
            repo, rest = hub.find_repo(parts)
            if len(rest) >= 3 and rest[0] == "resolve":
                if repo is None:
                    return self._no_repo()
                return self._resolve(repo, rest[1], "/".join(rest[2:]))
            return Reply(404)

        def _api(self, parts: list[str]) -> Reply:
            repo, rest = hub.find_repo(parts)
            if repo is None:
                return self._no_repo()
            if not rest:
                rest = ["revision", "main"]
            if len(rest) < 2 or rest[0] not in ("revision", "tree"):
                return Reply(404)
            commit = repo.commit_of(rest[1])
            if commit is None:
                return hub_error(404, "RevisionNotFound", "Invalid rev id: " + rest[1])
            files = repo.commits[commit]
            if rest[0] == "revision":
                return json_reply(
                    {
                        "id": repo.repo_id,
                        "modelId": repo.repo_id,
                        "sha": commit,
                        "private": False,
                        "gated": "manual" if repo.gated else False,
                        "siblings": [{"rfilename": name} for name in sorted(files)],
                    }
                )
            return json_reply(tree(files))

        def _no_repo(self) -> Reply:
            """The Hub's answer for a repo it does not have (or does not show): 401 without a
            token, 404 with one."""
            status = 404 if self.headers.get("Authorization") else 401
            return hub_error(status, "RepoNotFound", "Repository not found")

        def _resolve(self, repo: HubRepo, revision: str, name: str) -> Reply:
            if repo.gated:
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                if not token:
                    return hub_error(401, "GatedRepo", "Access to this model is restricted.")
                if token not in repo.granted_tokens:
                    return hub_error(403, "GatedRepo", "Access to this model is restricted.")
            commit = repo.commit_of(revision)
            if commit is None:
                return hub_error(404, "RevisionNotFound", "Invalid rev id: " + revision)
            content = repo.commits[commit].get(name)
            if content is None or name in hub.missing:
                return hub_error(404, "EntryNotFound", "Entry not found", commit)
            tag = etag(name, content)
            if is_lfs(name):  # weights: a redirect to the "CDN", another origin
                return Reply(
                    302,
                    headers={
                        "Location": f"http://localhost:{hub.port}{CDN_PREFIX}{tag}",
                        "X-Repo-Commit": commit,
                        "X-Linked-Etag": f'"{tag}"',
                        "X-Linked-Size": str(len(content)),
                    },
                )
            return Reply(
                200,
                content,
                {"X-Repo-Commit": commit, "ETag": f'"{tag}"', "Content-Length": str(len(content))},
            )

    return Handler


def tree(files: dict[str, bytes]) -> list[dict[str, Any]]:
    """The recursive listing: each folder, then each file (the Hub lists both)."""
    folders = sorted({name.rsplit("/", 1)[0] for name in files if "/" in name})
    listing = [{"type": "directory", "oid": git_blob_id(f.encode()), "path": f} for f in folders]
    return listing + [tree_entry(name, content) for name, content in sorted(files.items())]


def tree_entry(name: str, content: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "file",
        "oid": git_blob_id(content),
        "size": len(content),
        "path": name,
    }
    if is_lfs(name):
        entry["lfs"] = {"oid": etag(name, content), "size": len(content), "pointerSize": 134}
    return entry
