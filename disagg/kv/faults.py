"""Fault injection for tests and drills: a hook, not product config (no flag, no config field).

The connector factory reads one environment variable, `DISAGG_KV_FAULTS`: a JSON object of
`KVFaults` fields, e.g. `{"fail_transfer": true}`; unset or empty, nothing is injected. It is
per process: put it in the environment of the one instance that should misbehave.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from disagg.kv.transport import TransportError

__all__ = ["FAULTS_ENV", "KVFaults"]

FAULTS_ENV = "DISAGG_KV_FAULTS"


@dataclass(frozen=True, slots=True, kw_only=True)
class KVFaults:
    fail_transfer: bool = False  # every transfer this instance starts fails at its post
    register_delay_s: float = 0.0  # push, decode side: register reserved blocks this late

    def __post_init__(self) -> None:
        if type(self.fail_transfer) is not bool:
            raise ValueError(f"fail_transfer must be true or false, got {self.fail_transfer!r}")
        if type(self.register_delay_s) not in (int, float) or not self.register_delay_s >= 0:
            raise ValueError(f"register_delay_s must be >= 0, got {self.register_delay_s!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KVFaults:
        """The faults `environ[FAULTS_ENV]` names; ValueError naming the variable if bad."""
        try:  # an unknown field is a TypeError
            return cls(**json.loads(environ.get(FAULTS_ENV) or "{}"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"bad {FAULTS_ENV} (a JSON object of KVFaults fields): {exc}") from exc

    def as_env(self) -> dict[str, str]:
        """The environment entry that hands these faults to a child process."""
        return {FAULTS_ENV: json.dumps(asdict(self))}

    def check_transfer(self) -> None:
        """Raise the injected failure where a transfer is about to be posted."""
        if self.fail_transfer:
            raise TransportError("injected transfer failure (fail_transfer)")
