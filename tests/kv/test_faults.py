"""The fault-injection test hook: parsed from one environment variable per process, refused
with the variable's name when malformed, and injected where a transfer is posted."""

from __future__ import annotations

import json
import threading

import pytest

from disagg.kv.faults import FAULTS_ENV, KVFaults
from disagg.kv.pull_reader import PullReader
from disagg.kv.transport import TransportError
from tests.kv.fakes import FakeBase
from tests.kv.test_pull_reader import _load


def test_unset_or_empty_injects_nothing() -> None:
    assert KVFaults.from_env({}) == KVFaults() == KVFaults.from_env({FAULTS_ENV: ""})
    KVFaults().check_transfer()  # no fault: no raise


def test_env_round_trip() -> None:
    faults = KVFaults(fail_transfer=True, register_delay_s=1.5)
    env = faults.as_env()
    assert json.loads(env[FAULTS_ENV]) == {"fail_transfer": True, "register_delay_s": 1.5}
    assert KVFaults.from_env(env) == faults


@pytest.mark.parametrize(
    "raw",
    [
        "fail_transfer",  # the old flag's spelling: not JSON
        "[1]",
        '{"fail": true}',
        '{"fail_transfer": "yes"}',
        '{"register_delay_s": -1}',
        '{"register_delay_s": NaN}',
    ],
)
def test_malformed_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=FAULTS_ENV):
        KVFaults.from_env({FAULTS_ENV: raw})


def test_fail_transfer_fails_each_post_by_name() -> None:
    with pytest.raises(TransportError, match="injected transfer failure"):
        KVFaults(fail_transfer=True).check_transfer()
    base = FakeBase(faults=KVFaults(fail_transfer=True))
    reader = PullReader(base, is_background=False, stopping=threading.Event())
    reader.add([_load()])
    reader.step()
    assert "injected transfer failure" in base.reports.failed["r"].reason
    assert not base.transport.posted  # refused before the transport saw it
