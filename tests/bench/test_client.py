"""The streaming client against a fake OpenAI server on loopback (errors included)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from aiohttp import web

from disagg.bench.client import make_session, run_requests
from disagg.bench.runner import BenchConfig, run_benchmark
from disagg.bench.workload import BenchPrompt, WorkloadConfig
from disagg.cli import main as cli_main
from tests.bench.fake_server import FakeBehavior, ThreadedServer


def _cfg(base_url: str, **kw: object) -> BenchConfig:
    workload = kw.pop("workload", WorkloadConfig(num_prompts=6, input_len=12, output_len=4))
    return BenchConfig(base_url=base_url, workload=workload, **kw)


def test_streaming_completions_records_tokens_usage_and_breakdown() -> None:
    behavior = FakeBehavior(token_delay_s=0.01)
    with ThreadedServer(behavior) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url)))
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["model_id"] == "fake-model"  # discovered through /v1/models
    assert result["output_lens"] == [4] * 6 and result["input_lens"] == [12] * 6
    assert result["total_output_tokens"] == 24 and result["total_input_tokens"] == 72
    assert all(len(gaps) == 3 for gaps in result["itls"])  # closing chunk is not a token
    assert result["mean_itl_ms"] >= 9.0  # the server sleeps 10 ms between tokens
    assert 0 < result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["mean_breakdown_ms"] == pytest.approx(
        {"queue": 1.0, "prefill": 4.0, "transfer": 2.0}
    )
    assert result["mean_breakdown_counts"] == {"num_bytes": 4096.0}
    body = behavior.bodies[0]
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 12
    assert all(100 <= t < 1900 for t in body["prompt"])
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_failing_requests_are_counted_not_fatal() -> None:
    cfg = _cfg("http://x", workload=WorkloadConfig(num_prompts=9, input_len=4, output_len=3))
    with ThreadedServer(FakeBehavior(fail_every=3)) as server:
        result = asyncio.run(
            run_benchmark(BenchConfig(**{**_fields(cfg), "base_url": server.base_url}))
        )
    assert (result["completed"], result["failed"]) == (6, 3)
    assert sum("HTTP 500" in e for e in result["errors"]) == 3
    assert result["output_lens"].count(0) == 3
    assert result["request_throughput"] == pytest.approx(6 / result["duration"])


def test_error_event_mid_stream_fails_that_request() -> None:
    with ThreadedServer(FakeBehavior(stream_error_every=2)) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url, max_concurrency=1)))
    assert (result["completed"], result["failed"]) == (3, 3)
    assert sum("injected failure" in e for e in result["errors"]) == 3


def test_unreachable_server_fails_every_request() -> None:
    cfg = _cfg("http://127.0.0.1:9", model="m", request_timeout_s=5.0)  # port 9: discard, closed
    result = asyncio.run(run_benchmark(cfg))
    assert (result["completed"], result["failed"]) == (0, 6)
    assert all(e for e in result["errors"])


def test_chat_text_workload_counts_chunks_without_usage() -> None:
    behavior = FakeBehavior(include_usage=False)
    workload = WorkloadConfig(dataset="text", num_prompts=3, input_len=26, output_len=5)
    with ThreadedServer(behavior) as server:
        cfg = _cfg(server.base_url, endpoint="/v1/chat/completions", workload=workload)
        result = asyncio.run(run_benchmark(cfg))
    assert result["completed"] == 3
    assert result["output_lens"] == [5, 5, 5]  # role-only delta skipped
    assert all(len(g) == 4 for g in result["itls"])
    assert result["input_lens"] == [26, 26, 26]  # no usage: the workload's estimate
    assert len(behavior.bodies[0]["messages"][0]["content"].split()) == 20


def test_chat_with_token_ids_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(run_benchmark(_cfg("http://127.0.0.1:9", endpoint="/v1/chat/completions")))


def test_non_streaming_uses_usage() -> None:
    with ThreadedServer(FakeBehavior()) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url, stream=False, model="fake-model")))
    assert result["completed"] == 6 and result["output_lens"] == [4] * 6
    assert result["mean_tpot_ms"] == pytest.approx(0.0, abs=1e-9)  # one timestamp: TTFT == E2EL
    assert result["mean_breakdown_ms"]["prefill"] == pytest.approx(4.0)


def test_warmup_requests_are_sent_but_not_measured() -> None:
    behavior = FakeBehavior()
    with ThreadedServer(behavior) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url, warmup=2)))
    assert len(behavior.bodies) == 8 and result["completed"] == 6
    warm = [b["prompt"] for b in behavior.bodies[:2]]
    measured = [b["prompt"] for b in behavior.bodies[2:]]
    assert not any(w in measured for w in warm)  # fresh prompts: no prefix-cache head start


def test_max_concurrency_caps_requests_in_flight() -> None:
    with ThreadedServer(FakeBehavior(token_delay_s=0.01)) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url, max_concurrency=2)))
    assert result["completed"] == 6 and result["max_concurrent_requests"] == 2


def test_requests_start_at_their_offsets() -> None:
    prompts = [BenchPrompt([101, 102], 2, 2, True)] * 3
    bodies = [{"model": "m", "prompt": [101, 102], "max_tokens": 2, "stream": True}] * 3

    async def go() -> tuple[list, float]:
        async with make_session(None, 10.0) as session:
            url = f"{server.base_url}/v1/completions"
            return await run_requests(session, url, prompts, bodies, [0.0, 0.15, 0.3])

    with ThreadedServer(FakeBehavior()) as server:
        results, duration_s = asyncio.run(go())
    starts = [r.start_s - results[0].start_s for r in results]
    assert starts[1] == pytest.approx(0.15, abs=0.05) and starts[2] == pytest.approx(0.3, abs=0.05)
    assert duration_s >= 0.3 and all(r.success for r in results)


def test_cli_prints_table_then_json_and_writes_result_file(tmp_path, capsys) -> None:
    out = tmp_path / "result.json"
    with ThreadedServer(FakeBehavior()) as server:
        argv = ["bench", "--base-url", server.base_url, "--num-prompts", "4", "--input-len", "8"]
        argv += ["--output-len", "3", "--request-rate", "200", "--burstiness", "0.5"]
        argv += ["--goodput", "ttft:60000", "e2el:60000", "--percentiles", "90,99"]
        argv += ["--result-file", str(out), "--no-progress", "--plot-dir", str(tmp_path)]
        assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "Serving Benchmark Result" in lines[0]
    summary = json.loads(lines[-1])
    assert summary["completed"] == 4 and "ttfts" not in summary
    doc = json.loads(out.read_text())
    for key in (
        "duration",
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
    ):
        assert key in doc, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in doc
    assert doc["request_goodput"] == pytest.approx(4 / doc["duration"])
    assert doc["request_rate"] == 200.0 and doc["burstiness"] == 0.5
    assert (tmp_path / "latency_cdf.png").stat().st_size > 1000


def test_cli_rejects_missing_base_url_and_reports_dead_server(capsys) -> None:
    assert cli_main(["bench", "--no-progress"]) == 2
    assert cli_main(["bench", "--base-url", "http://127.0.0.1:9", "--no-progress"]) == 1
    assert "disagg bench" in capsys.readouterr().err


async def _ragged_sse(request: web.Request) -> web.StreamResponse:
    """CR LF events cut into 7-byte writes; the last event has no closing blank line."""
    events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in "abc"]
    events.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 6}})
    raw = "\r\n\r\n".join(f"data: {json.dumps(e)}" for e in events).encode()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(0, len(raw), 7):
        await resp.write(raw[i : i + 7])
        await asyncio.sleep(0.002)
    return resp


def test_sse_parsing_survives_ragged_reads_and_missing_final_blank_line() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _ragged_sse)
    with ThreadedServer(FakeBehavior(), app) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url, model="m")))
    assert result["completed"] == 6
    assert result["output_lens"] == [6] * 6  # usage from the unterminated last event
    assert all(len(g) == 2 for g in result["itls"])  # three token chunks each
    assert result["input_lens"] == [2] * 6


def _fields(cfg: BenchConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def test_infinite_rate_written_as_string() -> None:
    with ThreadedServer(FakeBehavior()) as server:
        result = asyncio.run(run_benchmark(_cfg(server.base_url)))
    assert math.isinf(BenchConfig(base_url="http://a").request_rate)
    assert result["request_rate"] == "inf"


def test_progress_off_a_terminal_is_plain_lines(capsys) -> None:
    """Regression: tqdm wrote `\\r`-redrawn bars into logs and captured output. Off a terminal
    the progress is a few whole lines (every tenth of the requests), ending at the total."""
    with ThreadedServer(FakeBehavior()) as server:
        argv = ["bench", "--base-url", server.base_url, "--num-prompts", "20", "--input-len", "8"]
        assert cli_main([*argv, "--output-len", "2", "--request-rate", "inf"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    lines = [line for line in err.splitlines() if "requests done" in line]
    assert 2 <= len(lines) <= 11, err
    assert [int(line.split("/")[0].split()[-1]) for line in lines] == sorted(
        {int(line.split("/")[0].split()[-1]) for line in lines}
    )  # counts only grow, none twice
    assert lines[-1].startswith("bench: 20/20 requests done"), lines[-1]
