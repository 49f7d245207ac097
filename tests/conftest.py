"""Fixtures shared by the service test suites: tiny checkpoints built locally."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import failure_logs, scheduling

from pdserve.engine.model_store import DEFAULT_MODEL, KNOWN_MODELS, ResolvedModel, resolve_model


def build_tiny_llama(path: Path, *, num_layers: int = 2, vocab_size: int = 320) -> Path:
    """Saves a tiny random Llama checkpoint (transformers is a test-only dependency)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos",
        action="store_true",
        help="also run the fault-matrix cells marked chaos (make chaos); without it they are "
        "deselected and make test runs the fast cells only",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    strays = sorted({
        scheduling.module_of(item.nodeid) for item in items
        if "smollm2_processes" in getattr(item, "fixturenames", ())
        and scheduling.module_of(item.nodeid) not in scheduling.SMOLLM2_PROCESSES_MODULES
    })  # fmt: skip
    if strays:
        raise pytest.UsageError(
            f"{', '.join(strays)} use smollm2_processes: add them to "
            "support.scheduling.SMOLLM2_PROCESSES_MODULES (one worker starts that cluster)"
        )
    if config.getoption("--chaos"):
        return
    deselected = [item for item in items if item.get_closest_marker("chaos")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("chaos")]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """loadscope that hands out the scope that took longest last time first
    (`support.scheduling`)."""
    if config.getoption("dist") != "loadscope":
        return None
    cache = getattr(config, "cache", None)
    timed = scheduling.timed_seconds({} if cache is None else cache.get(scheduling.CACHE_KEY, {}))
    return scheduling.make_scheduler(config, log, timed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the log tails of the pdserve processes it started
    (`support.failure_logs`)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and report.when == "call":
        tails = failure_logs.pdserve_log_tails(getattr(item, "funcargs", {}))
        if tails:
            report.sections.append(("pdserve processes' logs", tails))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "loadscope":
        config.pluginmanager.register(scheduling.ScopeTimer(config), "pdserve-scope-timer")


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """Runs each test's model work (engines, in-process servers, references) on one intra-op
    thread.

    The tiny models gain nothing from more threads, and on a busy two-core machine OpenMP
    barriers between two threads make every small kernel wait for the other core: a reference
    generation of 24 tokens took about 2 s on two threads and 0.05 s on one. The setting is
    process-wide, so the servers' engine threads use it too.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def logging_restored() -> Iterator[None]:
    """Puts structlog's configuration back after each test: a test that configures logging
    (a CLI at ``--log-level error``) must not filter the events a later test captures."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint directory shared by the whole session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in demo model (tokenizer and chat template included), generated locally."""
    from pdserve.engine.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("pdserve-cache"))


@pytest.fixture(scope="session")
def demo_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo as a mixture of experts (a tiny Mixtral with the demo's tokenizer)."""
    from pdserve.engine.demo import DEMO_MOE_SPEC, ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("pdserve-cache-moe"), DEMO_MOE_SPEC)


@pytest.fixture(scope="session")
def smollm2() -> ResolvedModel:
    """The default real model, SmolLM2-135M-Instruct, prepared in the pdserve cache.

    `make test` prepares it first (`make model`); a missing model is fetched here, and a test
    that needs it fails (never skips) when that is impossible.
    """
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2: ResolvedModel) -> Path:
    """The GGUF file the default model was prepared from."""
    return smollm2.path.parent / Path(KNOWN_MODELS[DEFAULT_MODEL].member).name


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path, pytestconfig: pytest.Config) -> tuple[Any, Any]:
    """(tokenizer, model) as transformers loads the same GGUF: the reference in tests.

    transformers' reading of the GGUF takes ~7 s; what it read is kept in pytest's cache
    (`support.hf_reference.gguf_reference`), so each worker of a run, and later runs, load it
    in ~1 s. Without the cache provider it is read from the GGUF every time.
    """
    from support.hf_reference import gguf_reference

    cache = getattr(pytestconfig, "cache", None)
    return gguf_reference(smollm2_gguf, None if cache is None else cache.mkdir("hf-reference"))


@pytest.fixture(scope="session")
def smollm2_processes(
    smollm2: ResolvedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """Gateway, prefill and decode processes serving the default model (float32), shared by
    the test files that only send it requests (one start per pytest worker)."""
    from support.process_cluster import running_cluster

    with running_cluster(smollm2.path, tmp_path_factory.mktemp("smollm2-logs")) as running:
        yield running
