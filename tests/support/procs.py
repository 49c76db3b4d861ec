"""Commands the tests start that may hang: mpiexec and its ranks, which wait for each other."""

import os
import signal
import subprocess

import pytest


def run_in_own_session(cmd, env, cwd, timeout):
    """Runs cmd in a session of its own and returns the CompletedProcess. One still running after
    `timeout` is killed with its whole process group (mpiexec's ranks too, which would otherwise
    hold the pipes open) and fails the test with what it printed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} still running after {timeout} s (ranks wait for each other)\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
