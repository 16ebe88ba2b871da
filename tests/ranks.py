"""Tests start ranks with the package's launcher (real processes, gloo group, deadline)."""
from moe_comm.launch import RankFailure, run_ranks  # noqa: F401
