"""Run untrusted Python (a model's completion) against test asserts in a separate, limited process.

Each call gets a fresh temporary directory and one ``python -I -S -B`` process (isolated mode: no user
site, no environment variables, no current directory on ``sys.path``; no ``site``, so only the standard
library imports) started in its own session, with a minimal environment and the sandbox directory as its
working directory. A small trusted runner script (``_RUNNER``) first applies the resource limits to itself
with ``resource.setrlimit`` -- soft and hard limits equal -- and installs an audit hook (``sys.addaudithook``,
which cannot be removed), then executes the program and each test in turn. Limits are set by the runner
rather than in a ``preexec_fn`` because ``preexec_fn`` is not safe in a parent with threads (the trainer has
them); the effect is the same, since nothing untrusted runs before them.

Limits (the defaults below, each overridable per call):

- CPU time ``CPU_SECONDS`` (RLIMIT_CPU; SIGXCPU then SIGKILL), address space ``MEMORY_BYTES`` (RLIMIT_AS:
  an allocation beyond it raises MemoryError), written file size ``FILE_BYTES`` (RLIMIT_FSIZE),
  processes ``MAX_PROCESSES`` (RLIMIT_NPROC; root ignores it, hence the hook) and no core files;
- wall clock ``WALL_SECONDS``: then the whole process group is killed (``os.killpg`` with SIGKILL), as it
  also is after a normal exit, so nothing the program started outlives the call;
- the audit hook raises PermissionError on starting processes (``os.fork``, ``os.system``, ``os.exec``,
  ``os.posix_spawn``, ``os.spawn``, ``subprocess.Popen``, ...), signalling others (``os.kill``), sockets
  (``socket.__new__``, ``connect``, ``bind``, ...), ``ctypes``, raising resource limits, and on opening a
  path for writing (or creating, renaming, removing, linking, changing modes of one) outside the sandbox
  directory.

The temporary directory is removed afterwards. Test results come back as JSON lines on a file descriptor
the runner keeps from before the program starts (the program's own stdout and stderr go to /dev/null), one
line per test as it finishes, so tests that ran before a crash or a time-out still count. The sandbox guards
the host. What the runner calls after the program (exec, compile, json.dumps, the report's write) is bound before
it, and the report is in none of the runner's globals, so replacing a builtin or reading ``__main__`` forges
nothing; a completion written to find the descriptor's number, or the runner's frame, on purpose still could: it
would have to target this runner.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

CPU_SECONDS = 2
"""RLIMIT_CPU of one run, in seconds of CPU time (the interpreter's start-up included)."""
WALL_SECONDS = 5.0
"""Wall-clock limit of one run, in seconds; the run's process group is killed when it passes."""
MEMORY_BYTES = 512 * 2**20
"""RLIMIT_AS of one run (virtual address space; the interpreter itself takes about 20-30 MiB)."""
FILE_BYTES = 1 * 2**20
"""RLIMIT_FSIZE of one run: the largest file it may write (its report to the host included)."""
MAX_PROCESSES = 1
"""RLIMIT_NPROC of one run (ignored for root, which the audit hook covers)."""

_RUNNER = r'''
import json, os, resource, sys

job = json.loads(sys.stdin.read())
lim = job["limits"]
for name, soft, hard in (("RLIMIT_CPU", lim["cpu"], lim["cpu"] + 1), ("RLIMIT_AS", lim["memory"], lim["memory"]),
                         ("RLIMIT_FSIZE", lim["fsize"], lim["fsize"]), ("RLIMIT_NPROC", lim["nproc"], lim["nproc"]),
                         ("RLIMIT_CORE", 0, 0)):
    resource.setrlimit(getattr(resource, name), (soft, hard))  # SIGXCPU at soft, SIGKILL at hard

def isolate():
    """The report's file (a copy of stdout), then stdin, stdout and stderr to /dev/null: the report is held by
    main's frame only, never a global."""
    report = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0); os.dup2(null, 1); os.dup2(null, 2)
    sys.stdin = sys.stdout = sys.stderr = open(os.devnull, "w")
    return report

root = os.path.realpath(os.getcwd())
BLOCKED = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
           "os.startfile", "os.setsid", "os.setuid", "os.setgid", "os.chroot", "subprocess.Popen", "pty.spawn",
           "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
           "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "sys.remote_exec", "ctypes.",
           "fcntl.ioctl")
PATH_ARGS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1),
             "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,),
             "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.move": (1,),
             "os.mknod": (0,), "os.mkfifo": (0,)}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

def outside(path):
    if isinstance(path, int):
        return False  # an already open descriptor: its opening was checked
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return True
    return real != root and not real.startswith(root + os.sep)

def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE)
        if writes and outside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox is not allowed")
    elif event in PATH_ARGS:
        for i in PATH_ARGS[event]:
            if i < len(args) and outside(args[i]):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the sandbox is not allowed")

def main(tests, program, report, exec=exec, compile=compile, dumps=json.dumps, exit=os._exit,
         BaseException=BaseException, type=type, str=str, enumerate=enumerate):
    # What runs after the program is bound here, before it: replacing builtins.exec (or compile, json.dumps) from
    # the completion would otherwise turn every test into a pass.
    write, flush = report.write, report.flush
    sys.addaudithook(hook)  # after isolate(), which opens /dev/null for writing
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(program, "<completion>", "exec"), namespace)
        failure = None
    except BaseException as e:
        failure = f"program raised {type(e).__name__}: {str(e)[:200]}"
        write(dumps({"error": failure}) + "\n")
    for i, test in enumerate(tests):
        ok, why = False, failure or ""
        if failure is None:
            try:
                exec(compile(test, f"<test {i}>", "exec"), namespace)
                ok = True
            except BaseException as e:
                why = f"{type(e).__name__}: {str(e)[:200]}"
        write(dumps({"test": i, "ok": ok, "why": why}) + "\n")
    write(dumps({"done": True}) + "\n")
    flush()
    exit(0)

tests, program = job["tests"], job["program"]
del job
main(tests, program, isolate())  # the report is in no global the program can reach (sys.modules["__main__"])
'''


@dataclass
class SandboxResult:
    """What one run did: tests passed of those given, and why it stopped short when it did."""

    passed: int
    total: int
    status: str  # "ok" (ran every test), "error" (the program failed before the tests), "timeout", "killed"
    seconds: float
    error: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def run_tests(program: str, tests: list[str], *, cpu_seconds: int = CPU_SECONDS, wall_seconds: float = WALL_SECONDS,
              memory_bytes: int = MEMORY_BYTES, file_bytes: int = FILE_BYTES,
              max_processes: int = MAX_PROCESSES) -> SandboxResult:
    """Run ``program`` then each of ``tests`` (Python source, each on its own) in a sandboxed process."""
    started = time.perf_counter()
    base = tempfile.mkdtemp(prefix="polyrl-sandbox-")
    try:
        work = os.path.join(base, "work")  # the program's directory; its report lands beside it, not in it
        os.mkdir(work)
        job = json.dumps({"program": program, "tests": list(tests),
                          "limits": {"cpu": int(cpu_seconds), "memory": int(memory_bytes), "fsize": int(file_bytes),
                                     "nproc": int(max_processes)}})
        report_path = os.path.join(base, "report.jsonl")
        with open(report_path, "wb") as report, tempfile.TemporaryFile() as stdin:
            stdin.write(job.encode())
            stdin.seek(0)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _RUNNER], stdin=stdin, stdout=report,
                                    stderr=subprocess.DEVNULL, cwd=work, env=env, start_new_session=True,
                                    close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the session's group: the runner and anything it started
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        with open(report_path, "rb") as f:
            lines = f.read(2 * file_bytes).decode("utf-8", "replace").splitlines()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results: dict[int, bool] = {}
    failures: list[str] = []
    error, done = "", False
    for line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(item, dict):
            continue
        if "error" in item:
            error = str(item["error"])
        elif item.get("done") is True:
            done = True
        elif isinstance(item.get("test"), int) and 0 <= item["test"] < len(tests):
            results[item["test"]] = item.get("ok") is True
            if item.get("ok") is not True and item.get("why"):
                failures.append(f"test {item['test']}: {item['why']}")
    passed = sum(results.values())
    if timed_out:
        status, error = "timeout", error or f"wall-clock limit of {wall_seconds} s"
    elif error:
        status = "error"
    elif not done:
        rc = proc.returncode
        status, error = "killed", (f"killed by signal {-rc} ({signal.Signals(-rc).name})"
                                   if rc is not None and rc < 0 else f"exited with status {rc} before the end")
    else:
        status = "ok"
    return SandboxResult(passed=passed, total=len(tests), status=status, seconds=time.perf_counter() - started,
                         error=error, failures=failures[:5])
