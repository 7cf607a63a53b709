"""The soak's end: each surviving instance's pool after a settle wait and its connector's
counters, RSS / threads / open fds of every survivor, the checks' verdicts (pools full, nobody
died unasked, no RSS growing) in one result dict, and the table printed from it.

Reads the finished soak; sends no load.
"""

from __future__ import annotations

import json
import time
from typing import Any

from soak_cluster import VICTIM, Child
from soak_http import request
from soak_state import COUNTS, DETAILS, Soak

SETTLE_S = 30.0  # pools must be full again within this after the load stops
RSS_GROWTH_MIB = 64.0  # more than this from half time to the end of the load: growing
KV_STATS = ("transfers", "transfers_failed", "expired_leases", "expired_reservations")


def _rss_summary(samples: list[float]) -> dict[str, float]:
    """first (after warm-up) / peak / at half time / last of one child's RSS samples (MiB)."""
    if not samples:
        return {}
    half = samples[len(samples) // 2]
    return {"first": samples[0], "peak": max(samples), "half": half, "last": samples[-1]}


def _settle(child: Child, deadline: float) -> dict[str, Any]:
    """An instance's pool once full (or at the deadline), and its connector's counters."""
    started = time.monotonic()
    while True:
        load = json.loads(request(child.url, "GET", "/load", timeout_s=5)[1])
        free, total = load["num_free_blocks"], load["num_total_blocks"]
        if free == total or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    pool = {"free_blocks": free, "total_blocks": total, "pool_full": free == total}
    pool["settle_s"] = round(time.monotonic() - started, 1)
    kv = json.loads(request(child.url, "GET", "/kv_info", timeout_s=5)[1]).get("stats", {})
    return pool | {key: kv[key] for key in KV_STATS if key in kv}


def report(soak: Soak, start: dict[str, Any]) -> dict[str, Any]:
    deadline, survivors = time.monotonic() + SETTLE_S, {}
    for name, child in soak.children.items():
        if child.alive:
            pool = {} if name.startswith("router") else _settle(child, deadline)
            rss = _rss_summary(soak.rss_mib[name])
            survivors[name] = {"start": start[name], "end": child.proc_stats(), **pool}
            survivors[name]["rss_mib"] = rss
    died = [n for n, c in soak.children.items() if n != VICTIM and not c.alive]
    details = {kind: dict(counter.most_common(20)) for kind, counter in soak.details.items()}
    growing = [
        n
        for n, c in survivors.items()
        if c["rss_mib"] and c["rss_mib"]["last"] - c["rss_mib"]["half"] > RSS_GROWTH_MIB
    ]
    return {
        **{key: soak.counts[key] for key in COUNTS},
        "pools_full": all(s.get("pool_full", True) for s in survivors.values()),
        "children_died": died, "killed": soak.killed, "rss_growing": growing, **details,
        "wrong": soak.wrong[:3], "children": survivors,
    }  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    for key in (*COUNTS, "pools_full", "children_died", "killed", "rss_growing"):
        print(f"{key:>22}  {result[key]}")
    for kind in DETAILS:
        for message, num in result[kind].items():
            print(f"{kind:>22}  {num:>5} x {message}")
    header = f"{'pool free/total':>15} {'rss MiB first/peak/last':>24} {'threads':>8} {'fds':>8}"
    print(f"{'child':>22}  {header}")
    for name, c in result["children"].items():
        pool = f"{c['free_blocks']}/{c['total_blocks']}" if "free_blocks" in c else "-"
        rss = "/".join(f"{c['rss_mib'].get(k, 0):g}" for k in ("first", "peak", "last"))
        moves = [f"{c['start'][k]:g}->{c['end'][k]:g}" for k in ("threads", "fds")]
        print(f"{name:>22}  {pool:>15} {rss:>24} {moves[0]:>8} {moves[1]:>8}")
