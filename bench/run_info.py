"""What a benchmark run ran on: library versions and the machine, recorded beside the rows
of bench_all_to_all.py's JSON so that numbers from different runs can be told apart."""
from __future__ import annotations

import os
import platform

import torch

import moe_comm


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cores():
    """Cores this process may run on (its affinity mask), which is what the ranks share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # no affinity call on this platform
        return os.cpu_count()


def run_info(mpi_versions=None, mpi_library=None):
    """Versions (moe_comm, torch, Python, MPI packages and library) and the machine (cores,
    CPU model, OS). ``mpi_versions``: {package: version} of the MPI wheels, None without MPI;
    ``mpi_library``: MPI_Get_library_version's first line as the ranks reported it."""
    return {
        "versions": {"moe_comm": moe_comm.__version__, "torch": torch.__version__,
                     "python": platform.python_version(),
                     "mpi": None if mpi_versions is None else dict(mpi_versions,
                                                                  library=mpi_library)},
        "machine": {"cores": usable_cores(), "cpu_count": os.cpu_count(),
                    "cpu_model": cpu_model(), "platform": platform.platform(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else None},
    }
