"""Every CUDA kernel variant the library can request compiles for sm_90 and sm_100, and fits
the block it is launched with.

Runs on CPU-only CI: NVRTC (the ``nvidia-cuda-nvrtc`` wheel, through cuda.core) compiles to
cubin without a driver. It uses the library's own compile path (moe_comm.jit.nvrtc) with
warnings promoted to errors, into a fresh cache folder so nothing is taken from an earlier run.
Never touches a driver: no ObjectCode repr, no get_kernel (see shared/TOOLING.md).
"""
from __future__ import annotations

import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_comm.jit import cache, resources, variants

ARCHS = ("sm_90", "sm_100")


def _nvrtc_or_skip():
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception as e:  # noqa: BLE001 - any import/load failure means "not installed"
        reason = (f"NVRTC not importable ({type(e).__name__}: {e}); install cuda-core "
                  "cuda-bindings nvidia-cuda-nvrtc==13.0.*")
        print(reason)
        pytest.skip(reason)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles_and_fits_its_launch_block(arch, fresh_cache):
    """No warnings (spills are warnings: --warn-on-spills), and every kernel can launch with
    the block the library uses: registers x threads within the register file, static shared
    memory, no stack frame, and compiled with __launch_bounds__ of that block
    (moe_comm/jit/resources.py, read from the cubin)."""
    version = _nvrtc_or_skip()
    from moe_comm.jit.nvrtc import KernelCompileError, compile_cubin
    todo = variants.all_variants()
    failures = []

    def build(v):
        try:
            cubin = compile_cubin(v, arch, strict=True)
        except KernelCompileError as e:
            failures.append(str(e))
            return
        failures.extend(resources.problems(cubin, f"{v.label} {arch}", v.kernels))

    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:       # NVRTC releases the GIL
        list(pool.map(build, todo))
    print(f"{arch}: {len(todo)} variants with NVRTC {version} in "
          f"{time.monotonic() - t0:.1f} s")
    assert not failures, "\n\n".join(failures)


def test_variant_list_covers_every_request():
    """What a call can request (any group size, any hidden, every fp8 flag) is listed."""
    listed = set(variants.all_variants())
    assert variants.intranode() in listed
    for hidden in (128, 384, 4096, 7168, 7296, 8192, 16384):
        for fp8 in (False, True):
            for flag in (False, True):
                assert variants.ll_dispatch_send(hidden, fp8, flag) in listed
                assert variants.ll_dispatch_recv(hidden, fp8, flag) in listed
        assert variants.ll_combine(hidden) in listed


def test_variants_do_not_depend_on_the_group_size():
    """The rank count is a kernel argument: one intranode program, no macro naming ranks, and
    the list is the same size whatever MAX_RANKS is (1 + 10 hidden keys x 7 LL programs)."""
    listed = variants.all_variants()
    assert len(listed) == len(set(listed)) == 1 + 10 * 7
    assert [v for v in listed if v.source == "intranode.cu"] == [variants.intranode()]
    assert not [v.label for v in listed if any("RANKS" in name for name, _ in v.defines)]
    assert variants.MAX_RANKS >= 256
    for ok in (1, 8, 9, 12, 64, 65, variants.MAX_RANKS):
        variants.check_num_ranks(ok)
    for bad in (0, variants.MAX_RANKS + 1):
        with pytest.raises(ValueError, match=f"1..{variants.MAX_RANKS} ranks"):
            variants.check_num_ranks(bad)


def _with_includes(path, seen=None) -> str:
    """A source's text followed by the text of the local headers it includes, recursively."""
    seen = set() if seen is None else seen
    seen.add(path.name)
    text = path.read_text()
    for name in re.findall(r'#include "([\w.]+)"', text):
        if name not in seen and (path.parent / name).exists():
            text += _with_includes(path.parent / name, seen)
    return text


def test_every_listed_kernel_is_defined_in_its_source():
    from moe_comm.jit.cache import kernel_dir
    for v in set(variants.all_variants()):
        text = _with_includes(kernel_dir() / v.source)
        defined = set(re.findall(r"MOE_KERNEL void __launch_bounds__\([^)]*\)\s+(\w+)\(",
                                 text)) | set(re.findall(r"MOE_(?:RELAY_)?REDUCE_KERNEL\((\w+),",
                                                         text))
        assert set(v.kernels) <= defined, (v.label, set(v.kernels) - defined)


def test_cache_reuses_cubins_and_keys_on_sources(fresh_cache, tmp_path, monkeypatch):
    _nvrtc_or_skip()
    from moe_comm.jit import nvrtc as compiler
    v = variants.ll_combine(7168)
    first = compiler.compile_cubin(v, "sm_90")
    files = list(fresh_cache.glob("*.cubin"))    # (next to generated/, the header's folder)
    assert len(files) == 1
    assert compiler.compile_cubin(v, "sm_90") == first          # from the cache
    assert compiler.cache_key(v, "sm_90") != compiler.cache_key(v, "sm_100")
    assert compiler.cache_key(v, "sm_90") != compiler.cache_key(variants.ll_combine(4096),
                                                                "sm_90")
    # editing any header changes every key
    copy = tmp_path / "kernels"
    shutil.copytree(cache.kernel_dir(), copy)
    before = compiler.cache_key(v, "sm_90", copy)
    with open(copy / "common.cuh", "a") as f:
        f.write("\n// edited\n")
    assert compiler.cache_key(v, "sm_90", copy) != before


def test_warnings_and_errors_are_reported(fresh_cache, tmp_path, monkeypatch):
    _nvrtc_or_skip()
    from moe_comm.jit import nvrtc as compiler
    copy = tmp_path / "kernels"
    shutil.copytree(cache.kernel_dir(), copy)
    monkeypatch.setenv("MOE_COMM_KERNEL_DIR", str(copy))
    v = variants.ll_combine(0)
    source = copy / v.source
    original = source.read_text()
    source.write_text(original + "\n__device__ int unused_fn() { int x; return 1; }\n")
    with pytest.raises(compiler.KernelCompileError, match="warning"):
        compiler.compile_cubin(v, "sm_90", strict=True)
    compiler.compile_cubin(v, "sm_90", strict=False)         # a warning alone is not fatal
    source.write_text(original + "\n__device__ int broken() { return undefined_name; }\n")
    with pytest.raises(compiler.KernelCompileError, match="undefined_name"):
        compiler.compile_cubin(v, "sm_90")
