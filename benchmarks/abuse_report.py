"""abuse_bench.py's verdict and table: what makes the run fail (an attack not refused as
expected, a victim error, a death; never a timing) and the rows printed from the document.

Reads the finished document only.
"""

from __future__ import annotations

from typing import Any


def failures(doc: dict[str, Any]) -> list[str]:
    """What makes the run fail (not timings: the machine is shared)."""
    found = []
    for mode, result in doc["modes"].items():
        found += [
            f"{mode}: {r['attack']}: {r['statuses']}" for r in result["rows"] if not r["is_refused"]
        ]
        found += [f"{mode}: victim: {e}" for e in result["victim_errors"]]
        found += [f"{mode}: died: {result['died']}"] if result["died"] else []
    limited = doc["limited"]
    if not limited["alive_at_end"] or limited["normal_request_status"] != 200:
        found.append(f"limited instance: {limited}")
    found += [f"limited: {r['attack']}: HTTP {r['status']}" for r in limited["requests"]
              if not 400 <= r["status"] < 500]  # fmt: skip
    return found


def _row_line(r: dict[str, Any]) -> str:
    base, att = r["victim_baseline"], r["victim_attack"]
    status = ",".join(f"{k}x{v}" for k, v in r["statuses"].items())
    gaps = " / ".join(f"{base[k]} -> {att[k]}" for k in ("median_ms", "p99_ms", "max_ms"))
    ratios = "/".join(f"{r[k]}" for k in ("median_gap_ratio", "p99_gap_ratio", "max_gap_ratio"))
    health = ", ".join(
        f"{r['health'][n]['baseline']['max_ms']} -> {r['health'][n]['attack']['max_ms']}"
        for n in ("prefill", "decode")
    )
    return (f"{r['mode']:<5} {r['attack']:<36} {status:<9} {r['latency_max_ms']:>10} "
            f"{gaps:>46} {ratios:>16} {health:>36}")  # fmt: skip


def print_table(doc: dict[str, Any]) -> None:
    cpu = doc["cpu"]
    print(f"cpu: {cpu['model']}, {cpu['cpus']} cpus, flags: {' '.join(cpu['flags_shown'])} "
          f"(of {len(cpu['flags'])}); load 1m {cpu['loadavg_1m_start']:.2f} -> "
          f"{cpu['loadavg_1m_end']:.2f} (shared machine: figures are noisy)")  # fmt: skip
    print(f"{'mode':<5} {'attack':<36} {'status':<9} {'lat max ms':>10} "
          f"{'victim gap p50 / p99 / max ms: base -> attack':>46} {'ratios':>16} "
          f"{'/health max ms P, D: base -> attack':>36}")  # fmt: skip
    for result in doc["modes"].values():
        for r in result["rows"]:
            print(_row_line(r))
    limited = doc["limited"]
    for r in limited["requests"]:
        print(
            f"RLIMIT_AS {limited['address_space_limit_gib']} GiB: {r['attack']}: HTTP "
            f"{r['status']} in {r['latency_ms']} ms, alive after: {r['alive_after']}"
        )
    mem = limited["memory_mib_after"]
    print(
        f"RLIMIT_AS: then a normal request: HTTP {limited['normal_request_status']}; "
        f"VmRSS {mem.get('VmRSS')} MiB, peak RSS {mem.get('VmHWM')} MiB, "
        f"peak address space {mem.get('VmPeak')} MiB"
    )
