"""Run a command in its own process group and, on a timeout, kill everything it started — not only its first
process. `subprocess.run(..., timeout=)` kills the one process it started: for `bash recipes/run_*.sh` that is
bash, while `gerl train` and its Ray processes go on holding the GPU.

Two nets, because one is not enough:
- the command starts a new session (its own process group): killing the group reaches every descendant that
  stayed in it (bash, `gerl train`, Ray's GCS, raylet and workers: Ray starts them without setsid);
- every process started gets a marker in its environment (`GERL_PROCGROUP=...:<token>`), which children inherit even
  when they start a session of their own or are re-parented to init; after the group is killed (and after a
  normal exit too), any process still carrying the marker is killed by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

MARK = "GERL_PROCGROUP"


def pinned_and_interruptible(cores) -> Callable[[], None]:
    """A `preexec_fn`: pin the child to `cores` and give SIGINT its default action there. A parent started with
    SIGINT ignored (`nohup … &`, a script's background job, some CI runners) passes the ignore on through exec, and
    a Python started so installs no KeyboardInterrupt handler: a SIGINT sent before `gerl train` takes the signal
    over (while it imports) would be lost and the run would go on to its last step."""
    cores = set(cores)

    def setup() -> None:
        os.sched_setaffinity(0, cores)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return setup


def marked_env(env: dict | None = None) -> tuple[dict, str]:
    """(a copy of `env` (default os.environ) carrying a fresh marker, the marker's token)."""
    env = dict(os.environ if env is None else env)
    token = uuid.uuid4().hex
    # appended, not replaced: a marked command that runs another (gpu_day → a launcher) keeps the outer marker,
    # so the outer sweep still finds the inner command's processes
    env[MARK] = f"{env[MARK]}:{token}" if env.get(MARK) else token
    return env, token


def marked_pids(token: str) -> list[int]:
    """Live processes (not this one) whose environment carries the marker `token`."""
    prefix, want = f"{MARK}=".encode(), token.encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            entries = (d / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(e.startswith(prefix) and want in e[len(prefix):].split(b":") for e in entries):
            found.append(int(d.name))
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_everything(proc: subprocess.Popen, token: str, grace_s: float = 5.0) -> int:
    """SIGTERM the process group (a chance to clean up), SIGKILL it after `grace_s`, then SIGKILL every process
    still carrying the marker. Returns how many marked processes had to be killed by pid."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    return sweep(token, killed_group=proc.pid)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _dead(pid: int) -> bool:
    """Gone, or a zombie (exited; only its parent's wait is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] in "ZX"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def sweep(token: str, wait_s: float = 30.0, killed_group: int | None = None) -> int:
    """SIGKILL every live process carrying the marker; wait until they are dead (at most `wait_s`: only a process
    stuck in the kernel takes that long). Returns how many there were, not counting members of `killed_group`: a
    group just sent SIGKILL may still show a member that is dying (on a busy machine it can take a moment), which is
    no straggler."""
    pids = marked_pids(token)
    # read before the kill; a member that is gone already (None) was dying too
    stragglers = [p for p in pids if killed_group is None or _pgid(p) not in (killed_group, None)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    # wait for the processes themselves, not for their marker: a dying process's environment reads empty as soon as
    # its memory is released, a moment before it has exited (its files still open, not yet a zombie)
    deadline = time.monotonic() + wait_s
    while not all(_dead(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(stragglers)


def run_group(cmd: list[str], timeout_s: float, env: dict | None = None, **popen) -> tuple[int | None, int]:
    """Run `cmd` in a new session with a marked environment. Returns (its exit code, or None when it ran past
    `timeout_s` and everything it started was killed; the number of stragglers killed by pid afterwards). Any
    process it left behind after a normal exit (a daemon, a Ray agent) is killed too."""
    env, token = marked_env(env)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, kill_everything(proc, token)
    except BaseException:  # interrupted (Ctrl-C, SIGTERM turned into an exception): take the children down too
        kill_everything(proc, token)
        raise
    return code, sweep(token)
