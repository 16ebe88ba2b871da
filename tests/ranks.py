"""Tests start ranks with the package's launcher (real processes, gloo group, deadline)."""
from moe_comm.testing.processes import RankFailure, run_ranks
