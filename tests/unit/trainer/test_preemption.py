"""Stop signals: one signal is a request, repeats within the window are the same one, a later one exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcore_agentic.trainer.preemption import EXIT_PREEMPTED, StopSignals, TrainingStopped, parse_signals
from tests.helpers.distributed import run_distributed

REPO = Path(__file__).resolve().parents[3]


def test_parse_signals():
    assert parse_signals(["SIGTERM", "usr1", "12"]) == [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2]
    with pytest.raises(ValueError, match="SIGFOO"):
        parse_signals(["SIGFOO"])
    with pytest.raises(ValueError, match="cannot be caught"):
        parse_signals(["SIGKILL"])


def test_stopped_message_names_signal_step_checkpoint_and_code():
    text = str(TrainingStopped(4, "SIGTERM", "/ckpt/global_step_4"))
    assert text == ("stopped on SIGTERM after step 4: checkpoint /ckpt/global_step_4; run the same command to resume "
                    f"(exit code {EXIT_PREEMPTED})")


# The main thread waits on a TCPStore key that never comes: a C++ wait that Python signal
# handlers cannot interrupt (like a collective whose peer is still busy).
_BLOCKED = textwrap.dedent(
    """
    import datetime, sys, time
    import torch.distributed as dist
    from mcore_agentic.trainer.preemption import StopSignals

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    with StopSignals(["SIGTERM"], repeat_window_s=1.5) as stop:
        print("ready", flush=True)
        while not stop.requested:
            time.sleep(0.01)
        print("requested", flush=True)
        try:
            store.wait(["never"], datetime.timedelta(seconds=40))
        finally:
            print("the wait returned", flush=True)
    """
)


def test_repeat_within_window_is_the_same_signal_and_a_later_one_exits_while_blocked(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "requested"
        proc.send_signal(signal.SIGTERM)  # a second delivery of the same preemption (torchrun forwarding it)
        time.sleep(0.5)
        assert proc.poll() is None, "a repeat within the window must not force the exit"
        time.sleep(1.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = proc.communicate()
    assert code == 128 + signal.SIGTERM and elapsed < 3.0
    assert "the wait returned" not in out  # it exited from inside the blocked wait
    assert "received SIGTERM" in err and "second SIGTERM: exiting now without a checkpoint" in err


def _poll_body(rank: int, world_size: int) -> list:
    with StopSignals(["SIGUSR1"], save_every_minutes=0.001) as stop:  # 60 ms
        first = stop.poll()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 10
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.1)
        second = stop.poll()
        stop.saved()
        third = stop.poll()
        return [first, second, third, stop.signal_name]


def test_poll_agrees_across_ranks_when_only_one_was_signalled():
    r0, r1 = run_distributed(_poll_body, world_size=2)
    assert r0[:3] == r1[:3] == [(False, False), (True, True), (True, False)]
    assert r1[3] == "SIGUSR1" and r0[3] == "a stop signal to another rank"


_BLOCKED_WITH_SANDBOX = textwrap.dedent(
    """
    import datetime, threading, time
    import torch.distributed as dist
    from mcore_agentic.trainer.preemption import StopSignals
    from tests.unit.tools.test_sandbox_escapes import make_tool, model_call

    tool = make_tool(warm_pool=1, timeout_s=60)
    threading.Thread(target=model_call, args=(tool, "import time\\ntime.sleep(60)"), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    with StopSignals(["SIGTERM"], repeat_window_s=0.2) as stop:
        time.sleep(1.0)  # the execution is running
        print("ready", flush=True)
        while not stop.requested:
            time.sleep(0.01)
        store.wait(["never"], datetime.timedelta(seconds=40))
    """
)


def test_an_immediate_exit_kills_running_sandboxes_and_leaves_no_host_state():
    """The second signal's exit skips atexit: the code sandboxes are closed on the way out all the same."""
    from tests.unit.tools.test_sandbox_host import _bootstrap_pids_of, _state_of

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_WITH_SANDBOX], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.poll() is not None else ""
        before = set(_bootstrap_pids_of(proc.pid))  # this trainer's sandboxes only (the suite may hold others)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGTERM, proc.stderr.read()
    assert before, "the execution and the warm sandbox should have been running"
    time.sleep(0.2)
    assert [pid for pid in before if Path(f"/proc/{pid}").exists()] == []
    assert _state_of(proc.pid) == []
