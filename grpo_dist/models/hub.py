"""Models and datasets named by their Hugging Face hub id, resolved once to a local snapshot of one commit: found in
the Hugging Face cache (HF_HOME; on a cluster, one every node mounts), or downloaded there unless offline
(HF_HUB_OFFLINE=1), with HF_TOKEN for gated and private repositories. Every failure is one line naming the config key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from grpo_dist.config import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""`org/name`: a repository on the Hugging Face hub (a path that exists is always read as a path)."""
NOT_LOADED = ["*.pth", "original/*", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "*.tflite"]
"""Files of a hub model that neither transformers nor vLLM reads here: not downloaded."""
CONFIG_FILES = ["config.json"]
"""What sizing a model reads (`grpo-dist plan`)."""
TOKENIZER_FILES = CONFIG_FILES + [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "*.model",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
]
"""What checking a config against a model reads (`grpo-dist check`): its config, its tokenizer and (of a
vision-language model) its processor, not its weights."""


def snapshot(
    repo_id: str, revision: str | None, key: str, kind: str = "model", files: list[str] | None = None, say: bool = True
) -> str:
    """The local snapshot of `repo_id` (a `kind`: model or dataset) at `revision` (a branch, tag or commit; main when
    None); only the files matching the patterns `files` when given (`CONFIG_FILES`, `TOKENIZER_FILES`). Its path
    names the commit, so every process that reads it reads the same files. `say`: print where it is."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    named = f"{repo_id}@{revision or 'main'}"
    try:
        path = snapshot_download(
            repo_id, repo_type=kind, revision=revision, allow_patterns=files, ignore_patterns=NOT_LOADED
        )
    except GatedRepoError:
        raise ConfigError(f"{key}: {named} is gated: accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {repo_id} is neither a local path nor a {kind} on the hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{key}: {repo_id} has no revision {revision!r}") from None
    except IncompleteSnapshotError:
        raise ConfigError(
            f"{key}: the Hugging Face cache ({constants.HF_HUB_CACHE}) holds only part of {named} (what "
            "`grpo-dist plan` or `check` fetched: its config and tokenizer) and the hub cannot be reached "
            f"(HF_HUB_OFFLINE=1, or no network): download it where the hub can be reached (`hf download {repo_id}`)"
        ) from None
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{key}: {named} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub cannot be "
            "reached (HF_HUB_OFFLINE=1, or no network): download it where the hub can be reached "
            f"(`hf download {repo_id}{' --repo-type dataset' if kind == 'dataset' else ''}"
            f"{''.join(f' --include {pattern!r}' for pattern in files or [])}`) into an HF_HOME every "
            "node shares, or name a local path"
        ) from None
    if say:
        print(f"{key}: {named} is {path}")
    return path


def model_directory(location: str, revision: str | None, key: str, files: list[str] | None = None) -> str:
    """The directory of a model named by config key `key`: a local one, or a hub id's snapshot at `revision` (only
    `files` when given, as `snapshot` takes them); `ValueError` naming the key when it is neither."""
    if Path(location).is_dir():
        return str(Path(location).resolve())
    if HUB_ID.fullmatch(location):
        return snapshot(location, revision, key, files=files)
    raise ValueError(f"{key}: {location} is neither a model directory nor a hub id")


def max_positions(directory: str | Path) -> int | None:
    """The positions a model directory's `config.json` gives (`max_position_embeddings`); None when it gives none."""
    return json.loads((Path(directory) / "config.json").read_text()).get("max_position_embeddings")
