"""Engine throughput vs `transformers` on the same checkpoint and thread count, in one run.

Measures decode tokens/s at batch 1 and 16 and prefill tokens/s at 512 and 2048 tokens, for our
engine (paged KV, continuous batching) and for transformers' `generate` / forward. Prints a
table; the last stdout line is the JSON document (also written with --out).

    python benchmarks/engine_bench.py [--model smollm2-135m] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.checkpoint import resolve_model
from disagg.engine.engine import Engine
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(block_size=16, num_blocks=1024),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, max_model_len=4096),
    )
    engine = Engine(config, model_dir)
    vocab = engine.spec.vocab_size
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for batch in (1, 16):
        prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
        engine_decode(engine, prompts[:1], 4)  # warm-up
        ours = engine_decode(engine, prompts, args.new_tokens)
        theirs = hf_decode(hf, prompts, args.new_tokens)
        rows.append({"phase": "decode", "size": batch, "disagg_tok_s": ours, "hf_tok_s": theirs})
    for length in (512, 2048):
        ours = engine_prefill(engine, length, args.repeats)
        theirs = hf_prefill(hf, length, vocab, args.repeats)
        rows.append({"phase": "prefill", "size": length, "disagg_tok_s": ours, "hf_tok_s": theirs})
    print(f"{'phase':8} {'size':>6} {'disagg tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    for row in rows:
        row["ratio"] = row["disagg_tok_s"] / row["hf_tok_s"]
        print(
            f"{row['phase']:8} {row['size']:>6} {row['disagg_tok_s']:>13.1f} "
            f"{row['hf_tok_s']:>19.1f} {row['ratio']:>6.2f}"
        )
    result = {"model": args.model, "threads": args.threads, "dtype": "float32", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
