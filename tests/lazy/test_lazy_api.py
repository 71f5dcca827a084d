"""ALIGN_LAZY plumbing: mode names, spec validation, manager choice, bad input, the CLI flag,
the reserved region and reset_prefix_cache."""

from __future__ import annotations

import json

import pytest

from mambakv import (
    InvalidDraftCountError,
    InvalidSpecError,
    InvalidTokenCountError,
    LazyMambaManager,
    MambaCacheMode,
    MambaManager,
    Request,
)
from mambakv.cli import main
from mambakv.groups import manager_class_for
from tests.coord_helpers import coordinator, snapshot, tokens
from tests.helpers import mamba_spec


def test_mode_names_and_manager_choice():
    for name in ("align_lazy", "lazy", "LAZY", MambaCacheMode.ALIGN_LAZY):
        assert mamba_spec(64, 3, mode=name).mode is MambaCacheMode.ALIGN_LAZY
    assert manager_class_for(mamba_spec(64, 3, mode="lazy")) is LazyMambaManager
    assert manager_class_for(mamba_spec(64, 3, mode="align")) is MambaManager
    # a window of 2 x (3 + 1) = 8 tokens must fit in a block
    with pytest.raises(InvalidSpecError):
        mamba_spec(7, 3, mode="lazy")
    mamba_spec(8, 3, mode="lazy")


def test_region_reserved_and_reset():
    # 64 blocks, max_num_seqs 4, nspec 3: 12 reserved; free = 63 - 12 = 51
    coord = coordinator(64, mamba_spec(16, 3, mode="lazy"), max_num_seqs=4)
    pool = coord.block_pool
    assert pool.num_reserved_blocks == 12 and pool.get_num_free_blocks() == 51
    assert coord.reset_prefix_cache()  # reserved rows do not count as in use
    with pytest.raises(InvalidSpecError):  # the region does not fit
        coordinator(8, mamba_spec(16, 3, mode="lazy"), max_num_seqs=4)
    coord.check_invariants()


def test_bad_drafts_raise_and_change_nothing():
    coord = coordinator(64, mamba_spec(16, 3, mode="lazy"), max_num_seqs=1)
    req = Request("r", tokens(40))
    assert coord.allocate(req, 40) is not None
    req.num_computed_tokens = 40
    req.append_output_token_ids(5)
    coord.retire("r", 40)
    before = snapshot(coord, ["r"])
    with pytest.raises(InvalidDraftCountError):  # 4 drafts > nspec 3
        coord.allocate(req, 5, num_draft_tokens=4)
    with pytest.raises(InvalidDraftCountError):  # 2 real tokens with drafts
        coord.allocate(req, 4, num_draft_tokens=2)
    with pytest.raises(InvalidTokenCountError):  # no real token
        coord.allocate(req, 3, num_draft_tokens=3)
    assert snapshot(coord, ["r"]) == before
    # a second request with drafts finds the one-request region lent: None, nothing changed
    assert coord.allocate(req, 4, num_draft_tokens=3) is not None
    other = Request("o", tokens(20, 9000))
    assert coord.allocate(other, 20) is not None
    other.num_computed_tokens = 20
    other.append_output_token_ids(5)
    before = snapshot(coord, ["r", "o"])
    assert coord.allocate(other, 4, num_draft_tokens=3) is None
    assert snapshot(coord, ["r", "o"]) == before
    coord.check_invariants()


def test_cli_decode_checkpoints_and_the_mamba_policy_alias(capsys):
    chat = ["chat", "--conversations", "3", "--turns", "2", "--num-speculative-tokens", "3", "--in-flight", "1",
            "--max-num-seqs", "4", "--json", "--quiet"]
    for flags, policy in ((["--mamba-policy", "eager"], "every"), (["--mamba-policy", "lazy"], "latest"),
                          (["--mamba-policy", "lazy-evict"], "latest-evict"), (["--decode-checkpoints", "none"], "none"),
                          (["--decode-checkpoints", "latest", "--mamba-policy", "lazy"], "latest"), ([], "every")):
        assert main(chat + flags) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["mamba_policy"] == policy and d["blocks_returned"] and d["finished"] == 6
    with pytest.raises(SystemExit, match="means --decode-checkpoints every"):
        main(chat + ["--decode-checkpoints", "latest", "--mamba-policy", "eager"])
    assert main(["chat", "--mamba-policy", "bogus"]) == 2  # argparse refuses an unknown policy (one line)
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert main(["chat", "--decode-checkpoints", "some"]) == 2
    assert "invalid choice: 'some'" in capsys.readouterr().err
