"""Hugging Face hub ids (``org/name``) wherever a model path is accepted.

``huggingface_hub`` does the work the way every hub user knows it: its cache (``HF_HOME``,
``HF_HUB_CACHE``), ``HF_TOKEN`` for gated models, ``HF_HUB_OFFLINE=1`` to use the cache only,
its progress bars. Only the files a model needs are fetched: the config, the tokenizer, the
chat template and the safetensors weights (with their index), never other formats' weights.

The process that reads the configuration resolves the id once, to the snapshot folder of one
commit; the workers get that folder, so every rank reads the same files.
"""

from __future__ import annotations

import os
import re

NEEDED_FILES = [
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "chat_template.jinja", "chat_template.json",
    "*.safetensors", "*.safetensors.index.json",
]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not a path on this machine."""
    return bool(_REPO_ID.match(model)) and not os.path.exists(os.path.expanduser(model))


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE", "")
    return value.upper() in ("1", "ON", "YES", "TRUE")


def snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local folder of ``repo_id`` at ``revision`` (default: its main branch), downloaded
    into the hub cache unless it is there already. ValueError naming the id when it cannot be
    had: offline and not cached, not on the hub, gated without a token."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=NEEDED_FILES,
                                 local_files_only=offline())
    except GatedRepoError as e:
        raise ValueError(f"model {repo_id!r} is gated: accept its terms on the hub and set HF_TOKEN") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"model {repo_id!r} is not on the Hugging Face hub (or is private: set HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached"
        raise ValueError(f"model {repo_id!r}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         f"and {why}: download it on a machine with access (`hf download {repo_id}`) "
                         "or give a local folder") from e


def repo_id_of(path: str) -> str | None:
    """``org/name`` of a hub cache snapshot folder (``…/models--org--name/snapshots/<commit>``),
    else None: the name a server reports for a model given by its id."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return None
