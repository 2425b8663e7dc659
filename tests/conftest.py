"""Suite-wide settings: the communication policy's strict mode (``mcore_agentic/parallel/comm.py``) is on in
every test process and every process a test spawns (torchrun jobs, gloo ranks), through the environment."""

from __future__ import annotations

import os

from mcore_agentic.parallel import comm

os.environ[comm.STRICT_ENV] = os.environ.get(comm.STRICT_ENV, "1")
comm.enable_strict_from_env()
