"""Engine integrations: mambakv as the block manager inside an engine's own scheduler.

Optional and never imported by the library itself: each subpackage imports its engine and is
imported only by the engine (``mambakv.integrations.vllm``: vLLM 0.33's ``--scheduler-cls``).
"""
