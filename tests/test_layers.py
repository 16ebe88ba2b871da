"""The package's structure holds (tools/import_report.py): no import cycles, no module imports
a higher layer of docs/ARCHITECTURE.md's picture, and no import hides inside a function
(optional dependencies are imported only in moe_comm/deps)."""
from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_report", ROOT / "tools" / "import_report.py")
import_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_report)


def test_no_cycles_no_layer_violations_no_hidden_imports():
    modules, cycles, violations, nested = import_report.report()
    assert len(modules) > 50                      # the scan saw the package
    assert cycles == []
    assert violations == []
    assert nested == []


def test_every_folder_is_in_a_layer():
    for path in (ROOT / "moe_comm").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            import_report.layer_of(f"moe_comm.{path.name}.x")


def test_a_violation_is_seen():
    """The checker is not vacuous: an upward import and a cycle are reported."""
    edges = {"moe_comm.shm.segment": {"moe_comm.buffer"}, "moe_comm.buffer": set()}
    assert import_report.violations(edges) == [("moe_comm.shm.segment", "moe_comm.buffer")]
    assert import_report.cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
