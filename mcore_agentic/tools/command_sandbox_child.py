"""Bootstrap of a sandboxed command (:mod:`.command_sandbox`): checks, limits, the endpoint's forwarder, the command.

Started inside the sandbox as ``python -I -B command_sandbox_child.py '<json settings>' ARGV...`` (after ``setpriv``
under a root trainer), in the work directory. Standard library only, plus :func:`sandbox_child.check_unprivileged`,
bound beside it. In order:

1. checks that it is the sandbox's uid with no capability (exit :data:`sandbox_child.DROP_FAILED` otherwise);
2. sets resource limits on itself, which the command inherits (soft = hard: the command cannot raise them):
   address space (unless null), file size, open files, processes (only where the sandbox has a uid of its own: the trainer's
   uid would count the trainer's own threads), no core dumps, no locked memory, no POSIX message queues;
3. when the settings name the endpoint's socket: listens on ``127.0.0.1:<port>`` (the sandbox's own loopback,
   the only network it has) and forwards each connection to that Unix socket, bound in from the host, where the
   trainer's endpoint serves the sessions (a client's ``OPENAI_BASE_URL`` points here);
4. runs ARGV with stdin, stdout and stderr inherited and exits with its status (128 + N for a signal). Whatever
   the command leaves running dies with the sandbox's PID namespace when this process ends.
"""

import asyncio
import json
import os
import resource
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox_child import check_unprivileged  # noqa: E402 -- bound beside this file

NOT_FOUND = 127
_CHUNK = 1 << 16


def set_limits(cfg):
    mb = 1024 * 1024
    pairs = [
        (resource.RLIMIT_FSIZE, int(cfg["max_file_mb"] * mb)),
        (resource.RLIMIT_NOFILE, cfg["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ]
    if cfg["address_space_mb"] is not None:
        pairs.append((resource.RLIMIT_AS, cfg["address_space_mb"] * mb))
    if cfg["max_processes"] is not None:
        pairs.append((resource.RLIMIT_NPROC, cfg["max_processes"]))
    for which, value in pairs:
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:  # never ask for more than we already may have
            value = min(value, old_hard)
        resource.setrlimit(which, (value, value))


async def pump(reader, writer, peer):
    """Copy ``reader`` to ``writer`` until EOF (then half-close it); on an error close both connections."""
    try:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ConnectionError, RuntimeError):
        writer.close()
        peer.close()


def forwarder(path):
    async def connection(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(path)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(pump(reader, up_writer, writer), pump(up_reader, writer, up_writer))
        finally:
            writer.close()
            up_writer.close()

    return connection


async def serve_and_run(listener, path, argv):
    server = None
    if listener is not None:
        server = await asyncio.start_server(forwarder(path), sock=listener)
    try:
        proc = await asyncio.create_subprocess_exec(*argv)
    except OSError as exc:
        sys.stderr.write(f"sandbox: cannot run {argv[0]!r}: {exc.strerror or exc}\n")
        return NOT_FOUND
    code = await proc.wait()
    if server is not None:
        server.close()
    return 128 - code if code < 0 else code


def main():
    cfg = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    if cfg.get("expect_uid") is not None:
        check_unprivileged(cfg["expect_uid"], cfg["expect_no_groups"])
    set_limits(cfg)
    listener = None
    if cfg.get("socket"):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", cfg["port"]))  # before the command starts: its first request finds it listening
        listener.listen(128)
    sys.stdout.flush()
    code = asyncio.run(serve_and_run(listener, cfg.get("socket"), argv))
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
