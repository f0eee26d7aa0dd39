"""The sandboxed side of :mod:`tandem.agents.sandbox`: isolate this process, then run the code on stdin.

Run as a script (``python -I sandbox_child.py SETUP_JSON``, the setup naming the limits, the host's
working directory, an empty directory for the new root and the paths a tool mounts), standard
library only, so nothing of tandem (or torch) is imported into the sandbox. The caller starts it
with an environment of ``PATH`` and ``LANG`` only. Before any of the code runs:

1. new user, mount, network, IPC and PID namespaces (``unshare``; the uid stays what it was): the
   network namespace has only a loopback device that is down, so every connection fails (a
   command program's sandbox, :mod:`tandem.agents.program.sandboxed_child`, brings it up to
   relay its endpoint in: it still reaches nothing outside the namespace);
2. fork: the child is PID 1 of the new PID namespace and dies with its parent
   (``PR_SET_PDEATHSIG``); when it ends, the kernel kills every process left in the namespace
   (a fork bomb's included);
3. a new root (a tmpfs, ``pivot_root``; the host's tree is detached) holding only: the system's
   programs and shared libraries (``/usr``, ``/bin``, ``/lib*``, ``/sbin``, the dynamic loader's
   files in ``/etc``), the Python runtime's own directories (``sys.prefix``, ``sys.base_prefix``
   and the exec prefixes, at their host paths), the paths a tool mounts, ``/dev/{null,zero,full,
   random,urandom}``, a fresh ``/proc`` of the new PID namespace (none where the kernel refuses
   one), a one-user ``/etc/passwd`` and the working directory at ``/sandbox``; all of it
   read-only (``mount_setattr``, recursive) except ``/sandbox``, the current, home and temp
   directory. Home directories, ``/root``, ``/tmp``, the project and the run's output are not
   there (unless the Python runtime lives in one: then that runtime's directory alone);
4. every capability dropped (bounding set, then effective/permitted/inheritable) and
   ``no_new_privs``: the code cannot undo the read-only mounts, and nothing it executes gains
   privileges;
5. resource limits: CPU seconds, address space, file size, processes (the kernel does not count
   root's; the caller puts a root sandbox in a pids cgroup instead), no core files.

Any step that fails ends the process with exit status 86 and the reason on stderr; the code
never runs unisolated.
"""

import ctypes
import fcntl
import json
import os
import platform
import resource
import signal
import socket
import struct
import sys
import traceback

SETUP_FAILED = 86
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE, MS_BIND = 0x2, 0x4, 0x8, 0x4000, 1 << 18, 0x1000
MNT_DETACH = 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (the generic syscall table)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # glibc has no wrapper
INSIDE = "/sandbox"  # the working directory as the code sees it (also HOME and TMPDIR)
SYSTEM_PATHS = (  # programs and shared libraries; the loader's cache finds the multiarch ones
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
)
DEVICES = ("null", "zero", "full", "random", "urandom")
DEVICE_LINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
)
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522
LAST_CAPABILITY = 63
SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40

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


def isolate(workdir: str, root: str, mounts: list[str], loopback: bool = False) -> None:
    """Steps 1–4 of the module docstring; returns in PID 1 of the new namespaces, in ``/sandbox``.
    ``loopback``: bring the new network namespace's own loopback device up (before the
    capabilities go), for a caller that relays one endpoint into it; it reaches nothing outside."""
    uid, gid = os.getuid(), os.getgid()
    namespaces = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID
    check(libc.unshare(namespaces), "unshare namespaces")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{uid} {uid} 1")
    write("/proc/self/gid_map", f"{gid} {gid} 1")
    child = os.fork()
    if child:  # outside the PID namespace: wait for PID 1 and report how it ended
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    build_root(root, workdir, mounts, uid, gid)
    enter_root(root)
    set_read_only("/", recursive=True, read_only=True)
    set_read_only(INSIDE, recursive=False, read_only=False)
    if loopback:
        loopback_up()
    drop_capabilities()
    os.chdir(INSIDE)
    os.environ.update({"HOME": INSIDE, "TMPDIR": INSIDE, "TMP": INSIDE, "TEMP": INSIDE})


def loopback_up() -> None:
    """Set the namespace's ``lo`` up (``SIOCSIFFLAGS``; needs the namespace's ``CAP_NET_ADMIN``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING)
        try:
            fcntl.ioctl(probe.fileno(), SIOCSIFFLAGS, request)
        except OSError as error:
            sys.stderr.write(f"sandbox setup failed: set the loopback device up: {error.strerror}\n")
            sys.stderr.flush()
            os._exit(SETUP_FAILED)


def build_root(root: str, workdir: str, mounts: list[str], uid: int, gid: int) -> None:
    """Step 3: fill a tmpfs at ``root`` with what the code may see, each host path at its own path
    (the working directory at ``/sandbox``). A path under one already there is skipped: creating
    its mount point would write into the host's directory."""
    check(mount(b"tmpfs", root, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"), "mount the new root")
    bind(workdir, root + INSIDE)
    exposed = [INSIDE]
    for path in SYSTEM_PATHS:
        if os.path.lexists(path) and not under_any(path, exposed):
            if os.path.islink(path):  # /bin -> usr/bin: the same link, resolved inside
                os.makedirs(os.path.dirname(root + path), exist_ok=True)
                os.symlink(os.readlink(path), root + path)
            else:
                bind(path, root + path)
            exposed.append(path)
    for path in python_runtime() + mounts:
        if not under_any(path, exposed):
            bind(path, root + path)
            exposed.append(path)
    for name in DEVICES:
        bind(f"/dev/{name}", f"{root}/dev/{name}")
    for name, target in DEVICE_LINKS:
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(f"{root}/proc")
    # a proc of the new PID namespace lists its own processes only; the kernel refuses one where
    # the host's /proc has parts masked (some containers): then there is none, which is safe too
    mount(b"proc", f"{root}/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(f"{root}/etc", exist_ok=True)
    write(f"{root}/etc/passwd", f"sandbox:x:{uid}:{gid}:sandbox:{INSIDE}:/bin/sh\n")
    write(f"{root}/etc/group", f"sandbox:x:{gid}:\n")


def python_runtime() -> list[str]:
    """The Python runtime's own directories (a venv and the installation it comes from), not
    whatever contains them: a venv inside the project shows the venv alone."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    if "/" in {os.path.abspath(prefix) for prefix in prefixes}:
        raise RuntimeError("a Python runtime installed at / would expose the whole filesystem")
    return sorted(os.path.abspath(prefix) for prefix in prefixes)


def under_any(path: str, parents: list[str]) -> bool:
    return any(path == parent or path.startswith(parent.rstrip("/") + "/") for parent in parents)


def mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None) -> int:
    return libc.mount(source, target.encode(), fstype, flags, data)


def bind(source: str, target: str) -> None:
    """Bind ``source`` (with everything mounted below it) at ``target``, creating the mount point."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        write(target, "")
    check(mount(source.encode(), target, None, MS_BIND | MS_REC, None), f"bind {source}")


def enter_root(root: str) -> None:
    """Make ``root`` the root directory and detach the host's tree (``pivot_root(".", ".")``)."""
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise RuntimeError(f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(root)
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


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
    setup = json.loads(sys.argv[1])
    code = sys.stdin.read()
    try:
        isolate(setup["workdir"], setup["root"], setup["mounts"])
        limit(setup["limits"])
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
