"""Which process wrote a file, and whether that process is provably gone.

Lock files (`core.lock`) and the manager's staging folders record who made them (a staging folder in its
name too, `machine_tag`), so that a later process can tell a holder or a writer that died from one still at
work. From another machine nothing can be proved: a process is gone only when it ran on this machine, in
this process namespace, and its pid is dead (or now belongs to a process started at another time).
Everything else is unknown, and callers fall back to the age of what was written.

Two machines may carry one host name, and a container sharing the host's name (`--net=host`) sees other
pids: the boot id and the pid namespace recorded beside the host name keep such a process from being
declared dead on the strength of a pid that means something else here.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import cache

__all__ = ["Liveness", "ProcessRecord", "alive", "machine_tag", "process_start"]

#: pids are at most 2**22 on Linux; a larger one in a record is not a process id.
_MAX_PID = 2**31 - 1


class Liveness(enum.Enum):
    """What can be known here about a recorded process."""

    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"  # another machine or process namespace: nothing can be proved from here


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    """One process, as recorded in a file it writes.

    Attributes:
        host: the host name.
        pid: the process id on that host.
        pid_start: the process start time (Linux), which tells a reused pid from the process.
        boot_id: the kernel's boot id (Linux): another value means another boot or another machine.
        pid_namespace: the pid namespace (Linux): another value means the pid means nothing here.
        started: when the record was written (ISO 8601).
    """

    host: str
    pid: int
    pid_start: str | None = None
    boot_id: str | None = None
    pid_namespace: str | None = None
    started: str = ""

    @classmethod
    def current(cls) -> ProcessRecord:
        """This process."""
        pid = os.getpid()
        return cls(
            host=_host_name(),
            pid=pid,
            pid_start=process_start(pid),
            boot_id=_boot_id(),
            pid_namespace=_pid_namespace(),
            started=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def parse(cls, data: bytes) -> ProcessRecord | None:
        """The record in `data`, or None when it is not one (half-written, or another tool's file)."""
        try:
            doc = json.loads(data)
            pid = doc["pid"]
            if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID:
                return None
            optional = {key: None if doc.get(key) is None else str(doc[key]) for key in _OPTIONAL}
            return cls(host=str(doc["host"]), pid=pid, started=str(doc.get("started", "")), **optional)
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not an object of ours
            return None

    def liveness(self) -> Liveness:
        """Whether the process still runs, as far as this machine can tell."""
        if self.host != _host_name():
            return Liveness.UNKNOWN
        for recorded, here in ((self.boot_id, _boot_id()), (self.pid_namespace, _pid_namespace())):
            if recorded is not None and here is not None and recorded != here:
                return Liveness.UNKNOWN
        return Liveness.ALIVE if alive(self.pid, self.pid_start) else Liveness.GONE

    @classmethod
    def tagged(cls, pid: int, tag: str) -> ProcessRecord | None:
        """Process `pid` of the machine whose `machine_tag` is `tag` (a name that carries both), when that is
        this machine and this pid namespace: its liveness can be checked. None for any other: nothing can
        be told about it from here."""
        if tag != machine_tag() or not 0 < pid <= _MAX_PID:
            return None
        return cls(host=_host_name(), pid=pid, boot_id=_boot_id(), pid_namespace=_pid_namespace())

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


_OPTIONAL = ("pid_start", "boot_id", "pid_namespace")


def alive(pid: int, start: str | None) -> bool:
    """Whether process `pid` of this machine runs and, when its start time `start` is known, is that process.

    A killed process whose parent has not collected it yet (a zombie) is gone: it can write nothing more.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to another user
        pass
    except OSError:
        return True
    fields = _stat_fields(pid)
    if fields and fields[0] in ("Z", "X"):
        return False
    current = _start_of(fields)
    return start is None or current is None or current == start


@cache
def machine_tag() -> str:
    """This machine and pid namespace in 12 hex digits: a digest of what `ProcessRecord.liveness` compares
    (host name, boot id, pid namespace), for a name that must say whose it is where no file can be written
    beside it first (`ProcessRecord.tagged`)."""
    identity = "\n".join((_host_name(), _boot_id() or "", _pid_namespace() or ""))
    return hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()


def _host_name() -> str:
    import socket  # imported here: every reader of a native checkpoint imports this module (a command's fixed cost)

    return socket.gethostname()


def process_start(pid: int) -> str | None:
    """The start time of a process in clock ticks since boot (Linux), or None where unknown."""
    return _start_of(_stat_fields(pid))


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat from field 3 (the state) on (Linux); none elsewhere or when unreadable."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return []
    return stat.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces


def _start_of(fields: list[str]) -> str | None:
    return fields[19] if len(fields) > 19 else None  # field 22: the start time in clock ticks since boot


@cache
def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


@cache
def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
