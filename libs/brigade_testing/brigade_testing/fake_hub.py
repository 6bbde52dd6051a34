"""A local HTTP endpoint that answers the Hugging Face Hub's upload calls and records what it was
sent: the one fake in the export tests, because the Hub cannot be reached from here. Point
huggingface_hub at it with HF_ENDPOINT. It implements only what `HfApi.create_repo` and
`upload_folder` call for small files (create, the model card's YAML check, preupload answering
"regular" so no LFS or Xet transfer is asked for, commit with the files inline), and `model_info`
for the ids in `models` (what `brigade up` asks before it starts); any other call is recorded and answered 404,
so a client that needs more fails loudly instead of passing by accident."""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Commit:
    repo: str
    revision: str
    message: str
    files: dict[str, bytes] = field(default_factory=dict)
    token: str = ""


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.commits: list[Commit] = []
        self.unknown: list[str] = []  # "METHOD path" of every call it does not implement
        self.models: set[str] = set()  # repository ids model_info finds (any revision)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    data = json.loads(body)
                    repo = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                    hub.repos[repo] = data
                    return self._json({"url": f"{hub.url}/{repo}", "name": repo, "id": repo})
                if parts[:2] == ["api", "validate-yaml"]:  # a README's model-card metadata, checked before the commit
                    return self._json({"warnings": []})
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in ("preupload", "commit"):
                    repo, revision = f"{parts[2]}/{parts[3]}", "/".join(parts[5:])
                    if parts[4] == "preupload":
                        files = json.loads(body)["files"]
                        return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                     for f in files]})
                    commit = Commit(repo, revision, "", token=token)
                    for line in body.decode().splitlines():
                        entry = json.loads(line)
                        if entry["key"] == "header":
                            commit.message = entry["value"].get("summary", "")
                        elif entry["key"] == "file":
                            commit.files[entry["value"]["path"]] = base64.b64decode(entry["value"]["content"])
                    hub.commits.append(commit)
                    return self._json({"commitUrl": f"{hub.url}/{repo}/commit/{'0' * 40}", "commitOid": "0" * 40,
                                       "pullRequestUrl": None})
                self._unknown()

            def do_GET(self) -> None:
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "models"] and "/".join(parts[2:4]) in hub.models:  # model_info
                    return self._json({"id": "/".join(parts[2:4]), "sha": "0" * 40, "siblings": []})
                self._unknown()

            def _unknown(self) -> None:
                hub.unknown.append(f"{self.command} {self.path}")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, data: dict) -> None:
                raw = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
