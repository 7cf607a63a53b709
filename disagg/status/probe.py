"""HTTP for `disagg status`: GET the router's and every instance's endpoints, all at once.

Owns the I/O and nothing else: every failure becomes an `Answer` with the reason (the view
shows a dead instance as down instead of stopping), and snapshot.py turns answers into records.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from disagg.status.answer import Answer
from disagg.status.records import ClusterStatus
from disagg.status.snapshot import INSTANCE_PATHS, ROUTER_PATHS, build_cluster, parse_instance_list

__all__ = ["fetch", "take_snapshot"]

MAX_BODY_BYTES = 16 * 1024 * 1024  # a /metrics page is kilobytes; anything bigger is not ours
_MAX_THREADS = 32
# No proxies: instances are cluster-internal addresses, reached as the router reaches them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str, timeout_s: float) -> Answer:
    """GET `url`; never raises."""
    try:
        with _OPENER.open(url, timeout=timeout_s) as resp:
            return Answer(resp.status, resp.read(MAX_BODY_BYTES))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, _read_quietly(exc), f"HTTP {exc.code}")
    except urllib.error.URLError as exc:
        return Answer(None, error=str(exc.reason))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Answer(None, error=str(exc) or type(exc).__name__)


def _read_quietly(exc: urllib.error.HTTPError) -> bytes:
    try:
        return exc.read(MAX_BODY_BYTES)
    except (OSError, http.client.HTTPException):
        return b""


def _fetch_all(pool: ThreadPoolExecutor, urls: list[str], timeout_s: float) -> dict[str, Answer]:
    answers = pool.map(lambda url: fetch(url, timeout_s), urls)
    return dict(zip(urls, answers, strict=True))


def take_snapshot(router_url: str, timeout_s: float) -> ClusterStatus:
    """Ask the router which instances it has, then ask each of them: one snapshot."""
    with ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="status-probe") as pool:
        router = _fetch_all(pool, [f"{router_url}{path}" for path in ROUTER_PATHS], timeout_s)
        router_answers = {path: router[f"{router_url}{path}"] for path in ROUTER_PATHS}
        try:
            rows = parse_instance_list(router_answers["/instances"])
        except ValueError:
            rows = []  # build_cluster names the router's answer as the problem
        urls = [f"{row.url}{path}" for row in rows for path in INSTANCE_PATHS]
        answers = _fetch_all(pool, urls, timeout_s)
    instances = [
        (row, {path: answers[f"{row.url}{path}"] for path in INSTANCE_PATHS}) for row in rows
    ]
    return build_cluster(router_url, router_answers, instances, taken_at_s=time.time())
