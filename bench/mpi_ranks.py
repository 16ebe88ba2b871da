"""The benchmark's ranks started by MPICH's mpiexec, so that every rank holds an MPI
communicator beside its gloo group: MPICH's exchange is then timed on the same data, in the
same processes and the same run as moe_comm and all_to_all_single.

Parent side: ``unavailable()`` says why MPI cannot be used here (None when it can);
a ``Launcher()`` is called as ``launcher(fn, n, *args, timeout=...)``, like
moe_comm.testing.processes.run_ranks (bench_all_to_all.run_cases takes either as its
launcher): it writes the call to a temporary folder, runs ``mpiexec -n n python
mpi_ranks.py FOLDER`` and returns the ranks' results, by rank.

Rank side (this file run as a script): MPI comes up first (mpiexec decides rank and size),
rank 0 picks the port of gloo's rendezvous and broadcasts it over MPI, then
``init_process_group("gloo")`` with MPI's rank and size, then ``fn(rank, n, *args)``; each
rank saves its result (or its traceback) in the folder.

mpi4py is imported in ``_mpi()`` only, and only in processes that mpiexec started: importing
``mpi4py.MPI`` initialises MPI, which the bench's parent process must not do (without MPI it
forks its ranks, and a process must not fork after MPI_Init).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import traceback

import torch
import torch.distributed as dist

# the repository and this folder: mpiexec runs this file as a script, and its ranks import
# moe_comm and the bench modules from there
_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from moe_comm.testing.processes import free_port  # noqa: E402

# set by the Launcher for the processes it starts: world() hands out MPI only to those
_UNDER_MPIEXEC = "MOE_COMM_BENCH_MPI"
_VERSION_FILE = "mpi_version.txt"


def mpiexec():
    """MPICH's mpiexec: the one the ``mpich`` wheel put beside this Python (it matches the
    libmpi that mpi4py loads from the same environment), else the first on PATH; None."""
    beside = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def unavailable():
    """Why the MPI baseline cannot run here (a short sentence), or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpich mpi4py, or the [mpi] extra)"
    if mpiexec() is None:
        return "no mpiexec found (pip install mpich, or the [mpi] extra)"
    return None


def versions():
    """The MPI packages' versions (importlib metadata: no MPI initialised here)."""
    out = {}
    for pkg in ("mpich", "mpi4py"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _mpi():
    """The mpi4py.MPI module; importing it initialises MPI (see the module docstring)."""
    from mpi4py import MPI
    return MPI


def world():
    """MPI_COMM_WORLD in a rank that the Launcher started, else None (any other process)."""
    if os.environ.get(_UNDER_MPIEXEC) != "1":
        return None
    return _mpi().COMM_WORLD


class RankFailure(AssertionError):
    pass


def _fn_source(fn):
    """(file, name) to find ``fn`` again in a fresh process: the module it was defined in may
    be a script run as __main__ or a file loaded by path (the tests load the bench that way)."""
    return os.path.abspath(fn.__code__.co_filename), fn.__qualname__


class Launcher:
    """run_cases' launcher over mpiexec; ``library_version`` holds MPI_Get_library_version's
    first line once a run has reported it."""

    def __init__(self):
        self.library_version = None

    def __call__(self, fn, n, *args, timeout=120.0):
        with tempfile.TemporaryDirectory(prefix="moe_comm_mpi_") as folder:
            with open(os.path.join(folder, "call.pkl"), "wb") as f:
                pickle.dump((_fn_source(fn), n, args), f)
            env = dict(os.environ, **{_UNDER_MPIEXEC: "1"})
            cmd = [mpiexec(), "-n", str(n), sys.executable, os.path.abspath(__file__), folder]
            # a session of its own: on timeout the whole job (mpiexec, proxies, ranks) is killed
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise RankFailure(f"mpiexec -n {n}: ranks did not finish within {timeout} s "
                                  "(hang or crash)") from None
            if out:
                sys.stdout.write(out)
            return self._results(folder, n, proc.returncode, err)

    def _results(self, folder, n, returncode, err):
        results = {}
        for r in range(n):
            path = os.path.join(folder, f"rank{r}")
            if os.path.exists(path + ".err"):
                with open(path + ".err") as f:
                    raise RankFailure(f"rank {r} failed:\n{f.read()}")
            if os.path.exists(path + ".pt"):
                results[r] = torch.load(path + ".pt", weights_only=False)
        if returncode != 0 or len(results) != n:
            raise RankFailure(f"mpiexec -n {n} exited with {returncode}, ranks "
                              f"{sorted(set(range(n)) - set(results))} reported nothing:\n"
                              f"{err[-4000:]}")
        if err.strip():
            sys.stderr.write(err)   # warnings the ranks printed: the run still counts
        version = os.path.join(folder, _VERSION_FILE)
        if os.path.exists(version):
            with open(version) as f:
                self.library_version = f.read().strip()
        return [results[r] for r in range(n)]


def _load(source):
    path, name = source
    spec = importlib.util.spec_from_file_location(
        "_mpi_rank_" + os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(folder):
    comm = world()
    rank, n = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)        # as the forked ranks: 4 ranks share 2 cores
    # cuda backend: mpiexec numbers the ranks of this host; bench_all_to_all reads LOCAL_RANK
    os.environ.setdefault("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", str(rank)))
    out = os.path.join(folder, f"rank{rank}")
    try:
        with open(os.path.join(folder, "call.pkl"), "rb") as f:
            source, expected_n, args = pickle.load(f)
        if n != expected_n:
            raise RuntimeError(f"mpiexec started {n} ranks, {expected_n} asked for")
        fn = _load(source)
        port = comm.bcast(free_port() if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
        result = fn(rank, n, *args)
        blob = io.BytesIO()
        torch.save(result, blob)
        with open(out + ".pt", "wb") as f:
            f.write(blob.getvalue())
        if rank == 0:
            with open(os.path.join(folder, _VERSION_FILE), "w") as f:
                f.write(_mpi().Get_library_version().splitlines()[0])
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        with open(out + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        comm.Abort(1)           # the other ranks may wait for this one in a collective
    # The results are on disk: leave without the interpreter's teardown. Under load, about
    # one teardown in three aborted here (std::terminate in a gloo worker thread releasing a
    # tensor while the interpreter finalised, after every rank had written its results), and
    # mpiexec then failed the whole case.
    comm.Barrier()
    _mpi().Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
