"""A stand-in for the Hugging Face Hub on 127.0.0.1: the endpoints huggingface_hub calls to list a
model repository (/api/models/USER/REPO) and to fetch its files (/USER/REPO/resolve/REV/PATH, HEAD
and GET with Range), with the headers it reads (X-Repo-Commit, ETag, Content-Length, X-Error-Code).
Tests point HF_ENDPOINT at it and add repositories, and may make a file arrive cut short once or
corrupted, or a repository gated."""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from runner.fetch.registry import sha256_of


@dataclass
class Repo:
    files: dict[str, Path]          # path in the repository -> the local file served for it
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    sha256: dict[str, str] = field(default_factory=dict)


@dataclass
class Quirks:
    cut_once: set[str] = field(default_factory=set)   # "repo/path": the first GET sends half, then drops
    corrupt: set[str] = field(default_factory=set)    # "repo/path": a byte differs from what the listing says


class StandInHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.quirks = Quirks()
        self.requests: list[tuple[str, str, str | None]] = []   # (method, path, Range header)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, files: dict[str, Path], **kw) -> Repo:
        repo = Repo(dict(files), **kw)
        repo.sha256 = {p: sha256_of(f) for p, f in repo.files.items()}
        self.repos[repo_id] = repo
        return repo

    def file_gets(self, repo_id: str, path: str) -> list[str | None]:
        """The Range headers of the GETs of a file so far (None: from the start)."""
        return [r for m, p, r in self.requests
                if m == "GET" and re.fullmatch(rf"/{re.escape(repo_id)}/resolve/[^/]+/{re.escape(path)}", p)]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._serve(head=False)

            def do_HEAD(self):
                self._serve(head=True)

            def _serve(self, head: bool):
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("Range")))
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
                if m:
                    return self._listing(m[1], head)
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    return self._file(m[1], m[3], head)
                self._error(404, "EntryNotFound", "not found")

            def _repo(self, repo_id: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                elif repo.gated and not self.headers.get("Authorization"):
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
                    return None
                return repo

            def _listing(self, repo_id: str, head: bool):
                repo = self._repo(repo_id)
                if repo is None:
                    return
                siblings = [{"rfilename": p, "size": f.stat().st_size,
                             "lfs": {"size": f.stat().st_size, "sha256": repo.sha256[p], "pointerSize": 134}}
                            for p, f in repo.files.items()]
                self._send(200, json.dumps({"id": repo_id, "sha": repo.commit, "siblings": siblings}).encode(),
                           {"Content-Type": "application/json"}, head)

            def _file(self, repo_id: str, name: str, head: bool):
                repo = self._repo(repo_id)
                if repo is None:
                    return
                if name not in repo.files:
                    return self._error(404, "EntryNotFound", f"{name} not found")
                data = repo.files[name].read_bytes()
                key = f"{repo_id}/{name}"
                if key in hub.quirks.corrupt:
                    data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
                headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.sha256[name]}"',
                           "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                start = 0
                rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if rng and not head:
                    start = int(rng[1])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                if head:
                    return self._send(200, data, headers, head=True)
                if key in hub.quirks.cut_once:
                    hub.quirks.cut_once.discard(key)
                    headers["Content-Length"] = str(len(data) - start)
                    self.send_response(206 if start else 200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data[start:start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._send(206 if start else 200, data[start:], headers, head=False)

            def _send(self, status: int, body: bytes, headers: dict, head: bool):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, message: str):
                self._send(status, json.dumps({"error": message}).encode(),
                           {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
                           self.command == "HEAD")

        return Handler

