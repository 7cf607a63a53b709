"""Fixtures shared by every test package: small real checkpoints, thread pinning, and the
module-scoped `cluster` of real child processes the end-to-end and security modules use.

Several processes share two cores in the end-to-end tests, so torch in the test process uses
one thread, and every server the tests start is told to do the same.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, running_cluster

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def write_tiny(path: Path, **overrides: object) -> Path:
    """A small random-weight checkpoint with a locally trained tokenizer (Qwen3 by default)."""
    from disagg.engine.make_model import write_checkpoint

    shape: dict[str, object] = {
        "arch": "qwen3", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 128, "vocab_size": 2048, "seed": 1,
    }  # fmt: skip
    return write_checkpoint(path, **{**shape, **overrides})


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Qwen3 checkpoint."""
    return write_tiny(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random-weight Llama checkpoint with tied embeddings."""
    return write_tiny(
        tmp_path_factory.mktemp("llama"), arch="llama", num_layers=3, hidden_size=96,
        num_heads=6, intermediate_size=192, seed=2, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the user cache."""
    from disagg.engine.checkpoint import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tiny_qwen3_dir: Path) -> Iterator[Cluster]:
    """The child processes of one test module (tiny Qwen3), each module its own: its logs in a
    folder named for the module, every child stopped after the module's last test. What runs
    in it (roles, connectors, flags) is each module's own fixture's business."""
    with running_cluster(request, _module_label(request.module.__name__), tiny_qwen3_dir) as c:
        yield c


def _module_label(module_name: str) -> str:
    """A module's log folder name: tests.e2e.test_router_resilience -> e2e-router-resilience."""
    package, module = module_name.split(".")[-2:]
    return f"{package}-{module.removeprefix('test_').replace('_', '-')}"
