"""Shared fixtures: one trained tokenizer per session, a factory for live fake-engine servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from disagg.server.app import make_app
from disagg.server.tokenizer import Tokenizer
from tests.server.fakes import ScriptedEngine, ServerThread, make_tokenizer_dir

OUTPUT_TEXT = "Hello world, this is a test."
CLUSTER_TOKEN = "server-tests-cluster-token"  # what the router would sign its legs with


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture
def serve(tokenizer: Tokenizer) -> Iterator[Callable[..., tuple[ScriptedEngine, ServerThread]]]:
    """serve(**ScriptedEngine knobs) -> (engine, running server); servers stop at teardown."""
    started: list[ServerThread] = []

    def start(**knobs: Any) -> tuple[ScriptedEngine, ServerThread]:
        knobs.setdefault("output_ids", tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False))
        engine = ScriptedEngine(**knobs)
        server = ServerThread(
            lambda: make_app(engine, tokenizer, cluster_token=CLUSTER_TOKEN)
        ).__enter__()
        started.append(server)
        return engine, server

    yield start
    for server in started:
        server.__exit__(None, None, None)
