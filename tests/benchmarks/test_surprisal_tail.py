"""The surprisal-tail benchmark's measures: set differences, summary weights, and its argument check."""
import pytest
import torch

from benchmarks.perf.surprisal_tail import differing_share, main, weight_change


def test_differing_share_counts_positions_in_one_set_only():
    assert differing_share(torch.tensor([0, 32, 64]), torch.tensor([0, 32, 64])) == 0.0
    assert differing_share(torch.tensor([0, 32, 64]), torch.tensor([0, 32, 70])) == 0.5  # {64, 70} of 4
    assert differing_share(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == 0.0


def test_weight_change_is_the_largest_move_of_a_tokens_share_of_its_span():
    exact = torch.tensor([0.0, 1.0, 1.0, 2.0, 4.0, 4.0])
    starts, lens = torch.tensor([0, 3]), torch.tensor([3, 3])
    assert weight_change(exact, exact, starts, lens) == 0.0
    moved = exact.clone()
    moved[1] = 3.0  # span 0's shares: (0, 1/2, 1/2) -> (0, 3/4, 1/4)
    assert weight_change(moved, exact, starts, lens) == pytest.approx(0.25)


def test_a_negative_setting_is_refused_naming_the_argument(capsys):
    with pytest.raises(SystemExit):
        main(["--exact-tokens", "8192", "-1"])
    assert "--exact-tokens: every value must be >= 0" in capsys.readouterr().err
