"""The sandboxed side of :mod:`tandem.agents.sandbox`: isolate this process, then run the code on stdin.

Run as a script (``python -I sandbox_child.py LIMITS_JSON WORKDIR``), standard library only, so
nothing of tandem (or torch) is imported into the sandbox. Before any of the code runs:

1. new user, mount, network and PID namespaces (``unshare``; the uid stays what it was): the
   network namespace has only a loopback device that is down, so every connection fails;
2. fork: the child is PID 1 of the new PID namespace and dies with its parent
   (``PR_SET_PDEATHSIG``); when it ends, the kernel kills every process left in the namespace
   (a fork bomb's included);
3. the whole filesystem read-only (``mount_setattr`` with ``MOUNT_ATTR_RDONLY``, recursive)
   except the fresh working directory, which becomes the current, home and temp directory;
4. every capability dropped (bounding set, then effective/permitted/inheritable) and
   ``no_new_privs``: the code cannot undo the read-only mounts, and nothing it executes gains
   privileges;
5. resource limits: CPU seconds, address space, file size, processes (the kernel does not count
   root's; the caller puts a root sandbox in a pids cgroup instead), no core files.

Any step that fails ends the process with exit status 86 and the reason on stderr; the code
never runs unisolated.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

SETUP_FAILED = 86
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_REC, MS_PRIVATE, MS_BIND = 0x4000, 1 << 18, 0x1000
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (the generic syscall table)
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522
LAST_CAPABILITY = 63

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def fail(step: str) -> None:
    error = ctypes.get_errno()
    sys.stderr.write(f"sandbox setup failed: {step}: {os.strerror(error) if error else 'error'}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def check(result: int, step: str) -> None:
    if result != 0:
        fail(step)


def write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def set_read_only(path: str, recursive: bool, read_only: bool) -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    result = libc.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    check(result, f"mount_setattr({path}, {'read-only' if read_only else 'writable'})")


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> None:
    """Step 4: no capability left, none to regain."""
    for capability in range(LAST_CAPABILITY + 1):
        if (
            libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != 22
        ):  # EINVAL: no such cap
            fail(f"drop capability {capability} from the bounding set")
    header, data = CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (CapData * 2)()
    check(libc.capset(ctypes.byref(header), data), "capset (drop all)")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def isolate(limits: dict, workdir: str) -> None:
    """Steps 1–4 of the module docstring; returns in PID 1 of the new namespaces."""
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare namespaces")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{uid} {uid} 1")
    write("/proc/self/gid_map", f"{gid} {gid} 1")
    child = os.fork()
    if child:  # outside the PID namespace: wait for PID 1 and report how it ended
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    check(libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None), "bind the working directory")
    set_read_only("/", recursive=True, read_only=True)
    set_read_only(workdir, recursive=False, read_only=False)
    drop_capabilities()
    os.chdir(workdir)
    os.environ.update({"HOME": workdir, "TMPDIR": workdir, "TMP": workdir, "TEMP": workdir})


def limit(limits: dict) -> None:
    """Step 5: CPU seconds (SIGKILL a second after the limit: PID 1 of a namespace ignores
    SIGXCPU), address space, file size, processes (for this uid), no core files."""
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(limits["memory_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(limits["file_size_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    processes = int(limits["processes"])
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> None:
    limits, workdir = json.loads(sys.argv[1]), sys.argv[2]
    code = sys.stdin.read()
    try:
        isolate(limits, workdir)
        limit(limits)
    except Exception as error:  # noqa: BLE001 - any failure: the code must not run
        where = traceback.extract_tb(error.__traceback__)[-1]
        sys.stderr.write(f"sandbox setup failed: {error!r} (line {where.lineno}: {where.line})\n")
        os._exit(SETUP_FAILED)
    sys.stdin = open(os.devnull)  # noqa: SIM115
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "main.py", "exec"), namespace)  # noqa: S102 - this is the sandbox
    except SystemExit as exit_:
        sys.stdout.flush()
        code_ = exit_.code
        os._exit(code_ if isinstance(code_, int) else (0 if code_ is None else 1))
    except BaseException as error:  # noqa: BLE001 - report as Python would (the code's frames only), then exit 1
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
