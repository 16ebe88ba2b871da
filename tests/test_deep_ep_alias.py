"""``import deep_ep`` answered by moe_comm (moe_comm/deep_ep_alias.py): an unchanged DeepEP
client runs on 2 real rank processes once the shim folder is on PYTHONPATH, nothing answers
without that opt-in, and the alias refuses to stand in for a real DeepEP."""
from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import moe_comm
from moe_comm import deep_ep_alias
from moe_comm.testing.processes import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "deep_ep_clients" / "intranode.py"


def _run(args, *path, timeout=180):
    """``python args`` in a fresh process whose module path starts with ``path`` (then
    moe_comm's own folder, so the checkout under test is the one imported)."""
    entries = [str(p) for p in path] + [str(ROOT)] + \
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(entries), MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture
def fake_deep_ep(tmp_path):
    """A folder holding a stand-in for a real DeepEP install."""
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    return tmp_path


@pytest.fixture
def clean_import_state(monkeypatch):
    """sys.path and sys.modules['deep_ep'] restored after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    yield monkeypatch
    sys.modules.pop("deep_ep", None)


def test_unchanged_deep_ep_client_runs_on_moe_comm():
    assert deep_ep_alias.find_real_deep_ep() is None, "a real DeepEP is installed here"
    r = _run([str(CLIENT), "--num-processes", "2"], deep_ep_alias.SHIM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(2):
        assert f"rank {rank}: passed (moe_comm.buffer.Buffer)" in r.stdout, r.stdout + r.stderr


def test_nothing_answers_deep_ep_without_the_opt_in():
    if deep_ep_alias.find_real_deep_ep() is not None:
        pytest.skip("a real DeepEP is installed here")
    r = _run(["-c", "import moe_comm, deep_ep"])
    assert r.returncode != 0 and "No module named 'deep_ep'" in r.stderr, r.stderr


def test_alias_names_deep_eps_api():
    r = _run(["-c", "from deep_ep import Buffer, Config, EventOverlap, topk_idx_t; "
                    "import moe_comm, torch; "
                    "assert (Buffer, Config, EventOverlap) == "
                    "(moe_comm.Buffer, moe_comm.Config, moe_comm.EventOverlap); "
                    "assert topk_idx_t is torch.int64"], deep_ep_alias.SHIM_DIR)
    assert r.returncode == 0, r.stderr


def test_shim_refuses_to_shadow_a_real_deep_ep(fake_deep_ep):
    # the shim folder first, as the opt-in puts it: the real one behind it is still found
    r = _run(["-c", "import deep_ep"], deep_ep_alias.SHIM_DIR, fake_deep_ep)
    assert r.returncode != 0
    assert "RealDeepEPInstalledError" in r.stderr and str(fake_deep_ep) in r.stderr, r.stderr
    r = _run(["-m", "moe_comm.deep_ep_alias"], fake_deep_ep)
    assert r.returncode == 1 and r.stdout.strip() == str(deep_ep_alias.SHIM_DIR)
    assert str(fake_deep_ep) in r.stderr


def test_install_refuses_to_shadow_a_real_deep_ep(fake_deep_ep, clean_import_state):
    clean_import_state.syspath_prepend(str(fake_deep_ep))
    spec = deep_ep_alias.find_real_deep_ep()
    assert spec is not None and pathlib.Path(spec.origin).parent.parent == fake_deep_ep
    with pytest.raises(deep_ep_alias.RealDeepEPInstalledError, match=str(fake_deep_ep)):
        deep_ep_alias.install()
    assert str(deep_ep_alias.SHIM_DIR) not in sys.path


def test_install_refuses_once_a_real_deep_ep_is_imported(fake_deep_ep, clean_import_state):
    clean_import_state.syspath_prepend(str(fake_deep_ep))
    importlib.import_module("deep_ep")     # the stand-in, imported by someone else
    clean_import_state.setattr(sys, "path", [p for p in sys.path if p != str(fake_deep_ep)])
    with pytest.raises(deep_ep_alias.RealDeepEPInstalledError, match="already imported"):
        deep_ep_alias.install()


def test_install_in_process(clean_import_state):
    deep_ep_alias.install()
    deep_ep_alias.install()                      # a second call changes nothing
    assert sys.path.count(str(deep_ep_alias.SHIM_DIR)) == 1
    deep_ep = importlib.import_module("deep_ep")
    assert deep_ep.__file__ == str(deep_ep_alias.SHIM_PACKAGE / "__init__.py")
    assert deep_ep.Buffer is moe_comm.Buffer and deep_ep.Config is moe_comm.Config
