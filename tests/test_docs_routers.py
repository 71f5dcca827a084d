"""The example of docs/routers.md runs as written (needs the events extra)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "routers.md"


def test_routers_example_runs(capsys):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    (block,) = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    namespace: dict = {"__name__": "docs_routers"}
    exec(compile(block, str(DOC), "exec"), namespace)
    pub = namespace["pub"]
    # attention blocks 0 and 1 (tokens 0..31) up to the state at 32, in one batch
    assert (pub.announcer.num_announced, pub.num_sent, pub.num_dropped) == (2, 1, 0)
    assert "router view: 2 blocks; batches sent: 1" in capsys.readouterr().out


def test_routers_page_names_what_to_configure():
    text = DOC.read_text()
    for phrase in ("enable_kv_cache_events=True", "replay_endpoint", "kv@<pod-ip>@<model-name>",
                   "compute_block_hash_for_seq", "apply_event", "checkpoint", "group_idx", "external_hash"):
        assert phrase in text, phrase
