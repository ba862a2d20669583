"""A loopback HTTP server that answers the Hugging Face hub requests the kit makes.

It serves one small repository the test builds (a config, a tokenizer, an
LFS-style weights file) at one commit, honours Range requests, and can cut a
download short once to exercise resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = "kit-test/tiny-hybrid"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_FILES = {"model.safetensors"}


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeHub:
    files: dict[str, bytes]
    cut_once: set[str] = field(default_factory=set)
    range_requests: list[str] = field(default_factory=list)

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path in LFS_FILES else git_blob_sha1(data)

    def info(self) -> dict:
        siblings = []
        for path, data in sorted(self.files.items()):
            item = {"rfilename": path, "size": len(data), "blobId": git_blob_sha1(data)}
            if path in LFS_FILES:
                item["lfs"] = {"sha256": self.etag(path), "size": len(data), "pointerSize": 134}
            siblings.append(item)
        return {
            "id": REPO,
            "modelId": REPO,
            "sha": COMMIT,
            "siblings": siblings,
            "private": False,
            "disabled": False,
            "gated": False,
            "tags": [],
        }


def make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _not_found(self, code: str) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            body = json.dumps({"error": code}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _route(self) -> None:
            path = self.path.split("?", 1)[0]
            api = re.fullmatch(rf"/api/models/{REPO}(?:/revision/([^/]+))?", path)
            if api:
                if (api.group(1) or "main") not in ("main", COMMIT):
                    return self._not_found("RevisionNotFound")
                body = json.dumps(hub.info()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            resolve = re.fullmatch(rf"/{REPO}/resolve/([^/]+)/(.+)", path)
            if not resolve:
                return self._not_found("RepoNotFound")
            revision, name = resolve.groups()
            if revision not in ("main", COMMIT):
                return self._not_found("RevisionNotFound")
            if name not in hub.files:
                return self._not_found("EntryNotFound")
            data = hub.files[name]
            start = 0
            wanted = self.headers.get("Range")
            if wanted and self.command == "GET":
                start = int(re.fullmatch(r"bytes=(\d+)-\d*", wanted).group(1))
                hub.range_requests.append(name)
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{hub.etag(name)}"')
            if name in LFS_FILES:
                self.send_header("X-Linked-Etag", f'"{hub.etag(name)}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return None
            body = data[start:]
            if name in hub.cut_once:
                hub.cut_once.discard(name)
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return None
            self.wfile.write(body)
            return None

        do_GET = _route
        do_HEAD = _route

    return Handler


class HubServer:
    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def tiny_repo_files() -> dict[str, bytes]:
    return {
        "config.json": json.dumps({"model_type": "qwen3_next", "hidden_size": 64}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE"}}).encode(),
        # Over two of huggingface_hub's 10 MiB download chunks, so a cut mid-file
        # leaves a written chunk to resume from.
        "model.safetensors": os.urandom(21 * 1024 * 1024),
    }
