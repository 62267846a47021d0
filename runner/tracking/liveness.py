"""Is the process that owns a RUNNING MLflow run still there?

MLflow has no liveness of its own: a run whose process was killed without a chance to end it
(SIGKILL, the kernel's OOM killer, a node losing power, a scheduler's kill after its grace period)
stays RUNNING forever. So every run records who runs it, as tags (named in runner.tracking.tags):
the host,
the pid and, on Linux, the process's start time (clock ticks since boot) and where that pid means
that process (the boot id and PID namespace: a pid reused after the process died, after a reboot or
in another container is not mistaken for it), plus a heartbeat, the time refreshed every
`mlflow.heartbeat_s` seconds by a background thread (runner.tracking.mlflow_run).

`vanished` judges a run from those tags, conservatively (a live run is never judged gone):

- the same host, boot and PID namespace as the judge: gone when the pid is not alive, or is alive
  but started at another time (another process); alive when it is the same process. Where the
  start time cannot be read (not Linux) a live pid is judged by the heartbeat, as below.
- anywhere else (another host, another container, before a reboot): gone when the heartbeat is
  older than `stale_after_s` seconds.
- a run without these tags (written by an older runner, or by another tool in the same
  experiment) is never judged gone: nothing tells how long it may legitimately run.

A vanished run's reason adds the likely cause where this machine can tell it: the kernel's OOM
killer, whose kills /proc/vmstat counts (`oom_kill`), at work after the run's last heartbeat (each
heartbeat records the count).

Functions of tags, the local process table and /proc/vmstat: nothing here talks to MLflow.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runner.tracking import tags as tag

LIVENESS_TAGS = (tag.HOST, tag.PID, tag.PID_START, tag.PID_SPACE, tag.HEARTBEAT)
VANISHED = "process vanished"  # how the `error` tag of a run ended by a reaper begins

_PROC = Path("/proc")


def now_iso(seconds: float | None = None) -> str:
    """A heartbeat: the UTC time, to the second, e.g. 2026-01-31T10:00:00+00:00."""
    moment = (
        _dt.datetime.now(_dt.timezone.utc)
        if seconds is None
        else _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc)
    )
    return moment.isoformat(timespec="seconds")


def parse_iso(text: str) -> float | None:
    """Seconds since the epoch of a heartbeat; None for anything else."""
    try:
        moment = _dt.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp()


def _start_ticks(pid: int) -> tuple[bool, str | None]:
    """(whether /proc/<pid> is a living process, its start time in clock ticks since boot).
    A zombie (killed, not yet waited for by its parent) is not living."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False, None
    except OSError:  # unreadable: alive, identity unknown
        return True, None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; field 22 is starttime
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20:
        return True, None
    if fields[0] in ("Z", "X"):
        return False, None
    return True, fields[19]


def _pid_space() -> str | None:
    try:
        boot = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink(_PROC / "self/ns/pid")
    except OSError:
        return None
    return f"{boot}:{namespace}" if boot else None


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a run's process is; `start` and `space` are None where they cannot be read."""

    host: str
    pid: int
    start: str | None = None
    space: str | None = None

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _start_ticks(pid)[1], _pid_space())

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> ProcessIdentity | None:
        try:
            return cls(
                tags[tag.HOST],
                int(tags[tag.PID]),
                tags.get(tag.PID_START) or None,
                tags.get(tag.PID_SPACE) or None,
            )
        except (KeyError, ValueError):
            return None

    def tags(self) -> dict[str, str]:
        tags = {tag.HOST: self.host, tag.PID: str(self.pid)}
        if self.start is not None:
            tags[tag.PID_START] = self.start
        if self.space is not None:
            tags[tag.PID_SPACE] = self.space
        return tags

    def shares_pids_with(self, other: ProcessIdentity) -> bool:
        """Whether this identity's pid can be looked up in `other`'s process table."""
        return self.host == other.host and self.space == other.space


def process_state(pid: int, start: str | None) -> str:
    """What pid `pid` is in this machine's process table: "gone", "other" (alive, another
    process: it started at another time than `start`), "same", or "unknown" (alive, but whether it
    is the same process cannot be told: no start time on either side)."""
    if (_PROC / "self/stat").is_file():
        alive, ticks = _start_ticks(pid)
        if not alive:
            return "gone"
        if start is None or ticks is None:
            return "unknown"
        return "same" if ticks == start else "other"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:  # someone else's process: alive
        pass
    return "unknown"


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended on this machine since it booted
    (Linux 4.13+: `oom_kill` in /proc/vmstat, which any user reads, whatever container it is
    in); None where it cannot be read."""
    try:
        for line in (_PROC / "vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def heartbeat_tags() -> dict[str, str]:
    """What a heartbeat writes: the time, and the machine's OOM-kill count (`oom_kills`), by
    which a reaper can tell the OOM killer was at work after it."""
    beat = {tag.HEARTBEAT: now_iso()}
    count = oom_kills()
    if count is not None:
        beat[tag.OOM_KILLS] = str(count)
    return beat


def oom_killed_since(
    tags: Mapping[str, str], here: ProcessIdentity, count: int | None = None
) -> int:
    """How many processes the OOM killer ended on this machine since the run's last heartbeat
    (`tag.OOM_KILLS`, the count it saw then; `count`: the count now, default `oom_kills`),
    where the run ran on this machine in this boot (the boot id of its pid space); 0 where that
    cannot be told."""
    owner = ProcessIdentity.from_tags(tags)
    then = tags.get(tag.OOM_KILLS, "")
    if owner is None or owner.space is None or here.space is None or not then.isdigit():
        return 0
    if owner.space.split(":", 1)[0] != here.space.split(":", 1)[0]:  # another machine or boot
        return 0
    now = oom_kills() if count is None else count
    return max(now - int(then), 0) if now is not None else 0


def vanished_reason(
    tags: Mapping[str, str], here: ProcessIdentity | None = None, count: int | None = None
) -> str:
    """The `error` tag of a run whose process vanished (what a reaper writes), with the likely
    cause where the judge (`here`) can see it: the kernel's OOM killer at work since
    (`oom_killed_since`)."""
    reason = (
        f"{VANISHED}: no heartbeat since {tags.get(tag.HEARTBEAT, '?')} "
        f"(host {tags.get(tag.HOST, '?')}, pid {tags.get(tag.PID, '?')})"
    )
    killed = oom_killed_since(tags, here, count) if here is not None else 0
    if killed:
        reason += (
            f"; the kernel's OOM killer ended {killed} process{'es' if killed > 1 else ''} on "
            "this machine after that heartbeat: most likely this one, out of memory"
        )
    return reason


def vanished(
    tags: Mapping[str, str],
    stale_after_s: float,
    here: ProcessIdentity | None = None,
    now: float | None = None,
) -> str | None:
    """The reason a RUNNING run's process is known to be gone (`vanished_reason`), or None when
    it is alive or cannot be judged (see the module's rules). `here`: the judging process
    (default: this one); `now`: seconds since the epoch (default: the clock)."""
    owner = ProcessIdentity.from_tags(tags)
    beat = parse_iso(tags.get(tag.HEARTBEAT, ""))
    if owner is None or beat is None:
        return None  # not a run with liveness tags: never judged
    here = here or ProcessIdentity.current()
    if owner.shares_pids_with(here):
        state = process_state(owner.pid, owner.start)
        if state in ("gone", "other"):
            return vanished_reason(tags, here)
        if state == "same":
            return None
    now = _dt.datetime.now(_dt.timezone.utc).timestamp() if now is None else now
    return vanished_reason(tags, here) if now - beat > stale_after_s else None


def owner_alive(tags: Mapping[str, str], stale_after_s: float) -> str | None:
    """Who still runs a RUNNING run ("pid 123 on host-a, heartbeat 40 s ago"), where its tags
    say it is alive (the same process on this machine, or a fresh heartbeat from another); None
    where it is gone, or where no tags tell (an older runner's run: never judged alive)."""
    owner = ProcessIdentity.from_tags(tags)
    beat = parse_iso(tags.get(tag.HEARTBEAT, ""))
    if owner is None or beat is None or vanished(tags, stale_after_s) is not None:
        return None
    age = _dt.datetime.now(_dt.timezone.utc).timestamp() - beat
    return f"pid {owner.pid} on {owner.host}, heartbeat {max(age, 0):.0f} s ago"


def was_reaped(tags: Mapping[str, str]) -> bool:
    """Whether a run was ended by a reaper (its `error` tag says its process vanished)."""
    return tags.get(tag.ERROR, "").startswith(VANISHED)
