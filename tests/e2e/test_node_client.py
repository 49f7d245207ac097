"""A Node.js client (`@grpc/grpc-js` + `@grpc/proto-loader`, loading `protos/`) against real
processes: another language works from the contract alone.

`clients/node/generate.js` calls `pdserve.v1.GenerationService.Generate` and prints the
completion as JSON; its token ids must equal the single-process engine's. Its dependencies
come from `clients/node/package-lock.json` through `npm ci` (run once; `make test` runs it
as `make node-deps`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.process_cluster import ProcessCluster, running_cluster
from support.real_cluster import Reference

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
NPM_CI_TIMEOUT_S = 300


def ensure_node_modules() -> None:
    """Runs ``npm ci`` unless node_modules already matches package-lock.json.

    npm writes node_modules/.package-lock.json on every install; when it is at least as new as
    package-lock.json the installed tree is current.
    """
    installed = CLIENT_DIR / "node_modules" / ".package-lock.json"
    lock = CLIENT_DIR / "package-lock.json"
    if installed.is_file() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return
    result = subprocess.run(
        ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
        cwd=CLIENT_DIR,
        capture_output=True,
        text=True,
        timeout=NPM_CI_TIMEOUT_S,
    )
    assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The client script, its dependencies installed; skips without Node.js and npm."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the Node.js client needs both")
    ensure_node_modules()
    return CLIENT_DIR / "generate.js"


@pytest.fixture(scope="module")
def cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    with running_cluster(demo_model_dir, tmp_path_factory.mktemp("node-client-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir)


def run_node(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", str(script), *args], capture_output=True, text=True, timeout=60, cwd=CLIENT_DIR
    )


@pytest.mark.parametrize(
    ("prompt", "sampling"),
    [
        ("Hello from Node.js", {"temperature": 0.0}),
        ("Seeded sampling", {"temperature": 0.8, "top_p": 0.9, "seed": 424242}),
    ],
    ids=["greedy", "seeded"],
)
def test_node_client_matches_the_engine(
    node_client: Path,
    cluster: ProcessCluster,
    reference: Reference,
    prompt: str,
    sampling: dict[str, Any],
) -> None:
    max_tokens = 24
    flags = {"temperature": "--temperature", "top_p": "--top-p", "seed": "--seed"}
    sampling_args = [part for key, value in sampling.items() for part in (flags[key], str(value))]
    result = run_node(
        node_client,
        "--address",
        cluster.grpc_address,
        "--model",
        cluster.model_name,
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        *sampling_args,
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    expected = reference.completion(prompt, max_tokens=max_tokens, **sampling)
    assert output["token_ids"] == expected
    assert output["text"] == reference.text(expected)
    assert output["finish_reason"] == "FINISH_REASON_LENGTH"
    assert output["usage"]["num_completion_tokens"] == max_tokens
    assert output["usage"]["num_prompt_tokens"] == len(reference.tokenizer.encode(prompt))


def test_node_client_gets_typed_errors(node_client: Path, cluster: ProcessCluster) -> None:
    result = run_node(
        node_client, "--address", cluster.grpc_address, "--model", "no-such-model", "--prompt", "x"
    )
    assert result.returncode == 1
    error = json.loads(result.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "NOT_FOUND"
    # The typed error, decoded from the grpc-status-details-bin trailer in JavaScript.
    assert error["pdserve"]["reason"] == "MODEL_NOT_FOUND"
    assert error["pdserve"]["domain"] == "pdserve.v1"
    assert error["pdserve"]["metadata"]["retryScope"] == "NEVER"
