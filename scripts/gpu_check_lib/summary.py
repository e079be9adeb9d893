"""The JSON summary of a gpu_check run, written after every check.

The file is rewritten before each check starts (naming it as ``running``) and after it ends, so that a run the
shell's ``timeout`` kills, or a check that hangs, still leaves every result so far and the check it stopped in.
Checks are listed apart by outcome: ``passed``, ``skipped`` (each with its reason: a check that could not run here
checked nothing, so it is never counted as passed) and ``failed``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

PASS, SKIP, FAIL = "pass", "skip", "fail"


class Summary:
    """The run's results so far and where they are written."""

    def __init__(self, path: Path, header: dict, planned: list):
        self.path = path
        self.header = dict(header)
        """What the run is (mode, device, versions), written at the top."""
        self.planned = list(planned)
        """The checks this run will run, in order."""
        self.checks: Dict[str, dict] = {}
        self.running: Optional[str] = None

    def start(self, name: str) -> None:
        self.running = name
        self.write()

    def record(self, name: str, result: dict) -> None:
        self.checks[name] = result
        self.running = None
        self.write()

    def names(self, status: str) -> list:
        return [name for name, result in self.checks.items() if result.get("status") == status]

    @property
    def failed(self) -> bool:
        """A check failed (a result that is neither a pass nor a skip fails)."""
        return any(result.get("status") not in (PASS, SKIP) for result in self.checks.values())

    def as_dict(self, complete: bool = False, interrupted: Optional[str] = None) -> dict:
        passed, skipped = self.names(PASS), self.names(SKIP)
        failed = [name for name in self.checks if name not in passed and name not in skipped]
        pending = [name for name in self.planned if name not in self.checks]
        out = {**self.header,
               "complete": complete,
               "all_passed": complete and not failed and not skipped and not pending,
               "no_failures": complete and not failed,
               "counts": {"passed": len(passed), "skipped": len(skipped), "failed": len(failed),
                          "not_run": len(pending), "total": len(self.planned)},
               "passed": passed,
               "skipped": {name: self.checks[name].get("reason", "") for name in skipped},
               "failed": failed,
               "running": self.running, "not_run": pending}
        if interrupted:
            out["interrupted"] = interrupted
        out["checks"] = self.checks
        return out

    def write(self, complete: bool = False, interrupted: Optional[str] = None) -> str:
        """Write the summary (a temporary file renamed over the old one: a reader never sees half a file)."""
        text = json.dumps(self.as_dict(complete, interrupted), indent=1, default=str)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text)
        partial.replace(self.path)
        return text

    def line(self) -> str:
        """One line for the end of the run."""
        counts = self.as_dict(True)["counts"]
        verdict = "FAILED" if self.failed else ("PASSED" if not counts["skipped"] else "NO FAILURES")
        return (f"gpu_check: {verdict}: {counts['passed']} passed, {counts['skipped']} skipped (not passed), "
                f"{counts['failed']} failed of {counts['total']}; summary in {self.path}")
