"""The command lines of the GPU benchmarks, checked without a GPU: bench/cp_bench.py's strategy
names, hybrid factorisations included."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import cp_bench  # noqa: E402


def test_hybrid_names_give_their_ulysses_degree():
    args = cp_bench.parse_args(["--strategies", "zigzag,hybrid:1,hybrid:4,hybrid", "--ulysses-degree", "2"])
    assert args.strategies == ["zigzag", "hybrid:1", "hybrid:4", "hybrid"]
    assert [cp_bench.hybrid_degree(n, args.ulysses_degree) for n in args.strategies] == [None, 1, 4, 2]


@pytest.mark.parametrize("name", ["hybrid:", "hybrid:x", "hybrid:0", "hybrid:-2", "zigzag:2", "rings"])
def test_unknown_strategy_names_are_refused(name, capsys):
    with pytest.raises(SystemExit):
        cp_bench.parse_args(["--strategies", name])
    assert f"got {name!r}" in capsys.readouterr().err
