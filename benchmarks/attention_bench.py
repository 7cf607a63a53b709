"""Attention over the paged KV cache: our kernels against the torch path they replaced, and
decode against torch's flex_attention, measured side by side in one run on this CPU.

Views:
- **step**: a whole decode step of the real engine (SmolLM2-135M, one thread) at batch B with
  C tokens of context, `--attention-backend native` vs `torch` (gather + GEMM/SDPA), the two
  engines alternated round by round; plus each one's top ops by self CPU time (the profile).
- **prefill**: the engine's step that prefills one new prompt of C tokens, native vs torch
  (SDPA's causal flash kernel), alternated; plus one layer's prefill attention alone.
- **layer**: one layer's decode attention on the same shapes: the kernel, the torch path, and
  (at batch 1 and 32) flex_attention compiled by inductor. flex needs each layer's K/V as one
  [1, Hkv, slots, D] pool, a layout our cache does not have (a block holds all layers together,
  so one transfer descriptor moves it): its figure is what that layout change would buy, and
  it excludes building the block mask (which the engine would pay every step).

    python benchmarks/attention_bench.py [--rounds 3] [--only decode|prefill]
        [--out docs/results/attention_bench.json]

Prints a table; the last stdout line is the JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from disagg.bench.host import cpu_info
from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.checkpoint import resolve_model
from disagg.engine.dtypes import cpu_has_fast_bf16
from disagg.engine.engine import Engine
from disagg.engine.paged_attention import make_paged_attention
from disagg.protocol import SamplingParams

BLOCK_SIZE = 16
SHAPES = [(1, 256), (8, 256), (32, 256), (8, 1024)]  # (batch, context tokens)
PROMPTS = [256, 1024]  # prefill: tokens of one new prompt
STEPS = 10  # decode steps timed per round


def _engine(model_dir: str, dtype: str, backend: str) -> Engine:
    config = EngineConfig(
        model=model_dir,
        dtype=dtype,
        attention_backend=backend,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=32 * 1100 // BLOCK_SIZE + 64),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=2048),
    )
    return Engine(config, model_dir)


def _fill(engine: Engine, batch: int, context: int, seed: int) -> None:
    """`batch` requests whose prompts are prefilled, each `context` tokens into its decode."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(100, 30000, (context,), generator=gen).tolist()
        params = SamplingParams(max_tokens=STEPS + 4, temperature=0.0, ignore_eos=True)
        engine.add_request(f"s{seed}-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()


def _drain(engine: Engine) -> None:
    while engine.has_work:
        engine.step()


def step_ms(engine: Engine, batch: int, context: int, seed: int) -> float:
    _fill(engine, batch, context, seed)
    started = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    elapsed = (time.perf_counter() - started) / STEPS * 1000
    _drain(engine)
    return elapsed


def prefill_ms(engine: Engine, tokens: int, seed: int) -> float:
    """The step that prefills one new prompt (no other work in the engine)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    prompt = torch.randint(100, 30000, (tokens,), generator=gen).tolist()
    engine.add_request(f"p{seed}-{tokens}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - started) * 1000
    _drain(engine)
    return elapsed


def profile(engine: Engine, batch: int, context: int) -> list[dict[str, Any]]:
    """The top ops of a few decode steps by self CPU time (the kernel shows as time no op
    claims: it runs outside torch's dispatcher)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _fill(engine, batch, context, seed=99)
    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    wall_ms = (time.perf_counter() - started) / 5 * 1000
    _drain(engine)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 5 / 1000} for e in events[:8]]
    claimed = sum(e.self_cpu_time_total for e in events) / 5 / 1000
    return [
        *rows,
        {"op": "(outside torch ops: our kernel, Python)", "ms_per_step": wall_ms - claimed},
    ]


# ---- one layer ---------------------------------------------------------------------------------


def _torch_path(q, kv, layer, table, lens):  # the gather, then SDPA (the runner's fp32 path;
    # at bf16 it runs two bmms instead: the step rows measure that)
    b, hq, d = q.shape
    hkv = kv.shape[3]
    k, v = (kv[table, layer, i].transpose(1, 2).reshape(b, hkv, -1, d) for i in (0, 1))
    keys = torch.arange(k.shape[2])[None, :] < lens[:, None]
    qg = q.view(b, hkv, hq // hkv, d)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=keys[:, None, None, :])


def _flex(q, kv, layer, table, lens):
    """flex_attention over a per-layer pool [1, Hkv, blocks * block_size, D] with a paged
    block mask of 16-key blocks; returns (call, build_mask_s)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, hq, d = q.shape
    num_blocks, _, _, hkv, bs, _ = kv.shape
    pool_k, pool_v = (kv[:, layer, i].transpose(0, 1).reshape(1, hkv, -1, d) for i in (0, 1))
    owner = torch.full((num_blocks * bs,), -1, dtype=torch.long)
    for seq in range(b):
        slots = (table[seq][:, None] * bs + torch.arange(bs)).flatten()[: int(lens[seq])]
        owner[slots] = seq

    def mask_mod(batch, head, q_idx, kv_idx):
        return owner[kv_idx] == batch

    started = time.perf_counter()
    mask = create_block_mask(
        mask_mod, b, None, 1, num_blocks * bs, device="cpu", BLOCK_SIZE=(1, bs)
    )
    build_s = time.perf_counter() - started
    compiled = torch.compile(flex_attention)
    qf = q[:, :, None, :]
    return (lambda: compiled(qf, pool_k, pool_v, block_mask=mask, enable_gqa=True)), build_s


def _time_ms(fn, repeat: int = 30) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1000


def layer_row(dtype: torch.dtype, batch: int, context: int, with_flex: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch * context)
    width = -(-context // BLOCK_SIZE)
    num_blocks = batch * width * 2  # the used blocks scattered through twice as many
    kv = torch.randn(num_blocks, 30, 2, 3, BLOCK_SIZE, 64, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, 9, 64, generator=gen).to(dtype)
    kernel = make_paged_attention("native", kv, 9, 3)
    assert kernel is not None
    row = {
        "native_ms": _time_ms(lambda: kernel.decode(7, q, table, lens)),
        "torch_ms": _time_ms(lambda: _torch_path(q, kv, 7, table, lens)),
    }
    if not with_flex:
        return row
    try:
        flex, build_s = _flex(q, kv, 7, table, lens)
        started = time.perf_counter()
        flex()
        row["flex_compile_s"] = time.perf_counter() - started
        row["flex_ms"] = _time_ms(flex)
        row["flex_mask_build_ms"] = build_s * 1000
    except Exception as exc:  # inductor's CPU template does not take every shape or dtype
        row["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        row["flex_ms"] = float("nan")
    return row


def _sdpa_prefill(q, k, v):  # the runner's torch path for a first chunk: GQA heads repeated
    groups = q.shape[1] // k.shape[0]
    k, v = (x.repeat_interleave(groups, 0)[None] for x in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)


def prefill_layer_row(dtype: torch.dtype, tokens: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(tokens)
    width = -(-tokens // BLOCK_SIZE)
    kv = torch.randn(width * 2, 30, 2, 3, BLOCK_SIZE, 64, generator=gen).to(dtype)
    blocks = torch.randperm(width * 2, generator=gen)[:width]
    q = torch.randn(tokens, 9, 64, generator=gen).to(dtype)
    k, v = (kv[blocks, 7, i].transpose(0, 1).reshape(3, -1, 64)[:, :tokens] for i in (0, 1))
    kernel = make_paged_attention("native", kv, 9, 3)
    assert kernel is not None
    repeat = 10 if tokens > 512 else 30
    native = _time_ms(lambda: kernel.prefill(7, q, blocks, 0), repeat)
    sdpa = _time_ms(lambda: _sdpa_prefill(q, k.contiguous(), v.contiguous()), repeat)
    gflop = 4 * 9 * 64 * tokens * (tokens + 1) / 2 / 1e9  # QK^T and PV, causal
    return {"native_ms": native, "torch_ms": sdpa, "native_gflops": gflop / native * 1000,
            "torch_gflops": gflop / sdpa * 1000}  # fmt: skip


# ---- the run -----------------------------------------------------------------------------------


def run_prefill(model_dir: str, dtype: str, rounds: int, result: dict[str, Any]) -> None:
    engines = {b: _engine(model_dir, dtype, b) for b in ("native", "torch")}
    for engine in engines.values():
        prefill_ms(engine, 64, seed=-1)  # first-step costs out of the way
    for tokens in PROMPTS:
        times: dict[str, list[float]] = {b: [] for b in engines}
        for r in range(rounds):
            for backend, engine in engines.items():  # alternated round by round
                times[backend].append(prefill_ms(engine, tokens, seed=r))
        key = f"{dtype} prompt {tokens}"
        row = {f"{b}_ms": statistics.median(t) for b, t in times.items()}
        row.update(runs_ms=times, speedup=row["torch_ms"] / row["native_ms"])
        row["layer"] = prefill_layer_row(getattr(torch, dtype), tokens)
        result["prefill"][key] = row
        print(f"prefill {key:26s} torch {row['torch_ms']:7.1f} ms  native "
              f"{row['native_ms']:7.1f} ms  x{row['speedup']:.2f}  (one layer: torch "
              f"{row['layer']['torch_ms']:.2f} / native {row['layer']['native_ms']:.2f} ms)",
              flush=True)  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    dtypes = ["float32", *(["bfloat16"] if cpu_has_fast_bf16() else [])]
    result: dict[str, Any] = {"cpu": cpu_info(), "model": args.model, "threads": args.threads,
                              "block_size": BLOCK_SIZE, "steps_per_round": STEPS,
                              "rounds": args.rounds}  # fmt: skip
    result.update(step={}, layer={}, profile={}, prefill={})
    for dtype in dtypes:
        if args.only != "decode":
            run_prefill(model_dir, dtype, args.rounds, result)
        if args.only == "prefill":
            continue
        engines = {b: _engine(model_dir, dtype, b) for b in ("native", "torch")}
        for batch, context in SHAPES:
            times: dict[str, list[float]] = {b: [] for b in engines}
            for r in range(args.rounds):
                for backend, engine in engines.items():  # alternated round by round
                    times[backend].append(step_ms(engine, batch, context, seed=r))
            key = f"{dtype} batch {batch} ctx {context}"
            row = {f"{b}_ms": statistics.median(t) for b, t in times.items()}
            row["runs_ms"] = times
            row["speedup"] = row["torch_ms"] / row["native_ms"]
            result["step"][key] = row
            print(f"step  {key:28s} torch {row['torch_ms']:7.1f} ms  native "
                  f"{row['native_ms']:7.1f} ms  x{row['speedup']:.2f}", flush=True)  # fmt: skip
        result["profile"][dtype] = {b: profile(e, 32, 256) for b, e in engines.items()}
        del engines
        torch_dtype = getattr(torch, dtype)
        for batch, context in SHAPES:
            key = f"{dtype} batch {batch} ctx {context}"
            row = layer_row(torch_dtype, batch, context, with_flex=context == 256 and batch != 8)
            result["layer"][key] = row
            print(f"layer {key:28s} torch {row['torch_ms']:6.2f} ms  native {row['native_ms']:6.2f}"
                  f" ms  flex {row.get('flex_ms', float('nan')):6.2f} ms", flush=True)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["decode", "prefill"], default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = run(args)
    cpu = result["cpu"]
    print(f"CPU: {cpu['model']} ({cpu['cpus']} cores; {' '.join(cpu['flags_shown'])})")
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
