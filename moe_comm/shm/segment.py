"""Shared-memory segments in /dev/shm: one per rank, mapped by every rank of the job.

Lifetime: a rank creates its segment (mode 0600, exclusive), every rank maps every peer's
segment, then each rank unlinks its own name at once. From then on the memory lives only as
long as some process maps it: a crash can no longer leak it, and no process outside the job
can open it. The only leak window (killed between create and unlink) is closed by
:func:`reclaim_stale_segments`, run at every start, which removes segments whose creating
process is gone (the creator's pid is part of the name).
"""
from __future__ import annotations

import errno
import mmap
import os

import numpy as np

SHM_DIR = "/dev/shm"
PREFIX = "moe_comm."


def segment_name(job: str, rank: int) -> str:
    return f"{PREFIX}{job}.{rank}.{os.getpid()}"


def segment_pid(name: str):
    """The creator's pid in a segment's name, or None for a name of another form."""
    try:
        return int(name.rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_stale_segments(shm_dir: str = SHM_DIR) -> list:
    """Unlink moe_comm segments whose creator process no longer exists. Returns their names."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = segment_pid(name)
        if pid is not None and not pid_alive(pid):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _reserve(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise MemoryError(
                f"/dev/shm cannot hold {length} more bytes of a moe_comm segment; lower "
                f"num_nvl_bytes/num_rdma_bytes or enlarge /dev/shm") from e
        raise


class Segment:
    """One mapped segment. ``bytes`` is a numpy uint8 view of the whole mapping."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, shm_dir: str = SHM_DIR,
                 fd: int | None = None):
        self.name, self.path, self.owner = name, os.path.join(shm_dir, name), owner
        self._mm = mm
        self._fd = fd                   # kept by a segment reserved part by part (reserve)
        self.bytes = np.frombuffer(mm, dtype=np.uint8)
        self.size = len(mm)
        self.linked = owner

    @classmethod
    def create(cls, name: str, size: int, shm_dir: str = SHM_DIR,
               reserve: bool = True) -> "Segment":
        """A new segment of ``size`` bytes. ``reserve=False``: no page is reserved yet; the
        owner reserves the parts it lets peers write (:meth:`reserve`) before it does."""
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if reserve:
                # Reserve the pages now: running out of /dev/shm later would be a SIGBUS.
                _reserve(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if os.path.exists(path):
                os.unlink(path)
            os.close(fd)
            raise
        if reserve:
            os.close(fd)
            fd = None
        return cls(name, mm, owner=True, shm_dir=shm_dir, fd=fd)

    def reserve(self, offset: int, length: int) -> None:
        """Reserve the pages of [offset, offset + length) of a segment created with
        ``reserve=False`` (MemoryError where /dev/shm cannot hold them): only then may they
        be written, by anyone (an unreserved page written when /dev/shm is full is a
        SIGBUS)."""
        _reserve(self._fd, offset, length)

    @classmethod
    def open(cls, name: str, shm_dir: str = SHM_DIR) -> "Segment":
        fd = os.open(os.path.join(shm_dir, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False, shm_dir=shm_dir)

    def unlink(self) -> None:
        if self.owner and self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap. If tensors the caller still holds view this memory, the mapping stays until
        they die (the name is already unlinked, so nothing leaks past the process)."""
        self.unlink()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        self.bytes = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass        # still viewed: unmapped when the last view is collected
