"""The run's ``peak_bytes`` in the decoupled layout counts each pool's blocks at their own size.

It was ``peak_blocks x`` the largest block of any group: the 480,031-token replay's peak of 7,528
blocks (7,501 pages + 9 states in each of 3 Mamba groups) read 7,528 x 13,172,736 B = 99.2 GB on a
60 GiB budget. By hand: 7,501 = ceil(480,031 / 64) pages of 1,572,864 B (12 full-attention layers)
and 27 states of 13,172,736 B (12 GDN layers each) = 11,798,052,864 + 355,663,872 B."""

from __future__ import annotations

from mambakv.sim import run_replay


def test_decoupled_peak_bytes_count_pages_and_states_at_their_sizes() -> None:
    d = run_replay(in_flight=2, layout="decoupled").to_dict()
    assert d["peak_blocks"] == 7501 + 3 * 9
    assert [g["peak_blocks"] for g in d["groups"]] == [7501, 9, 9, 9]
    assert d["peak_bytes"] == 7501 * 1_572_864 + 27 * 13_172_736 == 12_153_716_736


def test_unified_peak_bytes_is_blocks_times_the_one_block_size() -> None:
    d = run_replay(in_flight=2, layout="unified").to_dict()
    assert d["peak_bytes"] == d["peak_blocks"] * d["bytes_per_block"] == d["peak_blocks"] * 13_369_344
