"""A seccomp filter for local sandboxes: the kernel surfaces a coding agent has no use for.

Classic BPF, built here (no libseccomp), handed to bubblewrap with `--seccomp FD`. Denied with
EPERM: kernel keyrings (`add_key`, `request_key`, `keyctl`: a uid's keyring outlives its
processes and would carry data to the next trial of that uid), new namespaces (`unshare`,
`setns`, and `clone` with any `CLONE_NEW*` flag: most container escapes start with a user
namespace), mounts of any kind, module loading, kexec, reboot, swap, `bpf`, `perf_event_open`,
`userfaultfd`, `acct`, `quotactl`. `clone3` gets ENOSYS (its flags sit in memory a filter cannot
read), so the C library falls back to `clone`. Any other architecture than the host's own (i386
or x32 system calls on x86-64) is refused, so the table cannot be sidestepped.

Like Docker's default profile, without its allow-list: everything else is allowed.
"""

from __future__ import annotations

import errno
import os
import platform
import struct
from collections.abc import Sequence

# BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH, _ARG0_LOW = 0, 4, 16

CLONE_NEW_ANY = 0x7E020000
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET."""

X32_SYSCALL_BIT = 0x40000000

DENIED = [
    "add_key",
    "request_key",
    "keyctl",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "swapon",
    "swapoff",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "acct",
    "quotactl",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
]

ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "setns": 308,
            "mount": 165, "umount2": 166, "pivot_root": 155, "swapon": 167, "swapoff": 168,
            "reboot": 169, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
            "finit_module": 313, "delete_module": 176, "bpf": 321, "perf_event_open": 298,
            "userfaultfd": 323, "acct": 163, "quotactl": 179, "open_tree": 428, "move_mount": 429,
            "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
            "clone": 56, "clone3": 435,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "setns": 268,
            "mount": 40, "umount2": 39, "pivot_root": 41, "swapon": 224, "swapoff": 225,
            "reboot": 142, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
            "finit_module": 273, "delete_module": 106, "bpf": 280, "perf_event_open": 241,
            "userfaultfd": 282, "acct": 89, "quotactl": 60, "open_tree": 428, "move_mount": 429,
            "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
            "clone": 220, "clone3": 435,
        },
    ),
}  # fmt: skip


class UnsupportedArchitecture(RuntimeError):
    """No system-call table for this machine: the sandbox refuses to start without its filter."""


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this one) as `struct sock_filter[]` bytes."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise UnsupportedArchitecture(f"no seccomp table for {machine}; known: {', '.join(ARCHES)}")
    arch, table = ARCHES[machine]
    deny = RET_ERRNO | errno.EPERM
    nosys = RET_ERRNO | errno.ENOSYS
    body: list[bytes] = []
    # Each check jumps forward to one of the three returns at the end; offsets are counted from
    # the instruction after the jump, so they are filled in once the body's length is known.
    checks: list[tuple[int, str]] = [(table[name], "deny") for name in DENIED]
    ops: list[tuple[int, int, str]] = []  # (opcode, k, target) with target in {"deny","nosys","clone"}
    ops.append((_JGE_K, X32_SYSCALL_BIT, "deny"))
    ops.extend((_JEQ_K, nr, target) for nr, target in checks)
    ops.append((_JEQ_K, table["clone3"], "nosys"))
    ops.append((_JEQ_K, table["clone"], "clone"))
    n = len(ops)
    # Layout: [ld arch][jeq arch][ret deny][ld nr] ops... [ret allow][clone: ld arg0][jset][ret allow]
    #         [deny: ret][nosys: ret]
    head = [
        _insn(_LD_W_ABS, _ARCH),
        _insn(_JEQ_K, arch, jt=1, jf=0),
        _insn(_RET_K, deny),
        _insn(_LD_W_ABS, _NR),
    ]
    # Indexes relative to the first op.
    allow_at = n
    clone_at = n + 1
    deny_at = n + 4
    nosys_at = n + 5
    target_at = {"deny": deny_at, "nosys": nosys_at, "clone": clone_at}
    for i, (code, k, target) in enumerate(ops):
        body.append(_insn(code, k, jt=target_at[target] - i - 1, jf=0))
    tail = [
        _insn(_RET_K, RET_ALLOW),  # allow_at
        _insn(_LD_W_ABS, _ARG0_LOW),  # clone_at: flags (low 32 bits hold every CLONE_NEW*)
        _insn(_JSET_K, CLONE_NEW_ANY, jt=1, jf=0),
        _insn(_RET_K, RET_ALLOW),
        _insn(_RET_K, deny),  # deny_at
        _insn(_RET_K, nosys),  # nosys_at
    ]
    assert allow_at == n and len(tail) == 6
    return b"".join([*head, *body, *tail])


def pipe_with_program(machine: str | None = None) -> int:
    """A readable fd holding the program, for `bwrap --seccomp FD` (the caller passes it on)."""
    data = program(machine)
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)  # a few hundred bytes: well under a pipe's buffer
    finally:
        os.close(write_fd)
    return read_fd


def denied_names() -> Sequence[str]:
    return (*DENIED, "clone3 (ENOSYS)", "clone with CLONE_NEW* flags")
