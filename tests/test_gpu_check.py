"""bench/gpu_check.py without a GPU: its dry run (the same steps on the CPU kernel emulator,
tiny shapes) end to end, a planted failure that must not hide the other steps and specs, and a
step killed at its deadline that keeps its log. What the first GPU lease runs is checked here
first, so the lease is spent on the GPU's answers, not on the script's bugs."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from moe_comm.jit import emulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
SPECS = ["normal-bfloat16", "normal-fp8", "ll-fp8", "ll-bfloat16"]
STEPS = ["build", "tests", "timing", "baseline", "sanitizer"]
TIMES = ("dispatch_us", "combine_us", "dispatch_gbps", "combine_gbps", "copy_gbps")

pytestmark = pytest.mark.skipif(not emulator.available(),
                                reason="the kernel emulator needs a C++ compiler (g++)")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod              # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _dry_run(folder, *extra, deadline=150):
    out = folder / "gpu_check.json"
    done = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=deadline, cwd=ROOT)
    assert out.is_file(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def _rows(result):
    return {f"{r['mode']}-{r['dtype']}": r for r in result["rows"]}


def _positive(row, columns):
    return all(isinstance(row.get(c), float) and row[c] > 0 for c in columns)


def test_dry_run_records_every_step_and_spec(tmp_path):
    done, result = _dry_run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = result["steps"]
    assert list(steps) == STEPS
    for name in STEPS[:-1]:
        assert steps[name]["status"] == "ok", (name, steps[name])
        assert steps[name]["rc"] == 0 and steps[name]["seconds"] > 0
    assert steps["sanitizer"] == dict(status="skipped", reason=steps["sanitizer"]["reason"])
    assert "dry run" in steps["sanitizer"]["reason"]
    build = steps["build"]
    assert (build["programs"], build["target"]) == (8, "emulator") and "failures" not in build
    assert steps["tests"]["summary"].startswith("2 passed in "), steps["tests"]
    assert "--durations=0" in steps["tests"]["cmd"] and " -v " in steps["tests"]["cmd"]
    rows = _rows(result)
    assert list(rows) == SPECS
    for label, row in rows.items():
        assert (row["ranks"], row["hidden"], row["topk"], row["experts"]) == (2, 256, 4, 8)
        assert _positive(row, TIMES), row
        assert "error" not in row
        baseline = ("baseline_dispatch_us", "baseline_combine_us")
        if label.startswith("ll"):                       # --baseline ll, the default
            assert _positive(row, baseline), row
        else:
            assert not any(c in row for c in baseline), row
    assert result["meta"]["device"] == "CPU (kernel emulator)"
    assert "gloo, 2 processes" in result["meta"]["baseline"]
    assert result["failed"] == []
    # one JSON and one log per step that ran, all a device tool brings back
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu_check.json"] + [f"gpu_check_{s}.log" for s in sorted(STEPS[:-1])]
    for name in STEPS[:-1]:
        assert steps[name]["log"] == f"gpu_check_{name}.log"
        assert (tmp_path / steps[name]["log"]).stat().st_size > 0
    assert "PASSED" in (tmp_path / "gpu_check_tests.log").read_text()
    lines = done.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["mode", "ranks"])
    assert [ln.split()[0] for ln in lines[header + 1:header + 5]] == ["normal"] * 2 + ["ll"] * 2


def test_a_failure_does_not_hide_the_rest(tmp_path):
    """A failing step (tests) and a failing spec (normal-fp8, in timing and baseline): both
    recorded with their message, every other step and row still there, exit code 1."""
    done, result = _dry_run(tmp_path, "--inject-failure", "tests", "--inject-failure",
                            "normal-fp8", "--baseline", "all", "--iters", "1",
                            "--baseline-iters", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    steps = result["steps"]
    assert list(steps) == STEPS
    assert steps["tests"]["status"] == "failed" and steps["tests"]["rc"] == 3
    assert "injected failure in step tests" in steps["tests"]["tail"]
    assert steps["build"]["status"] == "ok"
    assert steps["timing"]["status"] == "failed"          # one of its specs failed
    assert steps["baseline"]["status"] == "failed"
    rows = _rows(result)
    assert list(rows) == SPECS
    bad = rows["normal-fp8"]
    assert "injected failure in normal-fp8" in bad["error"]
    assert "InjectedFailure" in bad["traceback"] and "dispatch_us" not in bad
    for label in ("normal-bfloat16", "ll-fp8", "ll-bfloat16"):
        assert _positive(rows[label], TIMES + ("baseline_dispatch_us", "baseline_combine_us"))
    [failed_baseline] = steps["baseline"]["failures"]
    assert failed_baseline["spec"] == "normal-fp8"
    assert "injected failure in normal-fp8" in failed_baseline["error"]
    assert result["failed"] == ["tests", "timing", "baseline", "normal-fp8"]
    assert "normal-fp8: InjectedFailure: injected failure" in done.stdout
    assert "FAILED: tests, timing, baseline, normal-fp8" in done.stdout


def test_a_step_past_its_deadline_is_killed_and_keeps_its_log(tmp_path):
    """The step and every process it started die at the deadline; what it printed before
    stays in its log and its record says where it was."""
    gc = _load()
    args = gc.parse_args(["--dry-run", "--json", str(tmp_path / "gpu_check.json")])
    run = gc.Run(args, gc.DRY_SHAPE)
    hang = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('child', p.pid, flush=True); print('tests/test_x.py::test_hangs ', "
            "end='', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    rec, text = gc.run_step(run, "tests", [sys.executable, "-c", hang], 3,
                            gc.step_env(args, args.cache_dir))
    assert time.monotonic() - t0 < 20
    assert rec["status"] == "timeout" and rec["rc"] == "timeout"
    assert rec["error"].endswith("its log ends with: tests/test_x.py::test_hangs"), rec
    log = (tmp_path / "gpu_check_tests.log").read_text()
    assert log == text and "child" in log
    child = int(re.search(r"child (\d+)", log).group(1))
    for _ in range(50):                                   # killed with its step's group
        if not os.path.exists(f"/proc/{child}") or \
                open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the step")
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["steps"]["tests"]["status"] == "running"  # saved before the step began


def test_a_failing_test_is_reported_the_moment_it_fails(tmp_path):
    """The tests step's pytest may be killed at its deadline before it prints tracebacks (the
    first GPU run lost six that way): tests/conftest.py writes each failure as a result line at
    once, which the step reads into the JSON."""
    (tmp_path / "test_planted.py").write_text(
        "def test_fails():\n    assert 1 == 2, 'planted failure'\n\n"
        "def test_passes():\n    pass\n")
    gpu_check = _load()
    env = dict(os.environ, MOE_COMM_FAILURE_PREFIX=gpu_check.MARK,
               PYTHONPATH=os.path.join(ROOT, "tests"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "conftest",
                           "-p", "no:cacheprovider", str(tmp_path / "test_planted.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    found = [r for r in gpu_check.read_results(done.stdout) if r["kind"] == "test_failure"]
    assert [(r["test"], r["when"]) for r in found] == [("test_planted.py::test_fails", "call")]
    assert "planted failure" in found[0]["error"]
    assert "planted failure" in found[0]["message"]
