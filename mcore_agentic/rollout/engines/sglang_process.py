"""What SGLang's start-up changes in the trainer's process and the SGLang adapter puts back
(:mod:`~mcore_agentic.rollout.engines.sglang`'s module docstring, "Process state"): SIGQUIT/SIGTERM handlers and
the NCCL environment."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

CONTAINED_SIGNALS: tuple[str, ...] = ("SIGQUIT", "SIGTERM")
"""Signals whose handlers SGLang replaces in this process (its start-up, its tokenizer manager's event loop)."""
CONTAINED_ENV_PREFIXES: tuple[str, ...] = ("NCCL_", "TORCH_NCCL_")
CONTAINED_ENV_KEYS: tuple[str, ...] = ("CUDA_DEVICE_MAX_CONNECTIONS",)
"""Environment variables of the trainer's NCCL and Megatron that SGLang's start-up may write."""


def _contained_env_key(key: str) -> bool:
    return key in CONTAINED_ENV_KEYS or key.startswith(CONTAINED_ENV_PREFIXES)


@dataclass
class ProcessState:
    """The trainer's SIGQUIT/SIGTERM handlers and NCCL environment, captured before SGLang starts and put back after."""

    handlers: dict[int, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> ProcessState:
        handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # SGLang installs handlers from there only
            for name in CONTAINED_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    handlers[int(sig)] = signal.getsignal(sig)
        return cls(handlers, {k: v for k, v in os.environ.items() if _contained_env_key(k)})

    def restore(self, loop: asyncio.AbstractEventLoop | None = None) -> list[str]:
        """Remove ``loop``'s handlers of the captured signals, put the captured handlers and environment back;
        returns the names of what was changed."""
        changed: list[str] = []
        for sig, handler in self.handlers.items():
            name = signal.Signals(sig).name
            if loop is not None:
                try:
                    if loop.remove_signal_handler(sig):
                        changed.append(f"{name} (event loop)")
                except (NotImplementedError, RuntimeError, ValueError):  # a loop without signal support
                    pass
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
                changed.append(name)
        now = {k for k in os.environ if _contained_env_key(k)}
        for key in sorted(now | set(self.env)):
            before = self.env.get(key)
            if os.environ.get(key) == before:
                continue
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before
            changed.append(key)
        return changed


__all__ = ["CONTAINED_ENV_KEYS", "CONTAINED_ENV_PREFIXES", "CONTAINED_SIGNALS", "ProcessState"]
