"""Helpers that the Python benchmarks share. They run as `python bench/x.py` (or under torchrun), so
this folder is on sys.path and they import it as `bench_util`."""

import argparse


def int_list(text):
    """argparse type for a comma-separated list of ints, e.g. --seqlens 1024,4096."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}") from e
