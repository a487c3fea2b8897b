"""Benchmarks (`make bench`): ratios against the naive way, measured in the same run."""
