"""What either backend of `disagg up` settles once, before its first child starts: the model
directory (a short name converted here, once), the cluster token, the API key's environment
for the children, and the log directory. Starts nothing.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

from disagg.cluster.config import ClusterConfig
from disagg.config import API_KEY_ENV, env_cluster_token, resolve_api_key

__all__ = ["api_key_env", "cluster_token", "make_log_dir", "resolve_model_dir"]


def cluster_token() -> str:
    """The operator's cluster secret ($DISAGG_CLUSTER_TOKEN), else a fresh one for this cluster."""
    return env_cluster_token() or secrets.token_urlsafe(32)


def api_key_env(config: ClusterConfig) -> dict[str, str]:
    """{$DISAGG_API_KEY: the key} for the children when the key is in a file (they inherit it
    from our own environment otherwise). RuntimeError if the file cannot be read."""
    if config.api_key_file is None:
        return {}
    try:
        return {API_KEY_ENV: resolve_api_key("", config.api_key_file)}
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc


def resolve_model_dir(model: str) -> Path:
    """Convert a short name once, here, so that N instances don't all race to convert it."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()  # a ready directory: no need to import torch in the launcher
    from disagg.engine.checkpoint import resolve_model

    try:
        return resolve_model(model).resolve()
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot resolve model {model!r}: {exc}") from exc


def make_log_dir(log_dir: Path | None) -> Path:
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix="disagg-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir
