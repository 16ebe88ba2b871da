"""``import deep_ep`` answered by moe_comm, for DeepEP clients that are not to be edited.

Opt in by putting the shim folder (:data:`SHIM_DIR`, which holds one package, ``deep_ep``)
first on the module path of every rank's process:

    export PYTHONPATH="$(python -m moe_comm.deep_ep_alias)${PYTHONPATH:+:$PYTHONPATH}"
    torchrun --nproc-per-node 8 train.py          # its `import deep_ep` now gets moe_comm

or, inside a launcher that may not change the environment, call :func:`install` before the
client imports ``deep_ep`` (processes it starts with multiprocessing's spawn inherit the path).
An environment variable is the switch rather than an import hook because it reaches every
process a launcher starts (torchrun, mp.spawn, srun) and changes nothing for anyone else.

It never stands in for a real DeepEP: where one is installed, importing the shim (and
:func:`install`) raises :class:`RealDeepEPInstalledError`, naming both, instead of silently
picking one of them.
"""
from __future__ import annotations

import importlib.machinery
from pathlib import Path
import sys

import torch

from .buffer import Buffer
from .config import Config
from .event import EventOverlap

# the folder to put on the path: it holds deep_ep/__init__.py and nothing else importable
SHIM_DIR = Path(__file__).resolve().parent / "deep_ep_shim"
SHIM_PACKAGE = SHIM_DIR / "deep_ep"

# DeepEP's dtype of top-k expert ids (deep_ep.topk_idx_t); moe_comm takes int64 ids
topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]


class RealDeepEPInstalledError(ImportError):
    """The moe_comm alias was asked for while a real DeepEP is importable too."""


def _is_shim_dir(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == SHIM_DIR
    except OSError:
        return False


def _is_shim(spec) -> bool:
    origin = getattr(spec, "origin", None)
    return origin is not None and Path(origin).resolve().parent == SHIM_PACKAGE


def find_real_deep_ep():
    """The import spec of a ``deep_ep`` that is not this shim (a real DeepEP), or None.

    What ``importlib.util.find_spec("deep_ep")`` would find with the shim folder taken off
    the path: the path finder searches the remaining entries, and every other finder on
    ``sys.meta_path`` (editable installs add their own) is asked as well."""
    others = [p for p in sys.path if not _is_shim_dir(p)]
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        path_based = finder is importlib.machinery.PathFinder
        spec = find_spec("deep_ep", others) if path_based else find_spec("deep_ep", None)
        if spec is not None and not _is_shim(spec):
            return spec
    return None


def refuse_to_shadow() -> None:
    """Raises :class:`RealDeepEPInstalledError` where a real DeepEP is importable."""
    spec = find_real_deep_ep()
    if spec is None:
        return
    where = spec.origin or ", ".join(spec.submodule_search_locations or []) or spec.name
    raise RealDeepEPInstalledError(
        f"moe_comm's deep_ep alias is switched on ({SHIM_DIR} is on the module path), but a "
        f"real DeepEP is installed at {where}. moe_comm does not stand in for an installed "
        f"DeepEP: take {SHIM_DIR} off PYTHONPATH to use DeepEP, or uninstall DeepEP "
        "(pip uninstall deep_ep) to use moe_comm under that name.")


def install() -> None:
    """Switch the alias on in this process (and in processes it spawns): after a check that
    no real DeepEP is importable, the shim folder goes first on ``sys.path``."""
    loaded = sys.modules.get("deep_ep")
    if loaded is not None and not _is_shim(getattr(loaded, "__spec__", None)):
        raise RealDeepEPInstalledError(
            f"deep_ep is already imported from {getattr(loaded, '__file__', loaded)!r}, "
            "which is not moe_comm's alias; call install() before anything imports deep_ep")
    refuse_to_shadow()
    if not any(_is_shim_dir(p) for p in sys.path):
        sys.path.insert(0, str(SHIM_DIR))


def main() -> int:
    """``python -m moe_comm.deep_ep_alias``: print the folder to put on PYTHONPATH (and warn on
    stderr, exit status 1, where a real DeepEP would make the alias refuse)."""
    print(SHIM_DIR)
    try:
        refuse_to_shadow()
    except RealDeepEPInstalledError as e:
        print(f"warning: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
