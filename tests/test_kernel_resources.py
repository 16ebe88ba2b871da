"""The kernel resource check (moe_comm/jit/resources.py) reads the truth and catches the
failures it is for, without a GPU.

tests/test_cuda_compile.py applies it to every variant; here: the cubin reader agrees with the
toolkit's own ``cuobjdump -res-usage`` (the nvidia-cuda-cuobjdump wheel of the test extras),
the check fails the normal-mode kernels as they were before they had launch bounds (152
registers x 512 threads: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES on every H100 launch), the emulator
refuses a launch the GPU would refuse, and a loaded kernel that cannot run its block is named.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_comm.jit import elf, resources, variants


def _nvrtc_or_skip():
    try:
        from cuda.bindings import nvrtc  # noqa: F401
        import cuda.core  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed"
        pytest.skip(f"NVRTC not importable ({e}); install moe_comm[cuda]")


def _cuobjdump() -> str:
    wheel = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "cuobjdump"
    found = str(wheel) if wheel.is_file() else shutil.which("cuobjdump")
    if not found:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump: test extras)")
    return found


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path / "cache"))


def _res_usage(tool: str, cubin: Path) -> dict:
    """{kernel: (REG, STACK, SHARED)} as cuobjdump prints them."""
    out = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    found = {}
    for name, body in re.findall(r"Function (\w+):\s*\n\s*(REG:[^\n]*)", out):
        fields = dict(re.findall(r"(\w+):(\d+)", body))
        found[name] = (int(fields["REG"]), int(fields["STACK"]), int(fields["SHARED"]))
    return found


@pytest.mark.parametrize("variant,arch", [(variants.intranode(), "sm_90"),
                                          (variants.ll_dispatch_send(7168, True, True), "sm_100"),
                                          (variants.ll_combine(0), "sm_90")],
                         ids=lambda v: getattr(v, "label", v))
def test_cubin_reader_agrees_with_cuobjdump(variant, arch, fresh_cache, tmp_path):
    _nvrtc_or_skip()
    tool = _cuobjdump()
    from moe_comm.jit.nvrtc import compile_cubin
    cubin = compile_cubin(variant, arch)
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    theirs = _res_usage(tool, path)
    ours = elf.kernel_resources(cubin)
    assert set(ours) == set(theirs) == set(variant.kernels)
    for name, res in ours.items():
        assert (res.registers, res.stack_bytes, res.shared_bytes) == theirs[name], name
        assert res.max_threads == variants.THREADS[name], name
        assert res.registers > 0


def _kernels_as_before(tmp_path) -> Path:
    """csrc/kernels without launch bounds and with the destination loop of dispatch send
    unrolled again: the code the first GPU run would have launched (its 8-rank program unrolled
    that loop fully; the rank count is a run-time value now, so by 8)."""
    from moe_comm.jit.cache import kernel_dir
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_dir(), copy)
    for f in copy.iterdir():
        text = re.sub(r"__launch_bounds__\([^)]*\)", "", f.read_text())
        f.write_text(text.replace("#pragma unroll 1\n", "#pragma unroll 8\n"))
    return copy


def test_check_fails_the_kernels_without_launch_bounds(fresh_cache, tmp_path, monkeypatch):
    _nvrtc_or_skip()
    from moe_comm.jit.nvrtc import compile_cubin
    monkeypatch.setenv("MOE_COMM_KERNEL_DIR", str(_kernels_as_before(tmp_path)))
    v = variants.intranode()
    found = resources.problems(compile_cubin(v, "sm_90"), v.label, v.kernels)
    text = "\n".join(found)
    # the launch that would fail: 512 threads x > 128 registers
    assert re.search(r"moe_dispatch_send uses 1[3-9]\d registers per thread; at 512 threads",
                     text), text
    # and every kernel is reported for its missing bound
    for name in v.kernels:
        assert f"{name} was compiled for blocks of any threads" in text, name


def test_check_reports_each_limit():
    """problems() on real records, with the launch table changed under it."""
    _nvrtc_or_skip()
    from moe_comm.jit.nvrtc import compile_cubin
    v = variants.ll_combine(0)
    cubin = compile_cubin(v, "sm_90")
    assert resources.problems(cubin, v.label, v.kernels) == []
    wider = dict(variants.THREADS, moe_ll_combine_recv=1024)
    (msg,) = resources.problems(cubin, v.label, ["moe_ll_combine_recv"], wider)
    assert "compiled for blocks of 256 threads" in msg and "launched with 1024" in msg
    assert "not in the cubin" in resources.problems(cubin, v.label, ["moe_layout"])[0]


def test_emulator_refuses_a_block_above_the_bound():
    from moe_comm.jit import emulator
    if not emulator.available():
        pytest.skip("no C++ compiler for the kernel emulator")
    k = emulator.load_kernels(variants.ll_combine(0))["moe_ll_wait"]
    bound = variants.THREADS["moe_ll_wait"]
    assert k.max_threads == bound == variants.MAX_RANKS       # one thread per rank
    with pytest.raises(emulator.EmulatorError,
                       match=f"moe_ll_wait: launched with {bound + 32} threads"):
        emulator.launch_emu(k, 1, bound + 32, [0] * 12)


def test_loaded_kernel_that_cannot_run_its_block_is_named():
    """What the driver reports for a kernel whose registers do not fit the block (the
    attributes cuda.core reads from cuFuncGetAttribute)."""
    attrs = SimpleNamespace(max_threads_per_block=384, num_regs=152, local_size_bytes=0)
    with pytest.raises(resources.KernelResourceError,
                       match=r"moe_dispatch_send can run at most 384 threads per block .*152 "
                             r"registers.* launched with 512"):
        resources.check_loaded(SimpleNamespace(attributes=attrs), "moe_dispatch_send")
    attrs.max_threads_per_block = 512
    resources.check_loaded(SimpleNamespace(attributes=attrs), "moe_dispatch_send")
