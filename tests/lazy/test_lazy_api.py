"""Decode-checkpoint plumbing: the 0.x lazy mode names, no reserved region, bad drafts, the
CLI flag --decode-checkpoints and the --mamba-policy alias."""

from __future__ import annotations

import json

import pytest

from mambakv import (
    DecodeCheckpoints,
    InvalidDraftCountError,
    InvalidTokenCountError,
    MambaCacheMode,
    MambaManager,
    Request,
)
from mambakv.cli import main
from mambakv.groups import manager_class_for
from tests.coord_helpers import coordinator, snapshot, tokens
from tests.helpers import mamba_spec


def test_lazy_mode_names_are_latest():
    """The 0.x ALIGN_LAZY mode is gone: its names build align mode with latest decode checkpoints."""
    for name in ("align_lazy", "lazy", "LAZY"):
        spec = mamba_spec(64, 3, mode=name)
        assert spec.mode is MambaCacheMode.ALIGN and spec.decode_checkpoints is DecodeCheckpoints.LATEST
    assert manager_class_for(mamba_spec(64, 3, mode="lazy")) is MambaManager
    assert MambaCacheMode("align_lazy") is MambaCacheMode.ALIGN
    assert not hasattr(MambaCacheMode, "ALIGN_LAZY")


def test_nothing_reserved():
    coord = coordinator(64, mamba_spec(16, 3, decode_checkpoints="latest"), max_num_seqs=4)
    assert coord.block_pool.num_reserved_blocks == 0 and coord.block_pool.get_num_free_blocks() == 63
    assert coord.reset_prefix_cache()
    coord.check_invariants()


def test_bad_drafts_raise_and_change_nothing():
    coord = coordinator(64, mamba_spec(16, 3, decode_checkpoints="latest"))
    req = Request("r", tokens(40))
    assert coord.allocate(req, 40) is not None
    req.num_computed_tokens = 40
    req.append_output_token_ids(5)
    coord.retire("r", 40)
    before = snapshot(coord, ["r"])
    with pytest.raises(InvalidDraftCountError):  # 4 drafts > nspec 3
        coord.allocate(req, 5, num_draft_tokens=4)
    with pytest.raises(InvalidTokenCountError):  # no real token
        coord.allocate(req, 3, num_draft_tokens=3)
    assert snapshot(coord, ["r"]) == before
    coord.check_invariants()


def test_cli_decode_checkpoints_and_the_mamba_policy_alias(capsys):
    chat = ["chat", "--conversations", "3", "--turns", "2", "--num-speculative-tokens", "3", "--in-flight", "1",
            "--max-num-seqs", "4", "--json", "--quiet"]
    for flags, policy in ((["--mamba-policy", "eager"], "every"), (["--mamba-policy", "lazy"], "latest"),
                          (["--mamba-policy", "lazy-evict"], "latest-evict"), (["--decode-checkpoints", "none"], "none"),
                          (["--decode-checkpoints", "latest", "--mamba-policy", "lazy"], "latest"), ([], "none"),
                          (["--layout", "unified"], "every")):
        assert main(chat + flags) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["mamba_policy"] == policy and d["blocks_returned"] and d["finished"] == 6
    with pytest.raises(SystemExit, match="means --decode-checkpoints every"):
        main(chat + ["--decode-checkpoints", "latest", "--mamba-policy", "eager"])
    assert main(["chat", "--mamba-policy", "bogus"]) == 2  # argparse refuses an unknown policy (one line)
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert main(["chat", "--decode-checkpoints", "some"]) == 2
    assert "invalid choice: 'some'" in capsys.readouterr().err
