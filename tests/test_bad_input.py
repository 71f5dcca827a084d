"""Bad input gets one line: a typed MambaKVError from the library, exit status 2 from the CLI.

Sections:
1. model configs (``parse_config`` / ``read_config`` / ``load_model``): ModelConfigError.
2. the ``mambakv`` command: ``mambakv: error: ...`` on stderr, exit 2, no traceback.
3. coordinator and block pool: left for the core restructuring (see the end of the file).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mambakv.cli import main
from mambakv.core.errors import MambaKVError, ModelConfigError
from mambakv.models import load_model, parse_config, read_config
from mambakv.models.registry import packaged_config

ROOT = Path(__file__).resolve().parents[1]


def packaged(name: str, **changes) -> dict:
    """The packaged config of `name` with top-level `changes` (None deletes a key)."""
    cfg = copy.deepcopy(packaged_config(name))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# --------------------------------------------------------------------------- 1. model configs
GRANITE_TYPES = packaged_config("granite-4.0-h-small")["layer_types"]


def _mamba2_ssm(**ssm) -> dict:
    cfg = packaged("mamba2-2.7b")
    cfg["ssm_cfg"].update(ssm)
    return cfg


@pytest.mark.parametrize("cfg, key", [
    # issue 18: a 4-letter pattern for 52 layers ran as a 3-layer model
    (packaged("nemotron-h-8b", hybrid_override_pattern="M-M*"), "hybrid_override_pattern has 4 layers, "
                                                                  "num_hidden_layers is 52"),
    (packaged("nemotron-h-8b", hybrid_override_pattern="M-M*" * 13 + "M"), "has 53 layers"),
    (packaged("nemotron-h-8b", hybrid_override_pattern="MXM*" * 13), "hybrid_override_pattern[1] is 'X'"),
    (packaged("nemotron-h-8b", hybrid_override_pattern=["M"] * 52), "hybrid_override_pattern must be a string"),
    (packaged("granite-4.0-h-small", layer_types=GRANITE_TYPES[:10]), "layer_types has 10 layers, "
                                                                       "num_hidden_layers is 40"),
    (packaged("granite-4.0-h-small", layer_types=GRANITE_TYPES[:39] + ["moe"]), "layer_types[39] is 'moe'"),
    (packaged("granite-4.0-h-small", layer_types=GRANITE_TYPES[:39] + [1]), "layer_types[39] is 1"),
    (packaged("granite-4.0-h-small", layer_types="mamba"), "layer_types must be a list, got 'mamba'"),
    (packaged("granite-4.0-h-small", layer_types={"a": 1}), "layer_types must be a list"),
    (packaged("qwen3-next-80b-a3b", layer_types=["full_attention"] * 47 + ["gdn"]), "layer_types[47] is 'gdn'"),
    (packaged("jamba-v0.1", layers_block_type=["mamba"] * 31), "layers_block_type has 31 layers"),
    # numbers: a JSON int of the right sign, never a string, float or bool
    (packaged("qwen3-next-80b-a3b", num_hidden_layers="48"), "num_hidden_layers must be an integer, got '48'"),
    (packaged("qwen3-next-80b-a3b", num_hidden_layers=48.0), "num_hidden_layers must be an integer, got 48.0"),
    (packaged("qwen3-next-80b-a3b", num_hidden_layers=True), "num_hidden_layers must be an integer, got True"),
    (packaged("qwen3-next-80b-a3b", num_hidden_layers=-4), "num_hidden_layers must be >= 1, got -4"),
    (packaged("qwen3-next-80b-a3b", num_hidden_layers=0), "num_hidden_layers must be >= 1, got 0"),
    # a typo of 4.8 billion layers used to build per-layer tuples without end
    (packaged("qwen3-next-80b-a3b", num_hidden_layers=4_800_000_000), "num_hidden_layers must be <= 10,000"),
    (packaged("mamba2-2.7b", n_layer=10_001), "n_layer must be <= 10,000, got 10,001"),
    (packaged("granite-4.0-h-small", layer_types=None), "config.json lacks layer_types / layers_block_type"),
    (packaged("qwen3-next-80b-a3b", num_hidden_layers=1e400), "num_hidden_layers must be an integer, got inf"),
    (packaged("qwen3-next-80b-a3b", head_dim=0), "head_dim must be >= 1, got 0"),
    (packaged("qwen3-next-80b-a3b", linear_conv_kernel_dim=1), "linear_conv_kernel_dim must be >= 2, got 1"),
    (packaged("nemotron-h-8b", num_hidden_layers=52.0), "num_hidden_layers must be an integer"),
    (packaged("nemotron-h-8b", mamba_num_heads=-128), "mamba_num_heads must be >= 1"),
    (packaged("falcon-h1-7b", mamba_d_ssm=3000), "mamba_d_ssm 3000 != mamba_n_heads x mamba_d_head = 3072"),
    (packaged("falcon-h1-7b", mamba_d_ssm="3072"), "mamba_d_ssm must be an integer"),
    # issue 18: these raised ZeroDivisionError
    (packaged("qwen3-next-80b-a3b", full_attention_interval=0), "full_attention_interval must be >= 1, got 0"),
    (packaged("qwen3-next-80b-a3b", num_key_value_heads=0), "num_key_value_heads must be >= 1, got 0"),
    (packaged("granite-4.0-h-small", num_attention_heads=0), "num_attention_heads must be >= 1, got 0"),
    (packaged("jamba-v0.1", attn_layer_period=0), "attn_layer_period must be >= 1, got 0"),
    (packaged("jamba-v0.1", attn_layer_offset=8), "attn_layer_offset 8 must be < attn_layer_period 8"),
    (packaged("jamba-v0.1", attn_layer_offset=-1), "attn_layer_offset must be >= 0, got -1"),
    (_mamba2_ssm(headdim=0), "ssm_cfg.headdim must be >= 1, got 0"),
    (_mamba2_ssm(headdim=48), "expand x d_model = 5120 is not a multiple of ssm_cfg.headdim 48"),
    (_mamba2_ssm(layer="Mamba3"), "ssm_cfg.layer is 'Mamba3'"),
    (_mamba2_ssm(d_conv=1), "ssm_cfg.d_conv must be >= 2, got 1"),
    (packaged("mamba2-2.7b", ssm_cfg=[1]), "ssm_cfg must be an object"),
    (packaged("mamba2-2.7b", attn_layer_idx=[64]), "attn_layer_idx must list distinct layer indices in 0 .. 63"),
    (packaged("mamba2-2.7b", attn_layer_idx=[3, 3]), "attn_layer_idx must list distinct"),
    (packaged("mamba2-2.7b", attn_layer_idx=[3], attn_cfg={"num_heads": 8}), "config.json lacks attn_cfg.head_dim"),
    # granite derives head_dim = hidden_size / heads: 4096 / 3 does not divide
    (packaged("granite-4.0-h-small", num_attention_heads=3), "hidden_size 4096 is not a multiple of"),
    (packaged("qwen3-next-80b-a3b", model_type=7), "model_type must be a string"),
    (packaged("qwen3-next-80b-a3b", model_type="llama"), "unsupported model_type 'llama'"),
    (packaged("qwen3-next-80b-a3b", torch_dtype="float13"), "config.json: "),
    (packaged("qwen3-next-80b-a3b", full_attention_interval=1), "not a hybrid model"),
    ([1, 2, 3], "config.json must be a JSON object, got list"),  # raised AttributeError
    ("qwen", "config.json must be a JSON object, got str"),
])
def test_bad_config_one_line_naming_the_key(cfg, key):
    with pytest.raises(ModelConfigError) as e:
        parse_config(cfg, "folder-name")
    msg = one_line(e)
    assert key in msg
    assert "folder-name" not in msg  # the folder is not the model's name: no prefix


def test_negative_layer_count_is_not_called_non_hybrid():
    with pytest.raises(ModelConfigError) as e:
        parse_config(packaged("jamba-v0.1", num_hidden_layers=-3))
    assert "not a hybrid" not in str(e.value) and "num_hidden_layers" in str(e.value)


@pytest.mark.parametrize("text, why", [
    ("[1, 2]", "must be a JSON object"), ("{", "cannot read"), ("", "cannot read"), ("null", "got NoneType"),
])
def test_read_config_bad_json(tmp_path, text, why):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(text)
    with pytest.raises(ModelConfigError) as e:
        read_config(d)
    assert why in one_line(e)
    with pytest.raises(ModelConfigError):
        load_model(str(d / "config.json"))


def test_read_config_unreadable_files(tmp_path):
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ModelConfigError, match="cannot read .*config.json"):
        read_config(tmp_path / "empty-dir")  # a folder without config.json
    bad = tmp_path / "binary" / "config.json"
    bad.parent.mkdir()
    bad.write_bytes(b"\xff\xfe{")
    with pytest.raises(ModelConfigError, match="cannot read"):
        read_config(bad)
    nan = tmp_path / "nan" / "config.json"  # Python's json reads NaN: still not a count
    nan.parent.mkdir()
    nan.write_text(json.dumps(packaged("jamba-v0.1")).replace('"num_hidden_layers": 32', '"num_hidden_layers": NaN'))
    with pytest.raises(ModelConfigError, match="num_hidden_layers must be an integer, got nan"):
        read_config(nan)


@pytest.mark.parametrize("name", ["../configs/jamba-v0.1", "nosuch", "", 7])
def test_packaged_config_only_takes_packaged_names(name):
    with pytest.raises(ModelConfigError, match="unknown model"):
        packaged_config(name)


# --------------------------------------------------------------------------- 2. the CLI
def write_config(tmp_path: Path, cfg) -> str:
    d = tmp_path / "some-folder"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d / "config.json")


def cli_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1, err
    assert err.startswith("mambakv: error: ") and "Traceback" not in err
    assert captured.out == ""
    return err


@pytest.mark.parametrize("cfg, why", [
    (packaged("nemotron-h-8b", hybrid_override_pattern="M-M*"), "hybrid_override_pattern has 4 layers"),
    (packaged("qwen3-next-80b-a3b", full_attention_interval=0), "full_attention_interval must be >= 1"),
    (packaged("qwen3-next-80b-a3b", num_key_value_heads=0), "num_key_value_heads must be >= 1"),
    (packaged("jamba-v0.1", attn_layer_period=0), "attn_layer_period must be >= 1"),
    (_mamba2_ssm(headdim=0), "ssm_cfg.headdim must be >= 1"),
    (packaged("qwen3-next-80b-a3b", num_hidden_layers="48"), "must be an integer"),
    ([1, 2], "must be a JSON object"),
])
def test_cli_bad_config_exit_2(tmp_path, capsys, cfg, why):
    path = write_config(tmp_path, cfg)
    assert main(["replay", "--config", path, "--prompt-tokens", "100"]) == 2
    err = cli_error(capsys)
    assert why in err and "some-folder:" not in err


def test_cli_bad_config_subprocess_no_traceback(tmp_path):
    path = write_config(tmp_path, packaged("jamba-v0.1", attn_layer_period=0))
    out = subprocess.run([sys.executable, "-m", "mambakv", "replay", "--config", path], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"mambakv: error: {path}: attn_layer_period must be >= 1, got 0\n"


def test_cli_config_errors_name_the_file(tmp_path, capsys):
    # "config.json lacks ..." was said of a file named otherwise: the message names the real file
    path = tmp_path / "nolayers.json"
    path.write_text(json.dumps(packaged("granite-4.0-h-small", layer_types=None)))
    assert main(["replay", "--config", str(path)]) == 2
    err = cli_error(capsys)
    assert err == f"mambakv: error: {path} lacks layer_types / layers_block_type\n"
    path.write_text(json.dumps(packaged("jamba-v0.1", attn_layer_period=0)))
    assert main(["trace", "unread.jsonl", "--config", str(path)]) == 2  # the config is read first
    assert cli_error(capsys) == f"mambakv: error: {path}: attn_layer_period must be >= 1, got 0\n"


def test_cli_config_with_a_utf8_bom_is_read(tmp_path, capsys):
    # an editor's "UTF-8 with BOM": json.loads refused it ("Unexpected UTF-8 BOM")
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(packaged("qwen3-next-80b-a3b")).encode())
    assert read_config(path).num_hidden_layers == 48
    assert main(["replay", "--config", str(path), "--prompt-tokens", "1000", "--output-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finished"] == 1


GOOD_ROW = {"timestamp": 50, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}


@pytest.mark.parametrize("command", ["trace", "fleet"])
@pytest.mark.parametrize("row, why", [
    (dict(GOOD_ROW, timestamp=1e13), "timestamp must be a finite number of ms in [0, 10^12], got 10000000000000.0"),
    (dict(GOOD_ROW, timestamp=-5), "timestamp must be a finite number of ms in [0, 10^12], got -5"),
    # an int beyond a float: math.isfinite raised OverflowError, a traceback
    (dict(GOOD_ROW, timestamp=10**400), "timestamp must be a finite number of ms in [0, 10^12], got 1000"),
    (dict(GOOD_ROW, timestamp=49), "timestamp 49 is before line 1's 50; a trace is in arrival order"),
    # 0 used to run as 1 output token
    (dict(GOOD_ROW, output_length=0), "output_length must be an int >= 1, got 0"),
    (dict(GOOD_ROW, output_length=-3), "output_length must be an int >= 1, got -3"),
])
def test_cli_bad_trace_line_exit_2_before_any_work(tmp_path, monkeypatch, capsys, command, row, why):
    import mambakv.sim as sim
    import mambakv.sim.fleet as sim_fleet

    monkeypatch.setattr(sim, "run_trace", lambda *a, **k: pytest.fail("ran a trace with a bad line"))
    monkeypatch.setattr(sim_fleet, "run_fleet", lambda *a, **k: pytest.fail("ran a trace with a bad line"))
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps(row) + "\n")
    assert main([command, str(path), "--quiet"]) == 2
    err = cli_error(capsys)
    assert err.startswith(f"mambakv: error: {path}: line 2: ") and why in err


def test_cli_trace_timestamps_may_repeat_and_are_compared_after_skip(tmp_path, capsys):
    # equal timestamps are in order; the lines before --skip are not read as requests
    path = tmp_path / "t.jsonl"
    rows = [dict(GOOD_ROW, timestamp=900), GOOD_ROW, dict(GOOD_ROW, hash_ids=[1, 3])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["trace", str(path), "--quiet", "--skip", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finished"] == 2
    assert main(["trace", str(path), "--quiet"]) == 2
    assert "line 2: timestamp 50 is before line 1's 900" in cli_error(capsys)


@pytest.mark.parametrize("argv, why", [
    (["replay", "--config", "{cfg}"], "config.json must be a JSON object, got list"),
    (["trace", "{tmp}/missing.jsonl"], "cannot read trace"),
    (["replay", "--plot", "{tmp}/x.txt"], "the file name must end in"),
    (["replay", "--plot", "{tmp}/no/such/x.png"], "does not exist"),
    (["replay", "--memory-gib", "8", "--layout", "unified"], "needs about 905 blocks"),
    (["replay", "--memory-gib", "8"], "needs about 855 superblocks"),
    (["replay", "--memory-gib", "nan"], "--memory-gib"),
    (["replay", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["models", "--bogus"], "unrecognized arguments"),
])
def test_cli_subprocess_one_line_exit_2(tmp_path, argv, why):
    cfg = write_config(tmp_path, [1, 2])
    argv = [a.format(cfg=cfg, tmp=tmp_path) for a in argv]
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, "-m", "mambakv", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("mambakv: error: ") and why in out.stderr


# --------------------------------------------------------------------------- 3. coordinator / pool
# Every public entry point of the core with bad input: a one-line MambaKVError subclass, raised
# before anything changed (the pool's invariants hold and its free count is as before).
from mambakv import (  # noqa: E402
    BlockPool,
    DoubleFreeError,
    FullAttentionSpec,
    HashBlockSizeMismatchError,
    InvalidBlockError,
    InvalidClockError,
    InvalidHashError,
    InvalidRequestError,
    InvalidSpecError,
    InvalidTokenCountError,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
    StaleCacheHitError,
    hash_block_tokens,
    init_none_hash,
)


def _coord() -> tuple[KVCacheCoordinator, Request]:
    """FA block 4 + Mamba block 4; request "r" (9 tokens) running with 8 computed."""
    cfg = KVCacheConfig(32, [KVCacheGroupSpec(["a"], FullAttentionSpec(4, 1, 8)),
                             KVCacheGroupSpec(["m"], MambaSpec(4, ((2, 4),), ("float32",), mode="align"))])
    coord = KVCacheCoordinator(cfg, max_model_len=64)
    req = Request("r", list(range(1, 10)))
    assert coord.allocate(req, 8)
    req.num_computed_tokens = 8
    return coord, req


def _unchanged(coord: KVCacheCoordinator, free: int, call, error: type[MambaKVError]) -> None:
    with pytest.raises(error) as info:
        call()
    assert "\n" not in str(info.value)
    coord.check_invariants()
    assert coord.block_pool.get_num_free_blocks() == free


@pytest.mark.parametrize(("what", "error"), [
    ("allocate a str", InvalidRequestError),
    ("allocate None", InvalidRequestError),
    ("hits not KVCacheBlocks", InvalidBlockError),
    ("tokens a str", InvalidTokenCountError),
    ("tokens a float", InvalidTokenCountError),
    ("negative lookahead", InvalidTokenCountError),
    ("lookahead a float", InvalidTokenCountError),
    ("drafts >= new tokens", InvalidTokenCountError),
    ("retire an int id", InvalidRequestError),
    ("free an int id", InvalidRequestError),
    ("retire past scheduled", InvalidTokenCountError),
    ("retire negative", InvalidTokenCountError),
    ("accept drafts never scheduled", MambaKVError),
    ("lookup a str", InvalidRequestError),
    ("block ids of an int id", InvalidRequestError),
    ("allocate at a negative clock", InvalidClockError),
    ("set a negative clock", InvalidClockError),
    ("free at a negative clock", InvalidClockError),
    ("outputs while in the prompt", InvalidTokenCountError),
])
def test_coordinator_entry_points_refuse_bad_input(what, error):
    coord, req = _coord()
    free = coord.block_pool.get_num_free_blocks()
    calls = {
        "allocate a str": lambda: coord.allocate("a", 8),
        "allocate None": lambda: coord.allocate(None, 8),
        "hits not KVCacheBlocks": lambda: coord.allocate(Request("s", [1, 2, 3]), 2, num_new_computed_tokens=0,
                                                         new_computed_blocks=([], [])),
        "tokens a str": lambda: coord.allocate(req, "1"),
        "tokens a float": lambda: coord.allocate(req, 1.0),
        "negative lookahead": lambda: coord.allocate(req, 1, num_lookahead_tokens=-1),
        "lookahead a float": lambda: coord.allocate(req, 1, num_lookahead_tokens=0.5),
        "drafts >= new tokens": lambda: coord.allocate(req, 2, num_draft_tokens=2),
        "retire an int id": lambda: coord.retire(123, 10),
        "free an int id": lambda: coord.free(5),
        "retire past scheduled": lambda: coord.retire("r", 9),
        "retire negative": lambda: coord.retire("r", -1),
        "accept drafts never scheduled": lambda: coord.accept_drafts("r", 2),
        "lookup a str": lambda: coord.get_computed_blocks("x"),
        "block ids of an int id": lambda: coord.get_block_ids(5),  # type: ignore[arg-type]
        "allocate at a negative clock": lambda: coord.allocate(req, 1, now=-5.0),
        "set a negative clock": lambda: coord.set_now(-1),
        "free at a negative clock": lambda: coord.free("r", now=-0.5),
        "outputs while in the prompt": lambda: req.append_output_token_ids([3]),  # 8 of 9 prompt tokens computed
    }
    _unchanged(coord, free, calls[what], error)


@pytest.mark.parametrize("prompt", ["hello", b"hello", bytearray(b"hi"), memoryview(b"hi")])
def test_a_text_prompt_is_refused(prompt):
    """A prompt given as text (the tokenizer was not run) is refused; before: a plain
    ValueError (bytes) or ids made of characters."""
    with pytest.raises(InvalidRequestError, match="token ids"):
        Request("x", prompt)


@pytest.mark.parametrize("rid", ["", 0, None, b"r"])
def test_a_bad_request_id_is_refused(rid):
    with pytest.raises(InvalidRequestError, match="non-empty str"):
        Request(rid, [1, 2])


def test_documented_no_ops_change_nothing():
    """A retire below an earlier one and a clock reading earlier than the latest are no-ops.
    Hand count: FA 4 + Mamba 4 (nspec 0), 32 blocks; "r" (9 tokens) allocated to 8: FA blocks
    1, 2, Mamba ``[null, 3]`` (running slot 1): 31 - 3 = 28 free; retire 8 publishes the state
    at 8 and frees nothing (slot 0 is null): 28 free; retiring 4, then 0, changes nothing."""
    coord, req = _coord()
    coord.retire("r", 8)
    assert coord.block_pool.get_num_free_blocks() == 28
    assert coord.get_block_ids("r") == ([1, 2], [0, 3])
    coord.retire("r", 4)
    coord.retire("r", 0)
    assert coord.block_pool.get_num_free_blocks() == 28 and coord.get_block_ids("r") == ([1, 2], [0, 3])
    coord.set_now(10.0)
    coord.set_now(3.0)
    assert coord.now == 10.0
    assert coord.allocate(req, 1, num_draft_tokens=0, now=7.0) is not None  # the last prompt token
    assert coord.now == 10.0
    req.num_computed_tokens = 9
    req.append_output_token_ids([5])
    coord.free("r", now=12.5)
    assert coord.now == 12.5
    coord.check_invariants()
    assert coord.get_block_ids("gone") == ([], [])


def test_coordinator_construction_refuses_bad_input():
    group = KVCacheGroupSpec(["a"], FullAttentionSpec(12, 1, 8))
    cfg = KVCacheConfig(8, [group])
    with pytest.raises(InvalidSpecError, match="KVCacheConfig"):
        KVCacheCoordinator(None, max_model_len=64)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenCountError, match="max_model_len"):
        KVCacheCoordinator(cfg, max_model_len="1024")  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match="max_num_seqs"):
        KVCacheCoordinator(cfg, max_model_len=64, max_num_seqs=0)
    with pytest.raises(InvalidSpecError, match="list"):
        KVCacheConfig(10, group)  # type: ignore[arg-type]
    # 12 and 16: the smallest does not divide the other; the message says what to pass (gcd 4)
    mixed = KVCacheConfig(8, [group, KVCacheGroupSpec(["m"], MambaSpec(16, ((2, 4),), ("float32",), mode="align"))])
    with pytest.raises(HashBlockSizeMismatchError, match="hash_block_size=4"):
        KVCacheCoordinator(mixed, max_model_len=64)
    assert KVCacheCoordinator(mixed, max_model_len=64, hash_block_size=4).alignment_tokens == 48


def test_hashing_and_request_refuse_bad_input():
    with pytest.raises(InvalidHashError):
        hash_block_tokens("x", [1])  # type: ignore[arg-type]
    with pytest.raises(InvalidHashError):
        init_none_hash("abc")  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenCountError, match="ends past"):
        Request("r", [1, 2, 3, 4], mm_hashes=[(2, 4, "img")])  # tokens 2..5 of a 4-token prompt
    with pytest.raises(InvalidTokenCountError):
        Request("r", [1, 2, 3, 4], mm_hashes=[("0", 2, "img")])  # type: ignore[list-item]


def test_blocks_of_another_pool_are_refused_by_touch_and_free():
    # Before the fix both pools ended corrupt and the next get_new_blocks handed a block out twice.
    a, b = BlockPool(8), BlockPool(8)
    (x,) = a.get_new_blocks(1)
    (y,) = b.get_new_blocks(1)
    for call in (lambda: b.touch([x]), lambda: b.free_blocks([y, x]), lambda: a.free_blocks([b.null_block])):
        free_a, free_b = a.get_num_free_blocks(), b.get_num_free_blocks()
        with pytest.raises(InvalidBlockError, match="another pool"):
            call()
        assert (x.ref_cnt, y.ref_cnt) == (1, 1)
        assert (a.get_num_free_blocks(), b.get_num_free_blocks()) == (free_a, free_b)
        a.check_invariants()
        b.check_invariants()
    with pytest.raises(DoubleFreeError):
        a.free_blocks([x, x])


def test_another_prompts_hit_is_not_called_evicted():
    coord, req = _coord()
    coord.retire("r", 8)
    other = Request("o", [50] * 9)
    hit_blocks, n = coord.get_computed_blocks(Request("again", list(range(1, 10))))
    assert n == 8
    with pytest.raises(StaleCacheHitError, match="another prefix"):
        coord.allocate(other, 1, num_new_computed_tokens=n, new_computed_blocks=hit_blocks)
    assert isinstance(hit_blocks, KVCacheBlocks)
    coord.check_invariants()


def test_state_pool_on_a_missing_device_is_a_spec_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from mambakv import MambaStatePool

    with pytest.raises(InvalidSpecError, match="CUDA"):
        MambaStatePool(MambaSpec(4, ((2, 4),), ("float32",)), 1, 4, device="cuda")


def test_errors_are_mambakv_errors():
    assert issubclass(ModelConfigError, MambaKVError) and issubclass(ModelConfigError, ValueError)


def test_every_error_class_is_exported():
    # InvalidCopyPlanError (MambaStatePool's) was missing from `mambakv`
    import mambakv
    import mambakv.core.errors as errors

    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, MambaKVError)}
    assert "InvalidCopyPlanError" in classes and len(classes) == 20  # InvalidClockError: issue 15, LoadPendingError: 17,
    # ReadOnlyResultError: the shared empty KVCacheBlocks, InvalidFenceError: the transfer fence,
    # UnsupportedEngineError: the vLLM integration (issue 30)
    for name in classes:
        assert name in mambakv.__all__ and getattr(mambakv, name) is getattr(errors, name)


def test_every_lookup_by_id_refuses_a_non_str_id():
    """Each call that takes a request id refuses an int id with InvalidRequestError, state
    unchanged (the same hand count as above: 28 free after "r" is allocated to 8); a str id of
    no live request stays the documented quiet answer."""
    coord, _ = _coord()
    calls = [lambda rid: coord.accept_drafts(rid, 0), coord.describe, coord.holds_blocks,
             coord.get_state_slot_ids, coord.get_state_plan, coord.get_block_ids, coord.get_blocks,
             lambda rid: coord.retire(rid, 1), coord.free, lambda rid: coord.update_from_output({rid: (1, None)})]
    for call in calls:
        with pytest.raises(InvalidRequestError, match="request ids are strs"):
            call(3)
        assert coord.block_pool.get_num_free_blocks() == 28 and coord.get_block_ids("r") == ([1, 2], [0, 3])
    assert coord.describe("zzz") is None and coord.holds_blocks("zzz") is False and coord.get_state_plan("zzz") == {}
    assert coord.holds_blocks("r") is True
    coord.check_invariants()


def test_update_from_output_takes_a_mapping():
    coord, _ = _coord()
    with pytest.raises(InvalidRequestError, match="mapping"):
        coord.update_from_output([("r", (8, None))])  # type: ignore[arg-type]
    assert coord.block_pool.get_num_free_blocks() == 28
    coord.update_from_output({"r": (8, None)})
    assert coord.block_pool.get_num_free_blocks() == 28 and coord.get_block_ids("r") == ([1, 2], [0, 3])
    coord.check_invariants()


@pytest.mark.parametrize(("key", "value"), [("lora_name", 7), ("cache_salt", b"tenant"), ("cache_salt", 1.5)])
def test_request_refuses_a_non_str_hash_key(key, value):
    """lora_name and cache_salt go into the block hashes as text: before the check a non-str
    passed construction and raised TypeError at the first hash, inside allocate."""
    with pytest.raises(InvalidRequestError, match=key):
        Request("r", [1, 2, 3, 4], **{key: value})
    assert Request("r", [1, 2, 3, 4], **{key: "x"}).block_hashes is not None


def test_allocate_past_the_request_names_the_tokens_not_drafts():
    """A 9-token request, 8 computed, allocate(req, 50): 58 tokens (max_model_len 64), 49 past
    its 9. The Mamba group has 0 speculative blocks; the error says the step runs past the
    request's tokens (it said "49 draft tokens", which the caller never asked for). Nothing
    changes."""
    coord, req = _coord()
    _unchanged(coord, 28, lambda: coord.allocate(req, 50), MambaKVError)
    with pytest.raises(MambaKVError, match=r"reaches 58 tokens, 49 beyond its 9"):
        coord.allocate(req, 50)
    assert coord.get_block_ids("r") == ([1, 2], [0, 3])


@pytest.mark.parametrize("outputs", [
    {"r": (8, None), 5: (1, None)},      # a bad id after a good entry
    {"r": (8, None), "zz": (1,)},        # a value that is not a pair
    {"r": (8, None), "q": 128},
    {"r": (8, None), "q": None},
    {"r": (8, None, 0)},
    {"r": (8, None), "q": ("1", None)},  # a count that is not an int
    {"r": (8, "0")},
    {"r": (8, None), "q": (1, -1)},
])
def test_update_from_output_checks_every_entry_first(outputs):
    """Every entry's id, shape and counts are checked before any request is settled: "r"
    (8 scheduled, not yet retired) is left as it was, and each refusal is one line."""
    coord, _ = _coord()
    before = coord.describe("r")
    with pytest.raises(MambaKVError) as err:
        coord.update_from_output(outputs)
    assert "\n" not in str(err.value)
    assert coord.describe("r") == before and coord.block_pool.get_num_free_blocks() == 28
    coord.check_invariants()


def test_update_from_output_refuses_a_count_past_what_was_scheduled_before_settling():
    coord, _ = _coord()
    before = coord.describe("r")
    coord.allocate(Request("q", list(range(100, 120))), 4)  # "q": 4 scheduled
    with pytest.raises(InvalidTokenCountError, match="at most 4 can be"):
        coord.update_from_output({"r": (8, None), "q": (5, None)})
    assert coord.describe("r") == before
    coord.update_from_output({"r": (8, None), "q": (4, None)})
    coord.check_invariants()


@pytest.mark.parametrize("count", [-1, True, "x", 1.5])
def test_free_checks_its_count_whatever_the_id(count):
    """As retire does: a bad num_processed_tokens is refused for an unknown id too."""
    coord, _ = _coord()
    with pytest.raises(InvalidTokenCountError):
        coord.free("zz", num_processed_tokens=count)
    with pytest.raises(InvalidTokenCountError):
        coord.free("r", num_processed_tokens=count)
    assert coord.holds_blocks("r") and coord.block_pool.get_num_free_blocks() == 28


@pytest.mark.parametrize("bad", ["r", None, 5, {}])
def test_num_blocks_needed_refuses_a_non_request(bad):
    coord, _ = _coord()
    with pytest.raises(InvalidRequestError, match="num_blocks_needed needs a Request"):
        coord.num_blocks_needed(bad, 16)


@pytest.mark.parametrize("call", ["complete_load", "abort_load"])
def test_host_load_calls_refuse_a_non_str_id(call):
    coord, _ = _coord()
    with pytest.raises(InvalidRequestError, match="request ids are strs"):
        getattr(coord, call)(5)
    with pytest.raises(MambaKVError, match="no host-tier load"):
        getattr(coord, call)("r")
