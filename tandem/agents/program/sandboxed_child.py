"""The sandboxed side of a command program (``agent.program_sandbox=true``): isolate, relay the
endpoint in, run the command.

Run as a script (``python -I sandboxed_child.py SETUP_JSON``; standard library only, as
:mod:`tandem.agents.sandbox_child`, whose steps it reuses), with the command's stdin, stdout
and stderr. The setup names the limits, the host's working directory, an empty directory for
the new root, the paths to mount read-only, the endpoint's socket file (in one of them), the
port to listen on and the command's arguments. In order:

1. wait for the caller's go on the ``go`` pipe (it puts a root caller's run in a pids cgroup
   first, as :func:`~tandem.agents.sandbox.run_python` does);
2. :func:`~tandem.agents.sandbox_child.isolate` (new user, mount, network, IPC and PID
   namespaces, a read-only root of the system's files, the Python runtime and the mounts, every
   capability dropped) with the new network namespace's own loopback up, and the resource limits;
3. listen on ``127.0.0.1:<port>`` in that namespace (the same port the endpoint has on the host,
   so ``OPENAI_BASE_URL`` reads the same), relaying each connection to the socket file: the only
   address outside the sandbox its processes can reach;
4. fork the command (``execvp`` with the environment it was started with), relay until it exits,
   then exit with its status (128 + N for signal N). This process is PID 1 of the namespace:
   when it exits, everything the command left running dies.

A setup step that fails ends it with status 86 and ``sandbox setup failed: ...`` on stderr.
"""

import contextlib
import importlib.util
import json
import os
import socket
import sys
import threading

SETUP_FAILED = 86
READ_CHUNK = 65536


def load_sandbox_child():
    """:mod:`tandem.agents.sandbox_child`, loaded from its file (this script runs outside tandem's
    package: nothing of tandem, or torch, is imported into the sandbox)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandbox_child.py")
    spec = importlib.util.spec_from_file_location("sandbox_child", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(listener: socket.socket, path: str) -> None:
    """Accept connections forever, each relayed to the Unix socket ``path`` on a thread (one
    refused when the process limit leaves no thread for it; the next may find one)."""
    while True:
        connection, _ = listener.accept()
        try:
            threading.Thread(target=relay, args=(connection, path), daemon=True).start()
        except RuntimeError:  # "can't start new thread"
            connection.close()


def relay(connection: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        connection.close()
        upstream.close()
        return
    try:
        back = threading.Thread(target=pump, args=(upstream, connection), daemon=True)
        back.start()
        pump(connection, upstream)
        back.join()
    except RuntimeError:  # no thread left under the process limit: this connection is dropped
        pass
    finally:
        connection.close()
        upstream.close()


def pump(source: socket.socket, target: socket.socket) -> None:
    """Copy ``source`` to ``target`` until its end, then end ``target``'s sending side."""
    with contextlib.suppress(OSError):
        while data := source.recv(READ_CHUNK):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


def main() -> None:
    setup = json.loads(sys.argv[1])
    go = os.read(setup["go"], 1)  # step 1
    os.close(setup["go"])
    if not go:  # the caller went away before its go: nothing runs
        os._exit(SETUP_FAILED)
    try:
        sandbox_child = load_sandbox_child()
        sandbox_child.isolate(setup["workdir"], setup["root"], setup["mounts"], loopback=True)
        sandbox_child.limit(setup["limits"])
        listener = socket.create_server(("127.0.0.1", setup["port"]))
    except Exception as error:  # noqa: BLE001 - any failure: the command must not run
        sys.stderr.write(f"sandbox setup failed: {error!r}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
    argv = setup["argv"]
    command = os.fork()
    if command == 0:
        listener.close()
        try:
            os.execvp(argv[0], argv)
        except OSError as error:
            sys.stderr.write(f"could not run {argv[0]!r} in the sandbox: {error.strerror}\n")
            sys.stderr.flush()
            os._exit(127)
    threading.Thread(target=serve, args=(listener, setup["socket"]), daemon=True).start()
    _, status = os.waitpid(command, 0)
    sys.stdout.flush()
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
