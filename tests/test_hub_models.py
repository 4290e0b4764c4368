"""A model named by its hub id (`model.path: org/name`, `model.revision`), resolved once to a snapshot in the Hugging
Face cache. No network here: each test fills a cache of its own the way the hub client does (blobs named by their
hash, a snapshot per commit of links to them, refs naming commits) and resolves from it with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TESTS_DIR, Ran, cli_batch, small_config

from grpo_dist.models import build_tiny_model

MAIN, V1 = "a" * 40, "b" * 40  # two commits of the repository: main and the tag v1


def cache_model(hf_home: Path, repo_id: str, model_dir: Path, commit: str, refs: list[str]) -> Path:
    """Put the files of `model_dir` into the hub cache under `hf_home` as commit `commit` of `repo_id`, named by
    `refs` (branches, tags); returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(model_dir.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """An HF_HOME holding `acme/tiny` at two commits: main (seed 0) and v1 (seed 1)."""
    root = tmp_path_factory.mktemp("hub")
    hf_home = root / "hf"
    for commit, refs, seed in [(MAIN, ["main"], 0), (V1, ["v1"], 1)]:
        model = build_tiny_model(root / f"model-{seed}", seed=seed, hidden_size=128, num_heads=2, num_layers=1,
                                 intermediate_size=256, characters="0123456789 :")  # fmt: skip
        cache_model(hf_home, "acme/tiny", model, commit, refs)
    return hf_home


REVISIONS = [(None, MAIN), ("v1", V1), (MAIN, MAIN)]
MISSING = [("acme/tiny", "v2"), ("acme/nothing", None), ("local", "v1")]  # "local": a directory, not a hub id


@pytest.fixture(scope="module")
def checked(hub_cache, tmp_path_factory) -> dict[tuple[str, str | None], Ran]:
    """`grpo-dist check` of the test config with each (model.path, model.revision) of `REVISIONS` and `MISSING` as
    its model, offline against `hub_cache`: what each gave, all run in one process of their own (the hub's settings
    are read at import), not one each."""
    root = tmp_path_factory.mktemp("checked")
    models = [("acme/tiny", revision) for revision, _ in REVISIONS] + MISSING
    argvs = []
    for index, (path, revision) in enumerate(models):
        raw = small_config(root / str(index))
        raw["model"] = {"path": str(root) if path == "local" else path, "revision": revision}
        (root / f"{index}.yaml").write_text(yaml.safe_dump(raw))
        argvs.append(["check", str(root / f"{index}.yaml")])
    env = {"HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache / "hub")}
    return dict(zip(models, cli_batch(argvs, env=env), strict=True))


@pytest.mark.parametrize(("revision", "commit"), REVISIONS, ids=["main", "tag", "commit"])
def test_a_hub_id_resolves_to_the_snapshot_of_its_revision(checked, hub_cache, revision, commit):
    result = checked["acme/tiny", revision]
    assert result.returncode == 0, result.stderr
    snapshot = hub_cache / "hub" / "models--acme--tiny" / "snapshots" / commit
    assert f"model.path: acme/tiny@{revision or 'main'} is {snapshot}" in result.stdout


def test_what_the_cache_lacks_offline_is_one_clear_line(checked):
    missing_revision = checked["acme/tiny", "v2"]
    assert missing_revision.returncode == 2
    assert "model.path: acme/tiny@v2 is not in the Hugging Face cache" in missing_revision.stderr
    assert "HF_HUB_OFFLINE=1" in missing_revision.stderr
    missing_model = checked["acme/nothing", None]
    assert missing_model.returncode == 2 and "model.path: acme/nothing@main is not in the" in missing_model.stderr
    local = checked["local", "v1"]
    assert local.returncode == 2 and "model.revision applies to a hub id" in local.stderr
    assert "Traceback" not in missing_revision.stderr + missing_model.stderr + local.stderr


def test_the_policy_loaded_is_the_revision_asked_for(hub_cache, monkeypatch):
    """main and v1 hold different weights: the snapshot a revision resolves to is the model of that commit."""
    import torch
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HOME", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = (
        "import sys\nfrom grpo_dist.models.hub import snapshot\n"
        "for revision in sys.argv[1:]: print('=', snapshot('acme/tiny', revision, 'model.path'))"
    )
    done = subprocess.run([sys.executable, "-c", code, "main", "v1"], capture_output=True, text=True, check=True)
    found = [Path(line[2:]) for line in done.stdout.splitlines() if line.startswith("= ")]
    paths = dict(zip(("main", "v1"), found, strict=True))
    main, v1 = (load_file(paths[name] / "model.safetensors") for name in ("main", "v1"))
    assert main.keys() == v1.keys()
    assert any(not torch.equal(main[key], v1[key]) for key in main)


class Hub:
    """A hub server on this machine serving `acme/tiny` at one commit (the repository API, the file tree and file
    downloads the hub client uses), recording which files were downloaded."""

    def __init__(self, model_dir: Path) -> None:
        import hashlib
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        files = {file.name: file.read_bytes() for file in sorted(model_dir.iterdir())}
        self.downloaded: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, body: bytes, headers: dict[str, str], status: int = 200) -> None:
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path.startswith("/api/models/acme/tiny/revision/"):
                    info = {"id": "acme/tiny", "sha": MAIN, "siblings": [{"rfilename": name} for name in files]}
                    return self._send(json.dumps(info).encode(), {"Content-Type": "application/json"})
                if path.startswith("/api/models/acme/tiny/tree/"):
                    tree = [
                        {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in files.items()
                    ]
                    return self._send(json.dumps(tree).encode(), {"Content-Type": "application/json"})
                prefix = f"/acme/tiny/resolve/{MAIN}/"
                if path.startswith(prefix) and path[len(prefix) :] in files:
                    name = path[len(prefix) :]
                    if self.command == "GET":
                        hub.downloaded.append(name)
                    etag = f'"{hashlib.sha1(files[name]).hexdigest()}"'
                    return self._send(files[name], {"X-Repo-Commit": MAIN, "ETag": etag})
                self._send(b"{}", {"Content-Type": "application/json", "X-Error-Code": "EntryNotFound"}, 404)

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.parametrize(
    ("command", "fetched"),
    [
        ("plan", {"config.json"}),
        ("check", {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}),
    ],
)
def test_sizing_or_checking_a_hub_model_downloads_its_config_not_its_weights(tmp_path, command, fetched):
    """`plan` reads a hub model's config.json and `check` its tokenizer too: neither downloads the weights (65 GB for
    a 32B model). A run then finds the snapshot without its weights in the cache and names what to do."""
    model = build_tiny_model(tmp_path / "served", hidden_size=128, num_heads=2, num_layers=1, intermediate_size=256,
                             characters="0123456789 :")  # fmt: skip
    assert (model / "model.safetensors").is_file()
    hub = Hub(model)
    try:
        raw = small_config(tmp_path)
        raw["model"] = {"path": "acme/tiny"}
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(raw))
        env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint, "PYTHONPATH": str(TESTS_DIR)}
        for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
            env.pop(name, None)
        run = subprocess.run([sys.executable, "-m", "grpo_dist", command, str(config)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert set(hub.downloaded) == fetched & {path.name for path in model.iterdir()}, hub.downloaded
        assert "model.safetensors" not in hub.downloaded
    finally:
        hub.server.shutdown()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS_DIR)}
    env.pop("HF_HUB_CACHE", None)

    def train_offline() -> str:
        """The refusal, which comes before the driver imports torch (`-X importtime` lists what was imported)."""
        run = subprocess.run([sys.executable, "-X", "importtime", "-m", "grpo_dist", "train", str(config)], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        lines = run.stderr.splitlines()
        imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time")}
        told = "\n".join(line for line in lines if not line.startswith("import time"))
        assert run.returncode == 2 and "Traceback" not in told, told
        assert "huggingface_hub" in imported and "torch" not in imported
        return told

    assert "the Hugging Face cache" in (told := train_offline()) and "holds only part of acme/tiny@main" in told, told
    # A cache filled by another client keeps no file list: the snapshot is returned as it is, and found weightless.
    shutil.rmtree(tmp_path / "hf" / "hub" / "models--acme--tiny" / "trees")
    assert "model.path: acme/tiny@main in the Hugging Face cache holds no weights" in (told := train_offline()), told
    assert not (tmp_path / "outputs" / "test").exists()  # the run directory is not left behind
