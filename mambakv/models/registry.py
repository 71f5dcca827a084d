"""Packaged model configs (``mambakv/models/configs/*.json``) and loading by name or path.

Each packaged file is a trimmed copy of the model's public ``config.json`` (only the fields the
cache needs) with a ``"_sources"`` key naming where every value comes from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mambakv.core.errors import ModelConfigError
from mambakv.models.hf import HybridModel, parse_config, read_config

__all__ = ["CONFIG_DIR", "list_models", "load_model", "packaged_config"]

#: Directory of the packaged ``<name>.json`` configs.
CONFIG_DIR = Path(__file__).with_name("configs")


def list_models() -> list[str]:
    """Names of the packaged models, sorted (e.g. ``"qwen3-next-80b-a3b"``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def packaged_config(name: str) -> dict[str, Any]:
    """The packaged json of ``name`` (with its ``_sources``), as a dict.

    Raises:
        ModelConfigError: `name` is not one of :func:`list_models` (a path such as
            ``"../x"`` is never looked up).
    """
    if not isinstance(name, str) or name.lower() not in list_models():
        raise ModelConfigError(f"unknown model {name!r}; known: {', '.join(list_models())}")
    cfg: dict[str, Any] = json.loads((CONFIG_DIR / f"{name.lower()}.json").read_text())  # each file is an object
    return cfg


def load_model(name_or_path: str | Path | HybridModel) -> HybridModel:
    """A packaged model by name (case-insensitive), or a ``config.json`` (or its directory).

    Raises:
        ModelConfigError: neither a packaged name nor an existing path (the message lists the
            known names), a path-looking argument (ending in ``.json`` or holding a path
            separator) that cannot be read, or a config that cannot be parsed.
    """
    if isinstance(name_or_path, HybridModel):
        return name_or_path
    key = str(name_or_path).lower()
    if key in list_models():
        return parse_config(packaged_config(key), key)
    path = Path(name_or_path)
    text = str(name_or_path)
    if path.exists() or key.endswith(".json") or any(sep and sep in text for sep in (os.sep, os.altsep, "/")):
        return read_config(path)  # "cannot read <path>: ..." when it is missing
    raise ModelConfigError(f"unknown model {str(name_or_path)!r}: not a packaged name nor a "
                           f"path; known: {', '.join(list_models())}")
