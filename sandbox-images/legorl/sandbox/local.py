"""The local backend (embedded default): the four stages with Linux namespaces via bubblewrap.

Each sandbox is a `bwrap` with new pid, mount, ipc, uts, cgroup and network namespaces (and a user
namespace when not run as root):

- **network**: only loopback exists. The proxy runs outside, on a Unix socket bound into the
  sandbox; `legorl.sandbox.inner` relays `127.0.0.1:4000` to it, so the proxy is the one way out.
  The host's loopback (the engine, other trials' proxies) is a different namespace's loopback.
- **filesystem**: system folders and the Python runtime read-only; the workspace writable (a
  size- and inode-limited tmpfs when running as root); `/tmp` and `$HOME` size-limited tmpfs;
  nothing else of the host — no run store, no journal, no other trial, and of legorl only a copy
  of the modules `inner` runs.
- **identity**: every sandbox runs as its own unprivileged host uid (`uid_base + slot`, claimed
  host-wide), with no capabilities and `no_new_privs`; so rlimits are per trial and a sweep by uid
  finds every process.
- **system calls**: a seccomp filter (`seccomp.py`) denies keyrings, namespaces, mounts, modules.
- **limits**: pids and memory by cgroup (v1 or v2, when writable), and rlimits (processes, open
  files, file size, core dumps) always.
- **cleanup**: the pid namespace dies with its init; after every stage all processes of the
  sandbox's uid are killed, its cgroups removed and its mounts unmounted — even when the harness
  hangs or forks without end.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import legorl.sandbox
from legorl.sandbox import seccomp
from legorl.sandbox.checks import Check
from legorl.sandbox.outcomes import TamperPolicy
from legorl.sandbox.taskenv import TaskEnvError, ensure_task_env

SANDBOX_PACKAGE = Path(legorl.sandbox.__file__).resolve().parent
INNER_LIB = "/opt/legorl/lib"
TASK_DIR = "/legorl-task"
OUT_DIR = "/legorl-out"
PROXY_SOCKET = "/run/legorl/proxy.sock"
HOME = "/home/agent"
UID_LOCKS = Path("/run/legorl/uids")
MAX_SLOTS = 4096
CGROUP_JOIN_FAILED = "legorl-sandbox: could not join the sandbox's cgroup"


class SandboxError(RuntimeError):
    """The sandbox itself failed (bwrap missing, mount refused): the trial ends `sandbox_error`."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox."""

    memory_bytes: int = 4 * 1024**3
    pids: int = 512
    workspace_bytes: int = 2 * 1024**3
    tmp_bytes: int = 512 * 1024**2
    open_files: int = 4096
    workspace_inodes: int = 262_144
    """Files and folders the workspace tmpfs holds (capture walks them all afterwards)."""


@dataclass(frozen=True)
class Defenses:
    """Which defenses a sandbox applies (SandboxPool `spec.defenses`); `off()` is for benchmarks."""

    egress: Literal["ProxyOnly", "Unrestricted"] = "ProxyOnly"
    git_history: Literal["BaseCommitOnly", "Preserve"] = "BaseCommitOnly"
    tamper_policy: TamperPolicy = "StripAndReport"
    isolate: bool = True
    """Run stages in namespaces at all (False only to measure what the defenses cost)."""

    @classmethod
    def off(cls) -> Defenses:
        return cls(egress="Unrestricted", git_history="Preserve", isolate=False)


@dataclass
class Run:
    """Result of one sandboxed command."""

    returncode: int
    timed_out: bool
    seconds: float
    output: str
    report: str = ""
    report_seconds: float = 0.0
    """From start until the sandbox's self-test report arrived (the cost of starting a sandbox)."""
    limits_applied: list[str] = field(default_factory=list)
    cancelled: bool = False
    """`stop` was set while it ran: everything in the sandbox was killed."""


def _python_roots() -> list[Path]:
    """Folders the interpreter needs: the venv, its base installation, the executable's home."""
    roots = {
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
        Path(sys.executable).resolve().parent,
    }
    outside_usr = [r for r in roots if not str(r).startswith("/usr/")]
    # Keep only the outermost folders.
    return sorted(r for r in outside_usr if not any(o != r and o in r.parents for o in outside_usr))


def _system_binds() -> list[str]:
    """Read-only system folders (merged-/usr links recreated as links)."""
    args: list[str] = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", str(path.readlink()), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    return args


def _mount_points(binds: Sequence[tuple[str, str, bool]]) -> list[str]:
    """`--dir` for every folder above a bind target, world-traversable: bwrap would otherwise make
    them 0700 when it runs as root, and the trial uid could not reach its own workspace."""
    made: dict[str, None] = {}
    for _, inside, _ in binds:
        parents = list(Path(inside).parents)[:-1]  # without "/"
        for parent in reversed(parents):
            if str(parent) not in ("/usr", "/etc", "/tmp", HOME):  # noqa: S108 - mounted by bwrap
                made[str(parent)] = None
    args: list[str] = []
    for path in made:
        args += ["--perms", "0755", "--dir", path]
    return args


INNER_MODULES = ("__init__.py", "checks.py", "inner.py")


def _inner_lib(path: Path) -> Path:
    """A copy of the modules a sandbox's first process needs, and nothing else of legorl."""
    package = path / "legorl" / "sandbox"
    package.mkdir(parents=True, exist_ok=True)
    for name in INNER_MODULES:
        shutil.copyfile(SANDBOX_PACKAGE / name, package / name)
    return path


def _legorl_installs(roots: Sequence[Path]) -> list[Path]:
    """Folders of the `legorl` package that lie inside the given (bound) folders."""
    spec = importlib.util.find_spec("legorl")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return sorted(
        {Path(p).resolve() for p in locations if any(r in Path(p).resolve().parents for r in roots)}
    )


class Cgroup:
    """A per-sandbox cgroup for pids and memory (v1 controllers or the v2 unified tree)."""

    def __init__(self, name: str, limits: Limits) -> None:
        self.paths: list[Path] = []
        self.applied: list[str] = []
        for controller, files in (
            ("pids", {"pids.max": str(limits.pids)}),
            (
                "memory",
                {"memory.limit_in_bytes": str(limits.memory_bytes), "memory.max": str(limits.memory_bytes)},
            ),
        ):
            path = self._create(controller, name)
            if path is None:
                continue
            wrote = False
            for fname, value in files.items():
                with contextlib.suppress(OSError):
                    (path / fname).write_text(value)
                    wrote = True
                    self.applied.append(f"{controller}:{fname}={value}")
            if wrote:
                self.paths.append(path)
            else:
                with contextlib.suppress(OSError):
                    path.rmdir()

    @staticmethod
    def _create(controller: str, name: str) -> Path | None:
        """A child of this process's own cgroup for `controller` (v1), or of its v2 cgroup."""
        try:
            own = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        for line in own:
            _, controllers, rel = line.split(":", 2)
            if controller in controllers.split(","):
                base = Path("/sys/fs/cgroup") / controller / rel.lstrip("/")
            elif controllers == "" and unified:
                base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            else:
                continue
            try:
                (base / name).mkdir(exist_ok=True)
            except OSError:
                continue
            return base / name
        return None

    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for p in self.paths:
            with contextlib.suppress(OSError):
                found.update(int(x) for x in (p / "cgroup.procs").read_text().split())
        return found

    def remove(self) -> None:
        for p in self.paths:
            for _ in range(50):
                try:
                    p.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


def processes_of(uid: int) -> list[int]:
    """Live pids whose real uid is `uid` (every process a sandbox started). Zombies are left out:
    they hold nothing but a pid until whoever inherited them reaps them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid != uid:
                continue
            status = dict(
                line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line
            )
            if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
                found.append(int(entry.name))
    return found


def kill_all(uid: int, cgroup: Cgroup | None, timeout: float = 10.0) -> None:
    """SIGKILL every process of the sandbox until none is left (a fork bomb races the first sweep)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = set(processes_of(uid)) | (cgroup.pids() if cgroup else set())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise SandboxError(
                f"processes of uid {uid} survived {timeout:.0f} s of SIGKILL: {sorted(pids)[:10]}"
            )
        time.sleep(0.01)


class LocalBackend:
    """Runs sandboxes as namespaced processes on this machine."""

    def __init__(
        self,
        root: Path,
        *,
        limits: Limits | None = None,
        defenses: Defenses | None = None,
        uid_base: int = 200_000,
        task_env: Path | None = None,
    ) -> None:
        self.root = root
        self.limits = limits or Limits()
        self.defenses = defenses or Defenses()
        self.uid_base = uid_base
        self.is_root = os.geteuid() == 0
        if self.defenses.isolate and shutil.which("bwrap") is None:
            raise SandboxError("bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap")
        root.mkdir(parents=True, exist_ok=True)
        try:
            self.task_env = task_env or ensure_task_env(root / "task-env")
        except TaskEnvError as exc:
            raise SandboxError(str(exc)) from exc
        """Python for the task's code (first on PATH in agent and verify sandboxes)."""
        self.inner_lib = _inner_lib(root / "inner-lib")
        """The only part of legorl a sandbox sees: what its first process runs."""

    # -- identities -------------------------------------------------------------------------

    @contextlib.contextmanager
    def identity(self) -> Iterator[int]:
        """A host uid no other live sandbox on this host uses (the caller's own uid when not root
        or unisolated).

        Claimed host-wide, not per backend: an exclusive `flock` on `/run/legorl/uids/<uid>.lock`
        (released by the kernel if this process dies), and a uid that still owns a process is
        skipped. Two backends sharing a uid would share its rlimits and keyring, and the kill
        sweep at the end of one sandbox would kill the other's processes."""
        if not (self.is_root and self.defenses.isolate):
            yield os.getuid()
            return
        UID_LOCKS.mkdir(parents=True, exist_ok=True)
        for slot in range(1, MAX_SLOTS + 1):
            uid = self.uid_base + slot
            fd = os.open(UID_LOCKS / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if processes_of(uid):
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return
        raise SandboxError(f"all {MAX_SLOTS} sandbox uids from {self.uid_base + 1} are in use on this host")

    # -- mounts -----------------------------------------------------------------------------

    def make_workspace(self, path: Path, size_bytes: int) -> bool:
        """An empty folder; a size-limited tmpfs when root (disk limit). True when mounted."""
        path.mkdir(parents=True, exist_ok=False)
        if not (self.is_root and self.defenses.isolate):
            return False
        proc = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={size_bytes},nr_inodes={self.limits.workspace_inodes},mode=0755,nosuid,nodev",
                "tmpfs",
                str(path),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SandboxError(f"could not mount the workspace tmpfs at {path}: {proc.stderr.strip()}")
        return True

    @staticmethod
    def unmount(path: Path) -> None:
        for _ in range(20):
            proc = subprocess.run(["umount", str(path)], capture_output=True, text=True, check=False)
            if proc.returncode == 0 or "not mounted" in proc.stderr:
                return
            time.sleep(0.05)
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, check=False)

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        uid: int,
        binds: Sequence[tuple[str, str, bool]],
        cwd: str,
        env: Mapping[str, str],
        timeout: float,
        network: bool = False,
        report: bool = False,
        name: str = "sandbox",
        stop: threading.Event | None = None,
    ) -> Run:
        """Run argv in a fresh sandbox; `binds` are (host path, sandbox path, writable). Setting `stop`
        kills it (the run is then `cancelled`).

        With `report`, argv is wrapped by `legorl.sandbox.inner`, whose self-test report arrives on
        a pipe the agent never sees."""
        limits = self.limits
        started = time.monotonic()
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
        cgroup = Cgroup(f"legorl-{safe}-{uid}", limits) if self.is_root and self.defenses.isolate else None
        read_fd = write_fd = -1
        command = list(argv)
        if report:
            read_fd, write_fd = os.pipe()
            command = [
                sys.executable,
                "-m",
                "legorl.sandbox.inner",
                "--report-fd",
                str(write_fd),
                *command,
            ]
        seccomp_fd = seccomp.pipe_with_program() if self.defenses.isolate else -1
        full = self._bwrap(command, uid=uid, binds=binds, cwd=cwd, network=network, seccomp_fd=seccomp_fd)
        # The chain: join the cgroups (as root), rlimits, bwrap, (inside) drop to the trial uid.
        if self.defenses.isolate:
            launch = [*_cgroup_join(cgroup), *self._rlimits(), *full]
        else:
            launch, cwd, env = _translate(command, cwd, env, binds)
        try:
            proc = subprocess.Popen(
                launch,
                env=dict(env),
                cwd=None if self.defenses.isolate else cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=tuple(fd for fd in (write_fd, seccomp_fd) if fd >= 0),
            )
        except OSError as exc:
            for fd in (read_fd, write_fd, seccomp_fd):
                if fd >= 0:
                    os.close(fd)
            if cgroup:
                cgroup.remove()
            raise SandboxError(f"could not start the sandbox: {exc}") from exc
        if report:
            os.close(write_fd)
        if seccomp_fd >= 0:
            os.close(seccomp_fd)
        output = _Collector(proc.stdout)
        reader = _Collector(os.fdopen(read_fd, "rb")) if report else None
        try:
            timed_out, cancelled = _wait(proc, started + timeout, stop)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if self.is_root and self.defenses.isolate:
                kill_all(uid, cgroup)
            proc.wait()
            if cgroup:
                cgroup.remove()
        text = output.text()
        if proc.returncode == 125 and CGROUP_JOIN_FAILED in text:
            raise SandboxError(f"{CGROUP_JOIN_FAILED}: {text.strip()[-500:]}")
        return Run(
            returncode=proc.returncode,
            timed_out=timed_out,
            seconds=time.monotonic() - started,
            output=text,
            report=reader.text() if reader else "",
            report_seconds=(reader.first_at - started) if reader and reader.first_at else 0.0,
            cancelled=cancelled,
            limits_applied=[
                *(cgroup.applied if cgroup else []),
                *(self._rlimits()[1:-1] if self.defenses.isolate else []),
            ],
        )

    def _rlimits(self) -> list[str]:
        """prlimit's argv prefix: processes, open files, file size (the workspace's), no cores."""
        limits = self.limits
        return [
            "prlimit",
            f"--nproc={limits.pids}",
            f"--nofile={limits.open_files}",
            f"--fsize={limits.workspace_bytes}",
            "--core=0",
            "--",
        ]

    def _bwrap(
        self,
        command: Sequence[str],
        *,
        uid: int,
        binds: Sequence[tuple[str, str, bool]],
        cwd: str,
        network: bool,
        seccomp_fd: int = -1,
    ) -> list[str]:
        """bwrap argv. As root, bwrap sets up namespaces and mounts with its privileges and
        `setpriv` inside drops to the trial's own host uid (no user namespace: the processes are
        plainly uid N on the host). Otherwise bwrap runs unprivileged in a user namespace."""
        limits = self.limits
        all_binds = [
            *((str(r), str(r), False) for r in _python_roots()),
            (str(self.inner_lib), INNER_LIB, False),
            (str(self.task_env), str(self.task_env), False),
            *binds,
        ]
        if self.is_root:
            args = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
            if not network:
                args.append("--unshare-net")
            args += ["--cap-drop", "ALL"]
            # Only what setpriv needs to become the trial uid; it clears them all on the way.
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:
            args = ["bwrap", "--unshare-all", "--cap-drop", "ALL"]
            if network:
                args.append("--share-net")
        args += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
        if seccomp_fd >= 0:
            args += ["--seccomp", str(seccomp_fd)]
        args += _system_binds()
        args += ["--proc", "/proc", "--dev", "/dev"]
        # The tmpfs mounts come before the folders for the binds: a bind below /tmp (a test's
        # temp folder, say) must land on the sandbox's /tmp, not on a folder the tmpfs hides.
        args += ["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]  # noqa: S108 - private
        args += _mount_points([("", HOME + "/x", False)])
        args += ["--size", str(limits.tmp_bytes), "--perms", "0777", "--tmpfs", HOME]
        args += _mount_points(all_binds)
        for host, inside, writable in all_binds:
            args += ["--bind" if writable else "--ro-bind", host, inside]
        # legorl itself, where an installed copy sits inside a bound Python environment, is
        # hidden: it holds the bundled task set, every gold fix included.
        for hidden in _legorl_installs(_python_roots()):
            args += ["--tmpfs", str(hidden)]
        args += ["--chdir", cwd]
        if self.is_root:
            drop = [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
            ]
            return [*args, "--", *drop, *command]
        return [*args, "--", *command]


def _wait(proc: subprocess.Popen[bytes], deadline: float, stop: threading.Event | None) -> tuple[bool, bool]:
    """Wait for `proc` until `deadline` or `stop`; (timed out, cancelled)."""
    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
            return False, False
        except subprocess.TimeoutExpired:
            if stop is not None and stop.is_set():
                return False, True
            if time.monotonic() >= deadline:
                return True, False


def _cgroup_join(cgroup: Cgroup | None) -> list[str]:
    """A root shell that moves itself into the sandbox's cgroups, then execs the rest."""
    if not (cgroup and cgroup.paths):
        return []
    # Quoted: a trial id is part of the cgroup's name, and this shell runs as root.
    joins = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in cgroup.procs_files())
    fail = f'echo "{CGROUP_JOIN_FAILED}" >&2; exit 125'
    return ["/bin/sh", "-c", f'{{ {joins}; }} || {{ {fail}; }}; exec "$@"', "legorl-sandbox"]


def _translate(
    command: Sequence[str], cwd: str, env: Mapping[str, str], binds: Sequence[tuple[str, str, bool]]
) -> tuple[list[str], str, dict[str, str]]:
    """Without isolation (defenses off, for measuring their cost) sandbox paths become host paths."""

    def host(value: str) -> str:
        for src, inside, _ in sorted(binds, key=lambda b: -len(b[1])):
            if value == inside or value.startswith(inside + "/"):
                return src + value[len(inside) :]
            value = value.replace(f"={inside}/", f"={src}/")
        return value

    new_env = {**os.environ, **{k: host(v) for k, v in env.items()}}
    new_env["PYTHONPATH"] = str(SANDBOX_PACKAGE.parent.parent)
    return [host(a) for a in command], host(cwd), new_env


class _Collector:
    """Drains a pipe on a thread (bounded), so a chatty child never blocks on a full pipe."""

    LIMIT = 256 * 1024

    def __init__(self, stream: object) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._stream = stream
        self.first_at: float | None = None
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        stream = self._stream
        assert hasattr(stream, "read")
        with contextlib.suppress(OSError, ValueError):
            while chunk := stream.read(65536):
                if self.first_at is None:
                    self.first_at = time.monotonic()
                if self._size < self.LIMIT:
                    self._chunks.append(chunk)
                    self._size += len(chunk)
        with contextlib.suppress(OSError):
            stream.close()  # type: ignore[attr-defined]

    def text(self) -> str:
        self._thread.join(timeout=5)
        data = b"".join(self._chunks)
        if len(data) > self.LIMIT:
            data = data[-self.LIMIT :]
        return data.decode("utf-8", errors="replace")


def parse_report(report: str) -> list[Check]:
    """The inner process's self-test report (an empty or broken one is a failed check)."""
    try:
        items = json.loads(report.strip().splitlines()[0]) if report.strip() else None
    except (json.JSONDecodeError, IndexError):
        items = None
    if not isinstance(items, list):
        return [Check("egress.report", False, "the sandbox sent no self-test report")]
    return [Check(str(i["name"]), i["result"] == "Passed", str(i.get("message", ""))) for i in items]
