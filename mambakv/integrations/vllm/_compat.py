"""The vLLM version this integration is written for, checked when it is imported.

vLLM's scheduler-side internals (the names its ``Scheduler`` calls on ``kv_cache_manager``,
``KVCacheBlocks``, the request fields) change between minor releases, so another minor version
is refused at import with one line, before any other vLLM module is imported.
"""

from __future__ import annotations

import vllm

from mambakv.core.errors import UnsupportedEngineError

__all__ = ["SUPPORTED_VLLM", "VLLM_VERSION", "check_vllm_version"]

#: the vLLM minor version this integration drives (any patch release of it)
SUPPORTED_VLLM = "0.33"


def check_vllm_version(version: str) -> str:
    """Return `version` when it is a 0.33.x release.

    Raises:
        UnsupportedEngineError: another version (one line naming both).
    """
    if version.split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise UnsupportedEngineError(
            f"mambakv.integrations.vllm supports vLLM {SUPPORTED_VLLM}.x, found vLLM {version}: "
            f"install vllm=={SUPPORTED_VLLM}.0 (pip install 'mambakv[vllm]')")
    return version


#: the installed vLLM's version (checked: importing this module on another one raises)
VLLM_VERSION = check_vllm_version(str(vllm.__version__))
