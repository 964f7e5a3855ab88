"""A forkserver's client closed twice (Ctrl-C closes it at once, the gate's end again) closes its pipe once: the
second close must not close whatever file took the freed descriptor number since (a log, a case's pipe)."""

from __future__ import annotations

import os

from repro.run import forkclient
from tests.commands import ROOT, isolated_env


def test_closing_a_forkserver_twice_leaves_a_reused_descriptor_open(tmp_path):
    env = {**isolated_env(tmp_path), "PYTHONPATH": str(ROOT)}
    fs = forkclient.ForkServer("t", env, tmp_path / "fs.log", ("json",), frozenset(), frozenset({"json:dumps"}))
    assert fs.wait_ready(60), fs.failed
    fs.close()
    r, w = os.pipe()  # the lowest free numbers: the request pipe's among them (the OS's choice)
    try:
        fs.close()
        for fd in (r, w):
            os.fstat(fd)  # still open
    finally:
        os.close(r)
        os.close(w)
