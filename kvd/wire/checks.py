"""What ``kvd doctor`` finds: checks, one line each, ``ok``, ``WARN``, ``FAIL`` or ``skip``
with what was found and what to do, and the report they make as text or JSON.

Two doctors make them: the engine's (engine_client/doctor.py, run where an engine runs)
and the disk tier's (kvd/disk/doctor.py, ``kvd doctor --disk``, run where the daemon runs).
Both print the same way, so this lives where both sides may import it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass


class Status(enum.Enum):
    OK = "ok"
    WARN = "WARN"  # it works, less well than configured
    FAIL = "FAIL"  # it would not work: errors, or nothing served
    SKIP = "skip"  # not checked: a check it needs did not pass


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str  # what was found
    fix: str = ""  # what to do, for WARN and FAIL


def passed(checks: list[Check]) -> bool:
    """No check failed."""
    return all(c.status is not Status.FAIL for c in checks)


def report_text(checks: list[Check], subject: str) -> str:
    """One line per check (and its fix), then whether ``subject`` ("an engine here") would
    work with kvd."""
    lines = []
    for c in checks:
        lines.append(f"{c.status.value:<5} {c.name}: {c.detail}")
        if c.fix:
            lines.append(f"      fix: {c.fix}")
    failed = [c.name for c in checks if c.status is Status.FAIL]
    lines.append(
        f"{subject} would not work with kvd: {', '.join(failed)} failed" if failed else f"{subject} would work with kvd"
    )
    return "\n".join(lines)


def report_json(checks: list[Check]) -> str:
    """``{"ok": ..., "checks": [{"name", "status", "detail", "fix"}, ...]}``, for scripts."""
    return json.dumps(
        {"ok": passed(checks), "checks": [asdict(c) | {"status": c.status.value} for c in checks]}, indent=2
    )
