"""What a rollout leader's agent programs share (:class:`AgentHost`): the session endpoint's server and registry, the
command runner, and the thread whose event loop runs every program (a program outlives a round under partial
rollouts). :mod:`.source`'s sources run their episodes on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from mcore_agentic.endpoint.programs import CommandRunner, load_entrypoint
from mcore_agentic.endpoint.server import EndpointServer, Limits, SessionRegistry, build_app
from mcore_agentic.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)


class AgentHost:
    """What a rollout leader's agent programs share: the endpoint's server and session registry, the command runner,
    and the thread whose event loop runs every program (a program outlives a round under partial rollouts)."""

    def __init__(self, cfg: RolloutConfig):
        a = cfg.agent
        self.cfg = cfg
        self.entry = load_entrypoint(a.entrypoint) if a.entrypoint else None
        # How commands run (rollout.agent.sandbox, workdir, reward_command); a sandbox is proved to work here now.
        self.runner = CommandRunner.from_config(a) if a.command else None
        if a.command and a.sandbox == "none":
            logger.warning("rollout.agent.command runs on this host as the trainer's user (rollout.agent.sandbox=none): "
                           "a harness that runs the model's shell commands should run with sandbox=bwrap "
                           "(docs/agents.md, 'Running harnesses sandboxed')")
        self.registry = SessionRegistry()
        self.server: EndpointServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The endpoint's root URL (the server starts on first use)."""
        if self.server is None:
            a = self.cfg.agent
            app = build_app(self.registry, Limits(max_request_bytes=a.max_request_bytes))
            self.server = EndpointServer(app, host=a.host, port=a.port,
                                         unix_path=self.runner.socket_path if self.runner is not None else None)
            logger.info("agent endpoint serving on %s", self.server.url)
        return self.server.url

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the programs' loop (its thread starts on first use)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="agent-programs", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()  # kills what still runs, removes every per-sample directory
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._loop is not None:
            loop, thread = self._loop, self._thread
            assert thread is not None

            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=30)
            except Exception as exc:  # noqa: BLE001 -- the run ends: say it and go on
                logger.warning("agent programs did not all stop: %r", exc)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()
            self._loop = None
