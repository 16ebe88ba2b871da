"""MOE_COMM_LOG_LEVEL (moe_comm/logs.py): the level of the ``moe_comm`` logger, a stderr
handler that steps aside for the application's own logging, and the records a Buffer leaves
at INFO and DEBUG."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from moe_comm import logs


@pytest.fixture
def saved_logger():
    """The ``moe_comm`` and root loggers' level and handlers, restored after the test."""
    root = logging.getLogger()
    state = (logs.log.level, list(logs.log.handlers), list(root.handlers))
    yield logs.log
    logs.log.setLevel(state[0])
    logs.log.handlers[:] = state[1]
    root.handlers[:] = state[2]


@pytest.mark.parametrize("text, level", [("INFO", logging.INFO), ("debug", logging.DEBUG),
                                         (" Warning ", logging.WARNING), ("15", 15),
                                         ("verbose", None), ("", None)])
def test_parse_level(text, level):
    assert logs.parse_level(text) == level


def test_unset_changes_nothing(saved_logger):
    before = (saved_logger.level, list(saved_logger.handlers))
    assert logs.apply_env_level({}) is None
    assert (saved_logger.level, saved_logger.handlers) == before


def test_level_and_one_handler(saved_logger):
    saved_logger.handlers[:] = []
    assert logs.apply_env_level({logs.ENV: "debug"}) == logging.DEBUG
    assert logs.apply_env_level({logs.ENV: "INFO"}) == logging.INFO     # applied again
    assert saved_logger.level == logging.INFO
    assert [type(h) for h in saved_logger.handlers] == [logs.FallbackHandler]


def test_a_typo_warns_and_changes_nothing(saved_logger):
    before = saved_logger.level
    with pytest.warns(UserWarning, match=logs.ENV):
        assert logs.apply_env_level({logs.ENV: "LOUD"}) is None
    assert saved_logger.level == before


def test_fallback_steps_aside_for_the_applications_logging(saved_logger, capsys):
    saved_logger.handlers[:] = []
    logging.getLogger().handlers[:] = []
    logs.apply_env_level({logs.ENV: "INFO"})
    logging.getLogger("moe_comm.transport").info("first")
    assert "moe_comm.transport INFO first" in capsys.readouterr().err
    app = logging.StreamHandler(sys.stdout)
    logging.getLogger().addHandler(app)       # the application configures logging later
    logging.getLogger("moe_comm").info("second")
    out, err = capsys.readouterr()
    assert "second" in out and "second" not in err      # once, through the application's


def test_buffer_logs_backend_sizes_and_deadline():
    code = ("import torch.distributed as dist, moe_comm\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, "
            "world_size=1)\n"
            "moe_comm.Buffer(None, 8 << 20, timeout_s=30).destroy()\n")
    env = dict(os.environ, MOE_COMM_LOG_LEVEL="DEBUG")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "INFO moe_comm rank 0 of 1: HostBackend on cpu, 8388608 NVL + 0 RDMA bytes, " \
           "waits time out after 30 s" in r.stderr, r.stderr
    assert "1 rank(s) share this host's memory" in r.stderr, r.stderr
    quiet = {k: v for k, v in os.environ.items() if k != logs.ENV}
    r = subprocess.run([sys.executable, "-c", code], env=quiet, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "HostBackend" not in r.stderr, r.stderr
