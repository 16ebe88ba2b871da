"""What a cubin (an ELF64 file) says about its kernels, read without cuobjdump.

* ``symbols(cubin) -> (defined, undefined)``: sets of names. A fully device-linked cubin may
  only leave symbols the driver resolves at load time (see ``DRIVER_RESOLVED``); anything else,
  an NVSHMEM entry point above all, means the device link missed a library.
* ``kernel_resources(cubin) -> {kernel: KernelResources}``: registers per thread, static shared
  memory, stack frame (local memory: spills and local arrays) and the launch bound each kernel
  was compiled with - what ``cuobjdump -res-usage`` prints, taken from the same records:

  - the ``.nv.info`` section holds attribute records ``(format u8, attribute u8, u16)``; format
    4 (EIFMT_SVAL) means the u16 is the size of the value bytes that follow. The kernel-wide
    ones carry ``(symbol index u32, value u32)``: EIATTR_REGCOUNT and EIATTR_FRAME_SIZE;
  - ``.nv.info.<kernel>`` holds EIATTR_MAX_THREADS ``(x, y, z)`` u32 where the kernel has a
    ``__launch_bounds__``;
  - ``.nv.shared.<kernel>`` (no bits) is sized like its static shared memory, the 1 KiB the
    driver reserves per block on sm_80+ included (as cuobjdump reports it).
"""
from __future__ import annotations

from dataclasses import dataclass
import struct

SHT_SYMTAB = 2
SHN_UNDEF = 0
# Left undefined by nvcc -dlink and resolved by the CUDA driver when the cubin loads.
DRIVER_RESOLVED = ("vprintf", "__assertfail", "malloc", "free", ".nv.reservedSmem")

EIFMT_SVAL = 4                 # a record whose u16 is the length of the value that follows
EIATTR_MAX_THREADS = 0x05      # per kernel: (x, y, z) of __launch_bounds__
EIATTR_FRAME_SIZE = 0x11       # (symbol, bytes of stack frame per thread)
EIATTR_REGCOUNT = 0x2F         # (symbol, registers per thread)


class ElfError(ValueError):
    pass


@dataclass(frozen=True)
class KernelResources:
    registers: int             # per thread
    shared_bytes: int          # static shared memory per block (reserved 1 KiB included)
    stack_bytes: int           # local memory per thread: spilled registers and local arrays
    max_threads: int           # launch bound the kernel was compiled with (0: none)


def _sections(data: bytes) -> list:
    """``[(name, header tuple)]``; header = (name, type, flags, addr, offset, size, link, info,
    align, entsize)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError("not an ELF64 little-endian image (a cubin is one)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
               for i in range(shnum)]
    names_at = headers[shstrndx][4]
    return [(_string(data, names_at + h[0]), h) for h in headers]


def _string(data: bytes, at: int) -> str:
    return data[at:data.index(b"\0", at)].decode("utf-8", "replace")


def _symbol_table(data: bytes, sections) -> list:
    """``[(name, section index)]`` in symbol-index order (empty without a symbol table)."""
    for _, (_n, sh_type, _f, _a, off, size, link, _i, _al, entsize) in sections:
        if sh_type != SHT_SYMTAB or not entsize:
            continue
        str_off = sections[link][1][4]
        table = []
        for k in range(size // entsize):
            st_name, _info, _other, shndx, _value, _size = struct.unpack_from(
                "<IBBHQQ", data, off + k * entsize)
            table.append((_string(data, str_off + st_name) if st_name else "", shndx))
        return table
    return []


def symbols(data: bytes):
    """``(defined, undefined)`` symbol names of the ELF64 little-endian image ``data``."""
    defined, undefined = set(), set()
    for name, shndx in _symbol_table(data, _sections(data)):
        if name:
            (undefined if shndx == SHN_UNDEF else defined).add(name)
    return defined, undefined


def unresolved(data: bytes) -> set:
    """Undefined symbols the driver will not resolve (should be empty after a device link)."""
    _, undefined = symbols(data)
    return {s for s in undefined if not s.startswith(DRIVER_RESOLVED)}


def _attributes(data: bytes, offset: int, size: int):
    """The ``(attribute, value)`` records of one .nv.info section: bytes for EIFMT_SVAL, the
    u16 otherwise."""
    at, end = offset, offset + size
    while at + 4 <= end:
        fmt, attr, half = struct.unpack_from("<BBH", data, at)
        if fmt == EIFMT_SVAL:
            if at + 4 + half > end:
                raise ElfError(f"attribute 0x{attr:x} runs past its .nv.info section")
            yield attr, data[at + 4:at + 4 + half]
            at += 4 + half
        else:
            yield attr, half
            at += 4


def kernel_resources(data: bytes) -> dict:
    """``{kernel name: KernelResources}`` of every kernel (entry function) in the cubin."""
    sections = _sections(data)
    table = _symbol_table(data, sections)
    per_symbol = {}                 # kernel-wide records: {name: {attribute: value}}
    bounds, shared = {}, {}
    for name, h in sections:
        offset, size = h[4], h[5]
        if name == ".nv.info":
            for attr, value in _attributes(data, offset, size):
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and isinstance(value, bytes):
                    sym, amount = struct.unpack_from("<II", value)
                    per_symbol.setdefault(table[sym][0], {})[attr] = amount
        elif name.startswith(".nv.info."):
            for attr, value in _attributes(data, offset, size):
                if attr == EIATTR_MAX_THREADS and isinstance(value, bytes):
                    x, y, z = struct.unpack_from("<III", value)
                    bounds[name[len(".nv.info."):]] = x * y * z
        elif name.startswith(".nv.shared.") and not name.startswith(".nv.shared.reserved"):
            shared[name[len(".nv.shared."):]] = size
    # entry functions are the ones with a .nv.info.<name> section (their parameter records)
    kernels = {name[len(".nv.info."):] for name, _ in sections if name.startswith(".nv.info.")}
    return {k: KernelResources(per_symbol.get(k, {}).get(EIATTR_REGCOUNT, 0), shared.get(k, 0),
                               per_symbol.get(k, {}).get(EIATTR_FRAME_SIZE, 0), bounds.get(k, 0))
            for k in sorted(kernels)}
