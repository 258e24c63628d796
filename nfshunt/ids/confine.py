"""The IDS API's process confined before it reads a byte from a client.

The API's process parses untrusted HTTP and TLS. It starts as the controller does (root,
so it can read the TLS key and certificates, which stay root's), takes what it needs, and
then, before it serves (process.child_main):
  - takes an unprivileged user (`ids.user`, "nfshunt-ids" by default, made by
    scripts/install-deps.sh; "nobody" with a warning where that user does not exist):
    its supplementary groups none, its group and user ids all that user's;
  - keeps no capability: the bounding set emptied before the change of user (which
    empties the permitted and effective sets), the inheritable and ambient sets cleared,
    and no_new_privs set (nothing it could execute gains any);
  - loads a seccomp filter (libseccomp, through ctypes: Debian's libseccomp2, a
    dependency of systemd, is on every machine the controller runs on; its Python binding
    is not packaged for the controller's virtualenv): system calls it never makes fail
    with EPERM (exec, ptrace and other processes' memory, mounts and namespaces, modules,
    bpf, keys, clocks, io_uring, a change of user), and a socket only of AF_UNIX, AF_INET,
    AF_INET6 or a netlink socket of NETLINK_SOCK_DIAG (a local client's user: sockdiag).
Without libseccomp, or where the filter cannot be loaded (systemd's own filter must allow
the seccomp call), it serves unfiltered, and says so. The controller reads the token file
for it (tokens.py); its listening socket is the controller's, passed to it bound.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import pwd
import signal
import socket
from dataclasses import dataclass

LOG = logging.getLogger("nfshunt")
DEFAULT_USER = "nfshunt-ids"
FALLBACK_USER = "nobody"

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAPABILITY_VERSION_3 = 0x20080522

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_CTL_TSYNC = 4  # the filter on every thread of the process
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_GT = 1, 4, 6
NETLINK_SOCK_DIAG = 4
ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)
DENIED = (
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "syslog", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "personality", "iopl", "ioperm", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "mbind", "migrate_pages", "move_pages",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
    "capset",
)


class ConfineError(RuntimeError):
    """The process could not be confined: it must not serve."""


@dataclass(frozen=True)
class Confined:
    user: str
    uid: int
    gid: int
    seccomp: str  # "on", or why not


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(libc: ctypes.CDLL, *args: int) -> None:
    values = [ctypes.c_ulong(a) for a in args] + [ctypes.c_ulong(0)] * (5 - len(args))
    if libc.prctl(*values) != 0:
        err = ctypes.get_errno()
        raise ConfineError(f"prctl{args}: {os.strerror(err)}")


def _account(user: str) -> tuple[pwd.struct_passwd, str | None]:
    try:
        account = pwd.getpwnam(user)
        note = None
    except KeyError:
        try:
            account = pwd.getpwnam(FALLBACK_USER)
        except KeyError:
            raise ConfineError(f"no user {user!r} (nor {FALLBACK_USER!r}) to run the IDS API as") from None
        note = (f"no user {user!r}: the IDS API's process runs as {FALLBACK_USER!r} instead (create {user!r}: "
                "scripts/install-deps.sh does, or useradd --system --no-create-home --shell /usr/sbin/nologin)")
    if account.pw_uid == 0 or account.pw_gid == 0:
        raise ConfineError(f"ids.user {account.pw_name!r} is root's: the IDS API's process must not run as root")
    return account, note


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """The inheritable, permitted and effective sets emptied (capset), the ambient cleared."""
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}: all none
    if libc.capset(header, data) != 0:
        raise ConfineError(f"capset: {os.strerror(ctypes.get_errno())}")
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def confine(user: str) -> Confined:
    """Take `user`'s ids and keep no privilege (see the module's text); raises ConfineError
    if any step fails. A process that is not root keeps its own user."""
    libc = _libc()
    note = None
    if os.geteuid() == 0:
        account, note = _account(user)
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read())
        for cap in range(last + 1):  # before the change of user: it needs CAP_SETPCAP
            _prctl(libc, PR_CAPBSET_DROP, cap)
        try:
            os.setgroups([])
            os.setresgid(account.pw_gid, account.pw_gid, account.pw_gid)
            os.setresuid(account.pw_uid, account.pw_uid, account.pw_uid)
        except OSError as exc:
            raise ConfineError(f"cannot take user {account.pw_name!r}: {exc.strerror} (the controller needs "
                               "CAP_SETUID, CAP_SETGID and CAP_SETPCAP: config/systemd/nfshunt.service)") from None
    _drop_capabilities(libc)
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # (a change of user clears it; SIGTERM is ignored)
    if note is not None:
        LOG.warning(note)
    try:
        seccomp = load_filter()
    except ConfineError as exc:  # (an outer filter may forbid seccomp() itself: systemd's unit must allow it)
        seccomp = f"{exc} (systemd's SystemCallFilter must allow seccomp: config/systemd/nfshunt.service)"
    if seccomp != "on":
        LOG.warning("the IDS API's process serves without a seccomp filter: %s", seccomp)
    name = pwd.getpwuid(os.getuid()).pw_name if os.getuid() != 0 else "root"
    return Confined(name, os.getuid(), os.getgid(), seccomp)


def load_filter() -> str:
    """The seccomp filter loaded on every thread: "on", or why not (no libseccomp)."""
    path = ctypes.util.find_library("seccomp")
    if path is None:
        return "libseccomp (Debian's libseccomp2) is not installed"
    lib = ctypes.CDLL(path, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise ConfineError("seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1), "seccomp_attr_set")
        for name in DENIED:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr >= 0:  # (a call this architecture lacks: nothing to deny)
                _rule(lib, ctx, _errno(errno.EPERM), nr)
        nr = lib.seccomp_syscall_resolve_name(b"socket")
        no_family = _errno(errno.EAFNOSUPPORT)
        for family in range(max(ALLOWED_FAMILIES) + 1):
            if family not in ALLOWED_FAMILIES:
                _rule(lib, ctx, no_family, nr, (0, SCMP_CMP_EQ, family))
        _rule(lib, ctx, no_family, nr, (0, SCMP_CMP_GT, max(ALLOWED_FAMILIES)))
        _rule(lib, ctx, _errno(errno.EPROTONOSUPPORT), nr, (0, SCMP_CMP_EQ, socket.AF_NETLINK),
              (2, SCMP_CMP_NE, NETLINK_SOCK_DIAG))
        _check(lib.seccomp_load(ctx), "seccomp_load")
    finally:
        lib.seccomp_release(ctx)
    return "on"


def _errno(code: int) -> int:
    return 0x00050000 | code  # SCMP_ACT_ERRNO


def _rule(lib: ctypes.CDLL, ctx: int, action: int, nr: int, *cmps: tuple[int, int, int]) -> None:
    args = (_ArgCmp * max(1, len(cmps)))(*(_ArgCmp(a, op, value, 0) for a, op, value in cmps))
    _check(lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), args), "seccomp_rule_add_array")


def _check(code: int, what: str) -> None:
    if code < 0:
        raise ConfineError(f"{what}: {os.strerror(-code)}")
