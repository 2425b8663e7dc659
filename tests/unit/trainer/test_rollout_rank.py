"""A rollout rank under separate placement leaves the stop signal to the trainer: the first one is logged and the
rank serves on (the trainer saves at its step boundary, with this rank's part, then stops it); a second one, past
the repeat window, exits at once with 128 + the signal's number."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time


def test_the_first_stop_signal_is_the_trainers_to_act_on(caplog) -> None:
    from mcore_agentic.trainer.rollout_rank import defer_stop_signals

    before = signal.getsignal(signal.SIGUSR1)
    try:
        with caplog.at_level(logging.WARNING, logger="mcore_agentic.trainer.rollout_rank"):
            defer_stop_signals(["SIGUSR1"])
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)  # the handler runs on the main thread at its next bytecode
        assert any("SIGUSR1 received; it serves on until the trainer" in r.getMessage() for r in caplog.records)
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_second_stop_signal_exits_at_once() -> None:
    code = textwrap.dedent("""
        import os, signal, time
        from mcore_agentic.trainer import preemption
        preemption.REPEAT_WINDOW_S = 0.1
        from mcore_agentic.trainer.rollout_rank import defer_stop_signals
        defer_stop_signals(["SIGUSR1"])
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
        print("still here")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGUSR1 and "still here" not in done.stdout, done.stderr[-2000:]
