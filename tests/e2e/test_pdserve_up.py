"""`pdserve up` as a user runs it: separate processes, the openai SDK, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.real_cluster import Reference

from pdserve.launcher.cluster import Cluster, ClusterConfig


@pytest.fixture(scope="module")
def cluster(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = ClusterConfig(
        model=str(demo_model_dir),
        port=0,
        grpc_port=0,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=120,
    )
    processes = Cluster(config)
    processes.start()
    yield processes
    processes.stop(timeout_s=20)


def test_openai_sdk_against_real_processes(cluster: Cluster, demo_model_dir: Path) -> None:
    reference = Reference(demo_model_dir)
    client = openai.OpenAI(base_url=f"{cluster.rest_url}/v1", api_key="unused", max_retries=0)
    model = next(m.id for m in client.models.list())
    response = client.completions.create(
        model=model, prompt="Hello there", max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    expected = reference.completion("Hello there", temperature=0.0, max_tokens=16)
    assert response.choices[0].model_extra["token_ids"] == expected
    messages = [{"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference.text(reference.chat(messages, temperature=0.0, max_tokens=12))


def test_cli_reports_a_crashed_child(demo_model_dir: Path, tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.launcher", "up", "--model", str(demo_model_dir),
         "--port", "0", "--grpc-port", "0", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        grpc_address = ""
        for line in process.stdout:
            if "gRPC (pdserve.v1.GenerationService):" in line:
                grpc_address = line.split()[-1]
                break
        assert grpc_address, "the banner never came"
        pattern = f"pdserve.decode .*--gateway {grpc_address}"
        pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        os.kill(int(pids.split()[0]), signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1
    assert "decode-0" in stderr and "status -9" in stderr
    assert (tmp_path / "decode-0.log").is_file()
