"""peer_pd_bench.py's report: the markdown tables and the plot of its summary. Pure formatting of
figures already measured; matplotlib is imported only to draw. Imported by bare name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["breakdown_table", "plot", "table"]

_COLUMNS = (("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
            ("median_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
            ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
            ("output_throughput", "out tok/s"))  # fmt: skip


def _cell(stat: dict[str, float] | None) -> str:
    """`median (min-max)` over rounds; one figure when they agree."""
    if not stat:
        return "-"
    fmt = "{:.0f}" if stat["median"] >= 100 else "{:.1f}"
    text = fmt.format(stat["median"])
    if stat["min"] != stat["max"]:
        text += f" ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"
    return text


def table(summary: dict[str, Any], workloads: list[str], cpu: dict[str, Any], rounds: int) -> str:
    lines: list[str] = []
    for workload in workloads:
        heads = ["system", *(h for _, h in _COLUMNS), "CPU-s P / D / router", "failed"]
        lines += [f"**{workload}**", "", "| " + " | ".join(heads) + " |",
                  "|---" * len(heads) + "|"]  # fmt: skip
        for name, cells in summary.items():
            cell = cells.get(workload)
            if cell is None:
                continue
            cpu_s = " / ".join(f"{cell['cpu_s'].get(r, 0):.0f}" for r in ("prefill", "decode",
                                                                          "router"))  # fmt: skip
            row = [name, *(_cell(cell.get(m)) for m, _ in _COLUMNS), cpu_s, str(cell["failed"])]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines.append(f"CPU: {cpu['model']} ({cpu['cpus']} cores; {' '.join(cpu['flags_shown'])}); "
                 f"SmolLM2-135M fp32, 1 thread per instance, medians of {rounds} rounds "
                 f"(min-max across rounds)")  # fmt: skip
    return "\n".join(lines)


def breakdown_table(raw: dict[str, Any], workload: str) -> str:
    """Where the handoff's time went, per system (means over every run of `workload`): vLLM's
    NIXL post and transfer times from its /metrics, our per-request breakdown."""
    lines = ["| system | handoff setup / post ms | transfer ms | MiB per request | descriptors |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, entry in raw.items():
        runs = entry["runs"].get(workload, [])
        if not runs:
            continue
        nixl = [r["nixl"] for r in runs if r["nixl"]]
        if nixl:
            figures = [sum(n[k] for n in nixl) / len(nixl)
                       for k in ("post_ms", "xfer_ms", "mib", "descriptors")]  # fmt: skip
        else:
            parts = [r["breakdown_ms"] for r in runs if r["breakdown_ms"]]
            counts = [r["breakdown_counts"] for r in runs if r["breakdown_counts"]]
            size = _mean(counts, "num_bytes")
            mib = None if size is None else size / 2**20
            figures = [_mean(parts, "handoff_setup"), _mean(parts, "transfer"), mib,
                       _mean(counts, "num_descriptors")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join("-" if f is None else f"{f:.2f}"
                                                  for f in figures) + " |")  # fmt: skip
    return "\n".join(lines)


def _mean(parts: list[dict[str, float]], key: str) -> float | None:
    values = [p[key] for p in parts if key in p]
    return sum(values) / len(values) if values else None


def plot(summary: dict[str, Any], workloads: list[str], out: Path) -> None:
    """TTFT and TPOT p50 per long-prompt workload and system, bars spanning the rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = [w for w in workloads if w.startswith("long")]
    if not long:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "median_ttft_ms", "TTFT p50 (ms)"),
                              (axes[1], "median_tpot_ms", "TPOT p50 (ms)")):  # fmt: skip
        for name, cells in summary.items():
            stats = [cells.get(w, {}).get(metric) for w in long]
            xs = [i for i, s in enumerate(stats) if s]
            mid = [stats[i]["median"] for i in xs]
            err = [[stats[i]["median"] - stats[i]["min"] for i in xs],
                   [stats[i]["max"] - stats[i]["median"] for i in xs]]  # fmt: skip
            ax.errorbar(xs, mid, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xticks(range(len(long)), long)
        ax.set_ylabel(label)
        ax.set_yscale("log")  # the systems differ by 10x: each line's own shape stays visible
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("1 prefill + 1 decode, 2-4k-token prompts, SmolLM2-135M fp32, this CPU")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
