"""bench/bench_all_to_all.py as a command: a tiny sweep end to end (2 ranks, both modes, --json,
--plot when matplotlib is installed; --no-mpi: forked ranks, the path of a machine without MPI,
which tests/test_bench_mpi.py complements), plus the pieces that need no ranks (case list,
summary, progress line, argument errors)."""
import importlib.util
import io
import json
import statistics
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench_all_to_all.py")
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _load():
    spec = importlib.util.spec_from_file_location("bench_all_to_all", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_tiny_sweep_end_to_end(tmp_path):
    out = tmp_path / "sub" / "rows.json"           # the folder does not exist yet
    png = tmp_path / "plot.png"
    args = ["--mode", "both", "--ranks", "2", "--tokens", "16,32", "--hidden", "256",
            "--topk", "4", "--experts", "8", "--iters", "2", "--backend", "host",
            "--no-mpi", "--json", str(out)]
    if HAVE_MPL:
        args += ["--plot", str(png)]
    r = _run(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == list(bench.COLUMNS)
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert [(row["mode"], row["tokens"]) for row in rows] == [
        ("normal", 16), ("normal", 32), ("ll", 16), ("ll", 32)]
    for row in rows:
        assert set(bench.COLUMNS) <= set(row), set(bench.COLUMNS) - set(row)
        assert (row["ranks"], row["hidden"], row["topk"], row["experts"]) == (2, 256, 4, 8)
        assert row["dtype"] == ("bfloat16" if row["mode"] == "normal" else "fp8")
        assert row["backend"] == "host"
        for c in bench.COLUMNS[7:]:
            assert isinstance(row[c], float) and row[c] > 0, (c, row)
        for c in bench.MPI_COLUMNS:
            assert row[c] is None, (c, row)
        times = [c for c in bench.COLUMNS[7:] if c.endswith("_us")]
        assert set(row["spread_us"]) == set(times), row["spread_us"]
        for c in times:
            spread = row["spread_us"][c]
            assert 0 < spread["min"] <= spread["median"] == row[c] <= spread["max"], (c, spread)
        # copy bandwidth: sampled around moe_comm's calls and after the baseline's
        assert len(row["copy_gbps_samples"]) == 4, row
        samples = row["copy_gbps_samples"]
        assert row["dispatch_copy_gbps"] == pytest.approx((samples[0] + samples[1]) / 2)
        assert row["combine_copy_gbps"] == pytest.approx((samples[1] + samples[2]) / 2)
        assert row["copy_gbps_min"] <= row["copy_gbps"] <= row["copy_gbps_max"], row
        # moe_comm's repeats, each against the copy samples around it
        for op in ("dispatch", "combine"):
            paired = row["paired"][op]
            assert len(paired["shares"]) == len(paired["copy_gbps"]) == len(paired["us"]) \
                == bench.PAIRED_REPEATS
            assert min(paired["copy_gbps"]) > 0, paired
            # a repeat's share: its GB/s (the row's bytes over its time) over its bar
            nbytes = row[f"{op}_gbps"] * row[f"{op}_us"] * 1e3
            assert paired["shares"] == pytest.approx(
                [nbytes / (us * 1e3) / g for us, g in zip(paired["us"], paired["copy_gbps"])])
            assert row[f"{op}_copy_share"] == statistics.median(paired["shares"])
            assert row[f"{op}_us"] == statistics.median(paired["us"])
    run = saved["run"]
    assert run["versions"]["torch"] == torch.__version__ and run["versions"]["mpi"] is None
    assert run["versions"]["moe_comm"] and run["versions"]["python"]
    assert run["machine"]["cores"] >= 1 and "cpu_model" in run["machine"]
    assert (run["iters"], run["repeats"], run["backend"]) == (2, bench.REPEATS, "host")
    assert run["paired_repeats"] == bench.PAIRED_REPEATS
    assert run["copy_gbps"]["samples"] == 4 * len(rows)
    assert run["copy_gbps"]["min"] <= run["copy_gbps"]["median"] <= run["copy_gbps"]["max"]
    assert len(lines) == 1 + len(rows) + 3 + (1 if HAVE_MPL else 0), r.stdout
    for mode in ("normal", "ll"):
        summary = [ln for ln in lines if ln.startswith(f"summary {mode}, geometric mean of 2")]
        assert len(summary) == 1, r.stdout
        assert "speed-up over" in summary[0] and "of copy bandwidth" in summary[0]
        assert "Best / worst" in summary[0]
    assert lines[1 + len(rows) + 2].startswith("summary copy bandwidth: median "), r.stdout
    # no progress line (stderr is a pipe); the one note says why the MPI columns are empty
    assert r.stderr.splitlines() == [
        "note: no MPI baseline (mpi_dispatch_us, mpi_combine_us are None): --no-mpi"], r.stderr
    if HAVE_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_build_cases_cross_product_and_problems():
    cases = bench.build_cases(["normal", "ll"], [2, 4], [64, 128], [256], [4], [8, 6],
                              ["bfloat16", "float32"])
    assert len(cases) == 2 * 2 * 2 * 2 * 2
    assert all("nvl_bytes" in c for c in cases if c["mode"] == "normal")
    problems = {(c["mode"], c["ranks"], c["experts"], c["dtype"]): bench.case_problem(c)
                for c in cases}
    assert problems[("normal", 2, 8, "float32")] is None
    assert "divide" in problems[("normal", 4, 6, "bfloat16")]
    assert "bfloat16 or fp8" in problems[("ll", 2, 8, "float32")]
    defaults = bench.build_cases(["normal", "ll"], [4])
    assert [(c["mode"], c["tokens"], c["hidden"], c["dtype"]) for c in defaults] == [
        ("normal", 1024, 7168, "bfloat16"), ("ll", 128, 7168, "fp8")]
    # --buffer-mb: normal mode's buffer, else the hint for one copy of the batch
    small = bench.build_cases(["normal"], [4], buffer_bytes=1 << 20)
    assert small[0]["nvl_bytes"] == 1 << 20 < defaults[0]["nvl_bytes"]


def _row(mode, tokens, speed_d, speed_c, share):
    return dict(mode=mode, ranks=2, tokens=tokens, hidden=256, topk=4, experts=8,
                dtype="bfloat16", dispatch_us=100.0, combine_us=100.0, dispatch_gbps=share,
                combine_gbps=1.0, baseline_dispatch_us=100.0 * speed_d,
                baseline_combine_us=100.0 * speed_c, copy_gbps=1.0)


def test_summary_geometric_mean_best_worst():
    one = bench.summarize([_row("normal", 64, 8.0, 2.0, 0.5)])
    assert one == ["summary normal ranks=2 tokens=64: dispatch 8.0x / combine 2.0x speed-up "
                   "over all_to_all_single; dispatch / combine at 50% / 100% of copy bandwidth"]
    lines = bench.summarize([_row("ll", 64, 2.0, 1.0, 0.02), _row("ll", 128, 8.0, 4.0, 0.5)])
    assert len(lines) == 1
    assert lines[0].startswith("summary ll, geometric mean of 2 cases: dispatch 4.0x / combine "
                               "2.0x speed-up over the padded")
    assert "dispatch / combine at 10% / 100% of copy bandwidth" in lines[0]
    assert "dispatch 8.0x (tokens=128) / 2.0x (tokens=64)" in lines[0]
    assert "dispatch vs copy 50% (tokens=128) / 2% (tokens=64)" in lines[0]
    # shares paired repeat by repeat with the copy samples around them stand first
    paired = dict(_row("normal", 64, 8.0, 2.0, 0.5), dispatch_copy_share=0.25,
                  combine_copy_share=0.75)
    assert bench.summarize([paired])[0].endswith("dispatch / combine at 25% / 75% of copy "
                                                 "bandwidth")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_summary_with_mpi_gives_both_speed_ups():
    rows = [dict(_row("normal", 64, 4.0, 2.0, 0.5), mpi_dispatch_us=300.0, mpi_combine_us=50.0)]
    assert bench.summarize(rows) == [
        "summary normal ranks=2 tokens=64: dispatch 4.0x / combine 2.0x speed-up over "
        "all_to_all_single, 3.0x / 0.5x over MPICH Alltoallv; dispatch / combine at 50% / "
        "100% of copy bandwidth"]
    rows[0]["mpi_dispatch_us"] = None              # MPI absent: the line is unchanged
    assert bench.summarize(rows)[0].endswith("over all_to_all_single; dispatch / combine at "
                                             "50% / 100% of copy bandwidth")
    rows = [dict(_row("ll", 64, 1, 1, 1), copy_gbps_samples=s) for s in ([4.0, 9.0], [1.0])]
    assert bench.copy_line(rows) == ("summary copy bandwidth: median 4.0 GB/s over 3 samples "
                                     "(min 1.0, max 9.0)")


def test_progress_line_only_on_a_terminal():
    tty = _Tty()
    p = bench.Progress(3, stream=tty, interval=60)
    p.start(0, "normal R=2")
    p.print("row", file=io.StringIO())
    p.finish(0)
    p.start(1, "ll R=2")
    p.close()
    text = tty.getvalue()
    assert "case 1/3" in text and "case 2/3" in text and "0:00 elapsed" in text
    assert "ll R=2" in text and text.endswith("\r\033[K")
    for stream, enabled in ((io.StringIO(), True), (_Tty(), False)):   # pipe, or --quiet
        q = bench.Progress(3, stream=stream, enabled=enabled)
        q.start(0, "x")
        q.close()
        assert stream.getvalue() == ""


def _error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        bench.main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, f"{e.value.code}\n{err}", out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_backend_without_gpu_is_a_clear_error(capsys):
    code, err, _ = _error(capsys, "--backend", "cuda", "--ranks", "2")
    assert code == 2 and "--backend cuda needs a CUDA GPU" in err


def test_bad_lists_are_rejected(capsys):
    code, err, _ = _error(capsys, "--ranks", "2,x")
    assert code == 2 and "comma list of ints" in err
    code, err, _ = _error(capsys, "--dtype", "int8")
    assert code == 2 and "invalid choice 'int8'" in err
    code, err, _ = _error(capsys, "--ranks", "4", "--experts", "6")
    assert code == 2 and "no case can run" in err
    code, err, _ = _error(capsys, "--buffer-mb", "0")
    assert code == 2 and "--buffer-mb must be positive" in err


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib fails
    _, err, out = _error(capsys, "--ranks", "2", "--plot", str(tmp_path / "p.png"))
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err
    assert out == ""                                           # refused before the sweep


def test_summary_and_table_carry_the_wire_ratio():
    rows = [dict(_row("normal", 64, 4.0, 2.0, 0.5), wire_ratio=1.03),
            dict(_row("normal", 128, 4.0, 2.0, 0.5), wire_ratio=1.07)]
    assert "host links carried 1.07x the ideal bytes (worst case)" in bench.summarize(rows)[0]
    assert bench.format_header(False, True).split()[-1] == "wire_ratio"
    assert bench.format_row(rows[0], False, True).split()[-1] == "1.0"


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_a_ranks_sweep_is_plotted_against_the_rank_count(tmp_path, monkeypatch):
    """--ranks 2,4,8 at one token count: the panels' x axis is the rank count."""
    import matplotlib.axes
    labels = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel",
                        lambda self, text, *a, **k: labels.append(text))
    rows = [dict(_row(m, 64, 2.0, 2.0, 0.5), ranks=n) for m in ("normal", "ll")
            for n in (2, 4, 8)]
    bench.plot(rows, str(tmp_path / "ranks.png"))
    assert (tmp_path / "ranks.png").stat().st_size > 0
    assert set(labels) == {"ranks"}


@pytest.mark.parametrize("mode,names", [("normal", ["dispatch", "combine", "cached"]),
                                        ("ll", ["ll", "ll"])])
def test_small_calls_loop_runs_and_reports_every_call(mode, names):
    script = os.path.join(os.path.dirname(BENCH), "small_calls.py")
    done = subprocess.run([sys.executable, script, "--mode", mode, "--ranks", "2", "--tokens",
                           "8", "--hidden", "128", "--calls", "5"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == names, done.stdout
    assert all(float(r[-1]) > 0 for r in rows), done.stdout
