"""The rows both bench scripts report (bench_all_to_all.py's sweep, gpu_check.py's timing
table): their columns, in order, and the fixed-width text table of them. docs/PERF.md and the
tests read these names, so they change only together."""
from __future__ import annotations

COLUMNS = ("mode", "ranks", "tokens", "hidden", "topk", "experts", "dtype", "dispatch_us",
           "combine_us", "dispatch_gbps", "combine_gbps", "baseline_dispatch_us",
           "baseline_combine_us", "copy_gbps")
CASE_COLUMNS = COLUMNS[:7]      # what was run; the columns after them are what was measured
# bench_all_to_all.py's second baseline, MPICH's exchange: in its table only when MPI ran (the
# JSON rows always have the keys, None without MPI)
MPI_COLUMNS = ("mpi_dispatch_us", "mpi_combine_us")
# with --hosts: bytes that crossed the host links over the ideal (normal mode)
WIRE_COLUMNS = ("wire_ratio",)


def case_columns(case) -> dict:
    """The leading columns of a row, taken from a case (a dict with at least those keys)."""
    return {c: case[c] for c in CASE_COLUMNS}


def header_line(width: int, columns=COLUMNS) -> str:
    return " ".join(f"{c:>{width}}" for c in columns)


def row_line(row, width: int, columns=COLUMNS) -> str:
    """Floats with one decimal, a column the row lacks as nan (a spec whose timing failed)."""
    cells = []
    for c in columns:
        v = row.get(c)
        if v is None:
            v = float("nan")
        cells.append(f"{v:>{width}.1f}" if isinstance(v, float) else f"{v:>{width}}")
    return " ".join(cells)
