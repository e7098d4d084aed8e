"""``python -m bench``, from the root of a checkout."""

from bench.cli import bench

bench()
