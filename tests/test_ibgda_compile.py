"""The IBGDA device code builds and device-links against NVSHMEM, on a machine without a GPU.

Builds with the library's own path (moe_comm/jit/nvcc.py: nvcc -rdc=true, then nvcc -dlink
-cubin against libnvshmem_device.a), warnings promoted to errors, into a fresh cache: the
selftest kernels and the mode kernels of csrc/kernels with their NVSHMEM remote branch
(MOE_WITH_NVSHMEM: normal mode, LL dispatch send and receive, LL combine), for sm_90, and the
selftest for sm_100 too. (Their logic runs against the reference on the emulated NVSHMEM in
tests/test_cuda_emulator.py.) Each program is built once per
session (module fixture, two at a time). Skips only when the nvidia-nvshmem-cu13 wheel is not
installed. Never touches a driver and never calls nvshmem.core.init (it exits the process
without a GPU): the init guard is checked in a child process.
"""
from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from moe_comm.jit import elf, resources, variants
from moe_comm.ibgda import bases
from moe_comm.jit import toolchain as locate
from moe_comm.jit import cache
from moe_comm.jit import nvcc as build

SM90_PROGRAMS = (build.selftest_program(),
                 build.kernel_program(variants.intranode()),
                 build.kernel_program(variants.ll_dispatch_send(7168, True, True)),
                 build.kernel_program(variants.ll_dispatch_recv(7168, True, True)),
                 build.kernel_program(variants.ll_combine(0)))
SM100_PROGRAMS = (build.selftest_program(),)
JOBS = [(p, "sm_90") for p in SM90_PROGRAMS] + [(p, "sm_100") for p in SM100_PROGRAMS]


def _nvshmem_or_skip():
    try:
        return locate.nvshmem_install()
    except locate.NvshmemNotFoundError as e:
        reason = (f"NVSHMEM wheel not installed ({e}); CI needs: pip install "
                  "nvidia-nvshmem-cu13==3.8.0")
        print(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{(program, arch): cubin bytes or the exception}, built once for the module."""
    nv = _nvshmem_or_skip()
    cache = tmp_path_factory.mktemp("ibgda_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOE_COMM_CACHE_DIR", str(cache))
    out = {}

    def one(job):
        program, arch = job
        try:
            out[job] = build.build_cubin(program, arch, strict=True)
        except Exception as e:  # noqa: BLE001 - reported by the test
            out[job] = e

    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:       # nvcc runs as a subprocess: 2 cores
        list(pool.map(one, JOBS))
    print(f"{len(JOBS)} IBGDA programs against NVSHMEM {nv.version} in "
          f"{time.monotonic() - t0:.1f} s")
    yield out
    mp.undo()


def test_every_program_builds_and_links_without_warnings(built):
    failures = [f"{p.label} {arch}: {r}" for (p, arch), r in built.items()
                if isinstance(r, Exception)]
    assert not failures, "\n\n".join(failures)


def test_every_kernel_fits_its_launch_block(built):
    """The NVSHMEM build keeps the launch bounds too (moe_comm/jit/resources.py)."""
    failures = []
    for (program, arch), cubin in built.items():
        if not isinstance(cubin, Exception):
            failures += resources.problems(cubin, f"{program.label} {arch}", program.kernels)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{j[0].source}-{j[1]}")
def test_cubin_is_linked_with_the_ibgda_device_state(built, job):
    cubin = built[job]
    if isinstance(cubin, Exception):
        pytest.fail(str(cubin))
    program, _ = job
    defined, undefined = elf.symbols(cubin)
    assert set(program.kernels) <= defined, set(program.kernels) - defined
    # NVSHMEM's device state and the IBGDA transport's are in: IBGDA is compiled in, and the
    # cubin needs only the driver's library_init to run.
    assert {"nvshmemi_device_state_d", "nvshmemi_ibgda_device_state_d"} <= defined
    assert not elf.unresolved(cubin), sorted(undefined)


def test_cache_reuses_cubins_and_keys_on_version_arch_macros(built, tmp_path, monkeypatch):
    job = (build.selftest_program(), "sm_90")
    if isinstance(built[job], Exception):
        pytest.skip("selftest did not build (reported above)")
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path))
    # Seed a fresh cache from the module build, then prove a hit runs no nvcc.
    cache.write_atomic(cache.cache_dir("ibgda") / f"selftest-sm_90-"
                        f"{build.cache_key(*job)[:40]}.cubin", built[job])

    def no_nvcc(*a, **k):
        raise AssertionError("cache miss: nvcc was run")
    monkeypatch.setattr(build, "_run", no_nvcc)
    assert build.build_cubin(*job) == built[job]
    p = build.selftest_program()
    key = build.cache_key(p, "sm_90")
    assert key != build.cache_key(p, "sm_100")
    assert key != build.cache_key(replace(p, defines=(("MOE_X", 1),)), "sm_90")
    other = replace(locate.nvshmem_install(), version="9.9.9")
    monkeypatch.setattr(build, "nvshmem_install", lambda: other)
    assert build.cache_key(p, "sm_90") != key


def test_sources_are_in_the_key(tmp_path, monkeypatch):
    _nvshmem_or_skip()
    copy = tmp_path / "csrc"
    shutil.copytree(cache.csrc_dir(), copy)
    p = build.selftest_program()
    before = build.cache_key(p, "sm_90", copy)
    with open(copy / "ibgda" / "transport_nvshmem.cuh", "a") as f:
        f.write("\n// edited\n")
    assert build.cache_key(p, "sm_90", copy) != before


def _tiny_tree(tmp_path, body: str):
    copy = tmp_path / "csrc"
    (copy / "kernels").mkdir(parents=True)
    (copy / "ibgda").mkdir()
    (copy / "ibgda" / "tiny.cu").write_text(body)
    return copy


def test_errors_and_warnings_are_reported(tmp_path, monkeypatch):
    _nvshmem_or_skip()
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path / "cache"))
    ok = 'extern "C" __global__ void k(int* p) { *p = 1; }\n'     # small: no NVSHMEM header
    program = build.Program("ibgda/tiny.cu", (), ("k",))
    monkeypatch.setenv("MOE_COMM_CSRC_DIR", str(_tiny_tree(tmp_path / "a", ok + (
        "__device__ int unused_fn() { int x; return 1; }\n"))))
    with pytest.raises(build.IbgdaBuildError, match="warning"):
        build.build_cubin(program, "sm_90", strict=True, use_cache=False)
    monkeypatch.setenv("MOE_COMM_CSRC_DIR", str(_tiny_tree(tmp_path / "b", ok + (
        "__device__ int broken() { return undefined_name; }\n"))))
    with pytest.raises(build.IbgdaBuildError, match="undefined_name"):
        build.build_cubin(program, "sm_90", use_cache=False)


def test_default_build_does_not_see_nvshmem():
    """Without MOE_WITH_NVSHMEM the kernels' Transport includes nothing from csrc/ibgda (the
    NVRTC build stays header-free; tests/test_cuda_compile.py compiles every variant)."""
    text = (cache.csrc_dir() / "kernels" / "transport.cuh").read_text()
    head, _, _ = text.partition("struct Transport")
    inc = head.index('#include "../ibgda/transport_nvshmem.cuh"')
    assert head.rfind("#ifdef MOE_WITH_NVSHMEM", 0, inc) > head.rfind("#endif", 0, inc)
    try:
        from moe_comm.jit.nvrtc import compile_cubin
        cubin = compile_cubin(variants.ll_combine(7168), "sm_90", use_cache=False)
    except Exception as e:  # noqa: BLE001 - NVRTC missing: test_cuda_compile reports it
        pytest.skip(f"NVRTC unavailable: {e}")
    assert b"nvshmem" not in cubin


# ---- host side that runs without a GPU --------------------------------------------------------
def test_bases_encoding():
    own, mirror = 0x7F00_0000_0000, 0x7A00_0000_0000
    words = bases.encode_bases(1, own, [0x7E00_0000_0000, 0, 0, 0],
                               {2: mirror, 3: mirror + 4096})
    assert words == [0x7E00_0000_0000, own, mirror | 1, (mirror + 4096) | 1]
    assert [bases.decode_base(w) for w in words] == [
        ("pointer", 0x7E00_0000_0000), ("pointer", own), ("network", mirror),
        ("network", mirror + 4096)]
    assert bases.decode_base(0) == ("none", 0)
    assert bases.network_ranks(words) == [2, 3]
    with pytest.raises(ValueError, match="own_ptr"):
        bases.encode_bases(0, own | 1, [0, 0], {1: mirror})
    with pytest.raises(ValueError, match="outside"):
        bases.encode_bases(2, own, [0, 0], {})
    with pytest.raises(ValueError, match="peer pointer of rank 1"):
        bases.encode_bases(0, own, [0, 0x1001], {})
    with pytest.raises(ValueError, match="rank 1 .* no mirror"):
        bases.encode_bases(0, own, [0, 0], {})


def test_cuda_group_transport_choice(monkeypatch):
    """moe_comm/ibgda/path.py: IPC on one host, IBGDA across hosts where every rank can,
    the host proxy otherwise; an explicit 'ibgda' that some rank cannot do raises."""
    from moe_comm.ibgda import path as ibgda
    ok = {"software": "", "nic": True}
    no_nic = {"software": "", "nic": False}
    no_lib = {"software": "nvshmem4py is not installed", "nic": True}
    assert ibgda.choose("auto", False, [ok, ok])[0] == "ipc"
    assert ibgda.choose("tcp", False, [ok, ok])[0] == "ipc"
    assert ibgda.choose("auto", True, [ok, ok])[0] == "ibgda"
    path, why = ibgda.choose("auto", True, [ok, no_nic])
    assert path == "proxy" and "rank 1" in why and "ConnectX" in why
    assert ibgda.choose("auto", True, [no_lib, ok]) == (
        "proxy", "no IBGDA on rank 0: nvshmem4py is not installed")
    assert ibgda.choose("verbs", True, [ok, ok])[0] == "proxy"
    assert ibgda.choose("ibgda", False, [no_nic, no_nic])[0] == "ibgda"
    with pytest.raises(RuntimeError, match="rank 1 cannot use it: nvshmem4py"):
        ibgda.choose("ibgda", True, [ok, no_lib])
    from moe_comm.transport import requested_kind
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "ibgda")
    assert requested_kind("auto", cuda=True) == "ibgda"
    assert requested_kind("tcp", cuda=True) == "tcp"
    assert requested_kind("auto") == "auto"          # host code: only its proxy
    with pytest.raises(ValueError, match="for CUDA tensors"):
        requested_kind("ibgda")
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="MOE_COMM_TRANSPORT"):
        requested_kind(cuda=True)
    with pytest.raises(ValueError, match="transport kind must be one of"):
        requested_kind("nvlink", cuda=True)
    probe = ibgda.probe()                  # this machine: no GPU, so never IBGDA
    assert probe["software"] == "no CUDA GPU"


def _init_without_gpu(rank, n):
    from moe_comm.ibgda import runtime
    try:
        runtime.init_nvshmem()
    except runtime.NvshmemUnavailableError as e:
        return str(e)
    return "no error"


def test_init_without_gpu_raises_instead_of_exiting():
    from moe_comm.ibgda.runtime import cuda_device_count
    from moe_comm.testing.processes import run_ranks
    if cuda_device_count():
        pytest.skip("a GPU is present: tests/test_ibgda_gpu.py covers init")
    (msg,) = run_ranks(_init_without_gpu, 1, timeout=60)
    assert "GPU" in msg and "not called" in msg


def _uid_bytes(rank, n):
    from moe_comm.ibgda.runtime import exchange_unique_id
    uid = exchange_unique_id()
    return bytes(uid._data.tobytes())


def test_unique_id_travels_over_the_group():
    _nvshmem_or_skip()
    pytest.importorskip("nvshmem.core", reason="nvshmem4py-cu13 not installed")
    from moe_comm.testing.processes import run_ranks
    got = run_ranks(_uid_bytes, 2, timeout=60)
    assert len(got[0]) == 128 and any(got[0]) and got[0] == got[1]


@pytest.mark.parametrize("defines, version", [
    ('#define NVSHMEM_VENDOR_BASE_VERSION_STRING "3.8.0"\n', "3.8.0"),
    # 3.4.5 (the GPU image's, first GPU run): the numbers only
    ("#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 4\n"
     "#define NVSHMEM_VENDOR_PATCH_VERSION 5\n#define NVSHMEM_VENDOR_PACKAGE_VERSION 0\n",
     "3.4.5"),
])
def test_nvshmem_version_read_from_either_header_form(tmp_path, defines, version):
    (tmp_path / "non_abi").mkdir()
    (tmp_path / "non_abi" / "nvshmem_version.h").write_text("#pragma once\n" + defines)
    assert locate._header_version(tmp_path) == version
    (tmp_path / "non_abi" / "nvshmem_version.h").write_text("#pragma once\n")
    with pytest.raises(locate.NvshmemNotFoundError, match="no NVSHMEM version"):
        locate._header_version(tmp_path)
