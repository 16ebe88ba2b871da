"""Symbol table of a cubin (an ELF64 file), read without cuobjdump (CI has none).

``symbols(cubin) -> (defined, undefined)``: sets of names. A fully device-linked cubin may
only leave symbols the driver resolves at load time (see ``DRIVER_RESOLVED``); anything else,
an NVSHMEM entry point above all, means the device link missed a library.
"""
from __future__ import annotations

import struct

SHT_SYMTAB = 2
SHN_UNDEF = 0
# Left undefined by nvcc -dlink and resolved by the CUDA driver when the cubin loads.
DRIVER_RESOLVED = ("vprintf", "__assertfail", "malloc", "free", ".nv.reservedSmem")


class ElfError(ValueError):
    pass


def symbols(data: bytes):
    """``(defined, undefined)`` symbol names of the ELF64 little-endian image ``data``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError("not an ELF64 little-endian image (a cubin is one)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    defined, undefined = set(), set()
    for _name, sh_type, _f, _a, off, size, link, _i, _al, entsize in sections:
        if sh_type != SHT_SYMTAB or not entsize:
            continue
        str_off = sections[link][4]
        for k in range(size // entsize):
            st_name, _info, _other, shndx, _value, _size = struct.unpack_from(
                "<IBBHQQ", data, off + k * entsize)
            if not st_name:
                continue
            end = data.index(b"\0", str_off + st_name)
            name = data[str_off + st_name:end].decode("utf-8", "replace")
            (undefined if shndx == SHN_UNDEF else defined).add(name)
    return defined, undefined


def unresolved(data: bytes) -> set:
    """Undefined symbols the driver will not resolve (should be empty after a device link)."""
    _, undefined = symbols(data)
    return {s for s in undefined if not s.startswith(DRIVER_RESOLVED)}
