"""The runnable example of docs/engine-integration.md, executed as written so the page cannot
rot: the first ```python block is extracted and run; its own asserts check the outcome
(request b hits 192 tokens of a's prompt, every block given back)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine-integration.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_engine_integration_example_runs(capsys):
    pytest.importorskip("torch")
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) == 1, "the page should hold exactly one runnable python block"
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    assert namespace["hits"] == {"a": 0, "b": 192}
    kv = namespace["kv"]
    assert kv.num_running_requests == 0 and kv.block_pool.get_num_free_blocks() == 63
    assert "hits:" in capsys.readouterr().out


def test_doc_states_the_prefill_stop_rule():
    text = DOC.read_text()
    for phrase in ("(P - 1) // B * B", "take_copy_plan", "take_zero_plan", "accept_drafts", "retire",
                   "preempt_all", "reset_prefix_cache", "get_computed_blocks"):
        assert phrase in text, phrase
