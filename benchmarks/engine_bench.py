"""Engine throughput vs `transformers` on the same checkpoint and thread count, in one run.

Measures decode tokens/s at batch 1 and 16 and prefill tokens/s at 512 and 2048 tokens, for our
engine (paged KV, continuous batching) and for transformers' `generate` / forward, plus one
serving row: 64 requests of mixed prompt and output lengths at batch 16. transformers runs those
the way a `generate` user must (and as vLLM's throughput benchmark runs its HF backend): batches
of 16 in arrival order, left-padded, each batch decoding until its longest output is done; our
engine admits a waiting request whenever one finishes. Prints a table; the last stdout line is
the JSON document (also written with --out).

    python benchmarks/engine_bench.py [--model smollm2-135m] [--threads 2] [--dtype auto]
        [--out FILE]

Both sides compute in the same dtype: the engine's `--dtype` as resolved (auto: bf16 on a CPU
with bf16 instructions), and transformers loaded in it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from disagg.bench.host import cpu_info
from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.checkpoint import resolve_model
from disagg.engine.engine import Engine
from disagg.engine.linear import PackedLinear
from disagg.engine.model import CausalLM, RMSNorm
from disagg.protocol import SamplingParams


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (batch, length), generator=gen).tolist()


def engine_decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s over the steps after every request has its first token."""
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params)
    started = None
    decoded = 0
    first_seen: set[str] = set()
    while engine.has_work:
        outputs = engine.step()
        for out in outputs:
            if out.request_id in first_seen:
                decoded += len(out.new_token_ids)
            first_seen.add(out.request_id)
        if started is None and len(first_seen) == len(prompts):
            started = time.perf_counter()
    assert started is not None
    return decoded / (time.perf_counter() - started)


def engine_prefill(engine: Engine, length: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        prompt = _prompts(1, length, engine.spec.vocab_size, seed=100 + r)[0]
        engine.add_request(f"p{length}-{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
        t0 = time.perf_counter()
        while engine.has_work:
            engine.step()
        times.append(time.perf_counter() - t0)
    return length / statistics.median(times)


def _mixed(count: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: prompts 16-128 tokens, outputs 8-128 tokens."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, min(vocab, 30000)) for _ in range(rng.randint(16, 128))],
            rng.randint(8, 128),
        )
        for _ in range(count)
    ]


def engine_serving(engine: Engine, requests: list[tuple[list[int], int]]) -> float:
    """Output tokens/s from submitting every request at once until the last one finishes."""
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"s{time.monotonic_ns()}-{i}", prompt, params)
    produced = 0
    while engine.has_work:
        produced += sum(len(out.new_token_ids) for out in engine.step())
    assert produced == sum(out_len for _, out_len in requests)
    return produced / (time.perf_counter() - t0)


def hf_serving(
    model: torch.nn.Module, requests: list[tuple[list[int], int]], batch: int, pad_id: int
) -> float:
    """Requested output tokens/s: static batches, so a batch runs as long as its longest
    request and the tokens generated past a shorter request's length are wasted."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), batch):
            group = requests[first : first + batch]
            width = max(len(prompt) for prompt, _ in group)
            ids = [[pad_id] * (width - len(p)) + p for p, _ in group]
            mask = [[0] * (width - len(p)) + [1] * len(p) for p, _ in group]
            new = max(out_len for _, out_len in group)
            model.generate(
                torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad_id,
            )
    return sum(out_len for _, out_len in requests) / (time.perf_counter() - t0)


def hf_decode(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kwargs = {"do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        t2 = time.perf_counter()
    # Subtract the prefill (the 1-token run) so both sides report decode only.
    return len(prompts) * (new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def hf_prefill(model: torch.nn.Module, length: int, vocab: int, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        for r in range(repeats):
            ids = torch.tensor(_prompts(1, length, vocab, seed=100 + r))
            t0 = time.perf_counter()
            model(ids, use_cache=True)
            times.append(time.perf_counter() - t0)
    return length / statistics.median(times)


def gemm_ceiling(model: CausalLM, batch: int, repeats: int) -> float:
    """Decode tokens/s of a step that did nothing but our engine's matmuls (every projection of
    every layer, then the vocabulary projection, at M = batch, through the same modules): the
    ceiling for this engine, or any engine using torch's CPU GEMMs, on this machine."""
    projections = [
        module
        for layer in model.model.layers
        for parent in (layer.self_attn, layer.mlp)
        for module in parent.children()
        if not isinstance(module, RMSNorm)
    ]
    dtype = model.model.embed_tokens.weight.dtype
    inputs = [torch.randn(batch, _in_features(m), dtype=dtype) for m in projections]
    last = torch.randn(batch, model.spec.hidden_size, dtype=dtype)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for module, x in zip(projections, inputs, strict=True):
                module(x)
            model.compute_logits(last)
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def _in_features(module: torch.nn.Module) -> int:
    if isinstance(module, PackedLinear):
        return module.in_features
    assert isinstance(module, torch.nn.Linear), type(module)
    return module.in_features


def decode_row(engine: Engine, hf: torch.nn.Module, batch: int, args: argparse.Namespace) -> dict:
    """Ours and theirs alternate, `repeats` times each, so a slow spell of the shared machine
    hits both columns; medians are reported."""
    prompts = _prompts(batch, args.prompt_len, engine.spec.vocab_size, seed=batch)
    engine_decode(engine, prompts[:1], 4)  # warm-up
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(engine_decode(engine, prompts, args.new_tokens))
        theirs.append(hf_decode(hf, prompts, args.new_tokens))
    return {
        "phase": "decode",
        "size": batch,
        "disagg_tok_s": statistics.median(ours),
        "hf_tok_s": statistics.median(theirs),
        "gemm_ceiling_tok_s": gemm_ceiling(engine.runner.model, batch, args.repeats),
    }


def print_table(rows: list[dict]) -> None:
    head = f"{'phase':8} {'size':>6} {'disagg tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}"
    print(head + f" {'GEMM-only ceiling':>18} {'ceiling/transformers':>21}")
    for row in rows:
        row["ratio"] = row["disagg_tok_s"] / row["hf_tok_s"]
        line = (
            f"{row['phase']:8} {row['size']:>6} {row['disagg_tok_s']:>13.1f} "
            f"{row['hf_tok_s']:>19.1f} {row['ratio']:>6.2f}"
        )
        if "gemm_ceiling_tok_s" in row:
            row["ceiling_ratio"] = row["gemm_ceiling_tok_s"] / row["hf_tok_s"]
            line += f" {row['gemm_ceiling_tok_s']:>18.1f} {row['ceiling_ratio']:>21.2f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-lens", default="512,2048", help="comma-separated")
    parser.add_argument("--serving-requests", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="both sides compute in the engine's")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    config = EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        cache=CacheConfig(block_size=16, num_blocks=1024),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=4096),
    )
    engine = Engine(config, model_dir)
    vocab = engine.spec.vocab_size
    from transformers import AutoModelForCausalLM

    dtype = engine.runner.dtype  # "auto" resolved: transformers runs in the same one
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    rows = [decode_row(engine, hf, batch, args) for batch in (1, 16)]
    for length in (int(n) for n in args.prefill_lens.split(",")):
        ours = engine_prefill(engine, length, args.repeats)
        theirs = hf_prefill(hf, length, vocab, args.repeats)
        rows.append({"phase": "prefill", "size": length, "disagg_tok_s": ours, "hf_tok_s": theirs})
    mixed = _mixed(args.serving_requests, vocab, seed=7)
    ours = engine_serving(engine, mixed)
    theirs = hf_serving(hf, mixed, batch=16, pad_id=0)
    rows.append({"phase": "serving", "size": 16, "disagg_tok_s": ours, "hf_tok_s": theirs})
    print_table(rows)
    result = {
        "cpu": cpu_info(), "model": args.model, "threads": args.threads,
        "dtype": engine.runner.dtype_name,
        "rows": rows,
    }  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
