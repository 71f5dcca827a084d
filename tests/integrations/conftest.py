"""vLLM's logging quiet for the integration tests (read when vLLM is first imported)."""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
