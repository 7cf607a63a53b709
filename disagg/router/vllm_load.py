"""A vLLM instance's load, read from its Prometheus `/metrics` into the `Load` the policies rank.

vLLM's own `/load` counts only in-flight HTTP requests (and only when told to track them), so
least_loaded reads vLLM 0.32's gauges instead: `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction) and the block count on
`vllm:cache_config_info`. vLLM exports no count of queued prompt tokens: that field is 0, so
vLLM prefill instances are ranked by the requests they hold. Pure parsing.
"""

from __future__ import annotations

import re

from disagg.router.policy import Load

__all__ = ["load_from_vllm_metrics"]

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")
_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')


def load_from_vllm_metrics(text: str) -> Load:
    """`Load` from a vLLM /metrics page (one engine). ValueError when a gauge is missing."""
    values: dict[str, float] = {}
    num_blocks = None
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found is None:
            continue
        name, labels, value = found.groups()
        values[name] = float(value)
        if name == "vllm:cache_config_info" and labels and (blocks := _BLOCKS.search(labels)):
            num_blocks = int(blocks.group(1))
    try:
        running = int(values["vllm:num_requests_running"])
        waiting = int(values["vllm:num_requests_waiting"])
        usage = values["vllm:kv_cache_usage_perc"]
    except KeyError as exc:
        raise ValueError(f"vLLM /metrics lacks {exc}") from exc
    if num_blocks is None or not 0.0 <= usage <= 1.0 or min(running, waiting) < 0:
        raise ValueError("vLLM /metrics has no block count or an out-of-range gauge")
    free = round(num_blocks * (1.0 - usage))
    return Load(num_running=running, num_waiting=waiting, num_free_blocks=free,
                num_total_blocks=num_blocks, num_queued_prefill_tokens=0)  # fmt: skip
