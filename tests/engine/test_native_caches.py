"""A prefill instance's memory stays bounded however many distinct prompt lengths it sees.

Regression: a prefill instance's RSS grew from ~390 to ~1400 MB over a soak and then levelled
off. Not a leak in our code (the Python heap and object counts stayed flat): oneDNN's primitive
cache and ideep's LRU of linear primitives each keep up to 1024 GEMM primitives keyed by shape,
and a prefill step has a new row count nearly every time. The engine now caps both.

The check runs in a fresh process, because both libraries read their capacity once, at the
process's first oneDNN call, and measures glibc's bytes in use (not RSS, not time).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import ctypes, json, random, sys
from disagg.config import EngineConfig, SchedulerConfig
from disagg.engine.engine import Engine
from disagg.protocol import SamplingParams

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
model = sys.argv[1]
config = EngineConfig(model=model, dtype="float32", num_threads=1,
                      scheduler=SchedulerConfig(max_num_batched_tokens=512))
engine = Engine(config, model)

rng = random.Random(0)

def prefill(lengths):
    for length in lengths:  # one at a time: each step's row count is the prompt's length
        prompt = [rng.randrange(3, 2000) for _ in range(length)]  # no prefix to reuse
        engine.add_request(f"r{length}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_work:
            engine.step()

prefill(range(1, 41))  # warm-up: first-call allocations, small shapes
before = libc.mallinfo2().uordblks
prefill(range(41, 441))  # 400 row counts never seen
print(json.dumps({"grown_mib": (libc.mallinfo2().uordblks - before) / 2**20}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="reads glibc's mallinfo2")
def test_new_prompt_lengths_do_not_grow_memory_without_bound(tiny_qwen3_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV_NAMES}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_qwen3_dir)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    grown_mib = json.loads(done.stdout.strip().splitlines()[-1])["grown_mib"]
    # Uncapped, 400 new row counts (x 5 projection shapes) kept ~150 MB more in use; capped,
    # what stays is the prefix cache's hashes and allocator noise.
    assert grown_mib < 40, f"{grown_mib:.0f} MiB more in use after 400 new prompt lengths"


_CACHE_ENV_NAMES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY",
                    "LRU_CACHE_CAPACITY")  # fmt: skip
