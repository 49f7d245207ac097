"""The pdserve-gateway command line: flags from GatewayConfig, validation, --help."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.pki import cluster_pki

from pdserve.common.config import MIRRORS, from_args, mirror_field
from pdserve.gateway.__main__ import build_parser
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.routing.policy import CacheRouting
from pdserve.gateway.routing.queue_bounds import QueueLimits


def _parse(*argv: str) -> GatewayConfig:
    return from_args(GatewayConfig, build_parser().parse_args(["--insecure", *argv]))


def test_defaults_and_flags() -> None:
    defaults = GatewayConfig(insecure=True)
    assert _parse() == defaults
    assert (defaults.port, defaults.grpc_port, defaults.internal_port) == (8000, 50050, 50051)
    config = _parse(
        "--prefill", "10.0.0.1:50061", "--decode", "10.0.0.2:50071", "--decode", "h:1",
        "--max-attempts", "5", "--preempt-retry-count", "2", "--preempt-retry-exclude-decode",
        "--request-timeout", "30", "--api-key", "k",
    )  # fmt: skip
    assert config.prefill == ("10.0.0.1:50061",)
    assert config.decode == ("10.0.0.2:50071", "h:1")
    assert (config.max_attempts, config.preempt_retry_count) == (5, 2)
    assert config.preempt_retry_exclude_decode and config.request_timeout == 30.0
    assert config.api_key == "k"
    keys = _parse("--api-key-file", "/etc/keys.txt", "--requests-per-minute-per-key", "90")
    assert (keys.api_key_file, keys.requests_per_minute_per_key) == ("/etc/keys.txt", 90.0)
    assert defaults.cache_routing() == CacheRouting()
    routing = _parse(
        "--no-cache-aware-routing", "--cache-balance-tokens", "0", "--cache-memory-blocks", "9"
    ).cache_routing()
    assert routing == CacheRouting(is_enabled=False, balance_tokens=0, memory_blocks=9)
    assert (defaults.tool_call_parser, defaults.request_limits().max_tools) == ("auto", 128)
    tools = _parse("--tool-call-parser", "llama3_json", "--max-tools", "4")
    assert (tools.tool_call_parser, tools.request_limits().max_tools) == ("llama3_json", 4)


@pytest.mark.parametrize("group", [RequestLimits, QueueLimits, CacheRouting])
def test_each_settings_group_gives_its_flags_their_default_help_and_range(group: type) -> None:
    flags = {
        f.metadata[MIRRORS][1]: f
        for f in dataclasses.fields(GatewayConfig)
        if f.metadata.get(MIRRORS, (None,))[0] is group
    }
    fields = dataclasses.fields(group)
    assert set(flags) == {f.name for f in fields}  # every setting of the group is a flag
    for f in fields:
        assert f.metadata["help"]
        assert flags[f.name].default == f.default
        assert {**f.metadata, MIRRORS: (group, f.name)} == flags[f.name].metadata


def test_the_settings_groups_are_built_from_their_flags() -> None:
    config = _parse("--max-queued-requests", "3", "--max-n", "2", "--cache-memory-blocks", "9")
    assert config.queue_limits() == QueueLimits(max_queued_requests=3)
    assert config.request_limits() == RequestLimits(max_n=2)
    assert config.cache_routing() == CacheRouting(memory_blocks=9)
    with pytest.raises(TypeError, match="no field 'max_nothing'"):
        mirror_field(QueueLimits, "max_nothing")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-attempts", "0"], "max_attempts"),
        (["--prefill", "nohost"], "--prefill must be HOST:PORT"),
        (["--request-timeout", "0"], "request_timeout"),
        (["--instance-ttl-s", "1", "--heartbeat-interval-s", "2"], "instance_ttl_s"),
        (["--port", "70000"], "port"),
        (["--internal-port", "70000"], "internal_port"),
        (["--tls-ca", "ca.crt"], "exclude each other"),
        (["--requests-per-minute-per-key", "0"], "requests_per_minute_per_key"),
        (["--api-key-file", " "], "api_key_file"),
        (["--cache-balance-tokens", "-1"], "cache_balance_tokens"),
        (["--cache-memory-blocks", "0"], "cache_memory_blocks"),
        (["--max-tools", "0"], "max_tools"),
    ],
)
def test_bad_settings_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(*argv)


def test_no_certificates_and_no_insecure_is_refused() -> None:
    with pytest.raises(ValueError, match="needs mutual TLS: pass --tls-ca"):
        from_args(GatewayConfig, build_parser().parse_args([]))
    with pytest.raises(ValueError, match="needs mutual TLS"):
        GatewayConfig(tls_ca="ca.crt", tls_cert="gateway.crt")


def test_help_explains_the_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for text in ("OpenAI-compatible", "--preempt-retry-count", "--prefill", "examples:",
                 "--tls-cert", "--insecure", "--internal-port"):  # fmt: skip
        assert text in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve.gateway", "--insecure", "--max-attempts", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "max_attempts must be >= 1" in bad.stderr
    for flag in ("--api-key-file", "--requests-per-minute-per-key", "NAME:KEY"):
        assert flag in result.stdout
    for text in (
        "--tool-call-parser {auto,hermes,llama3_json,harmony,deepseek_v3}",
        "<tool_call>",
        "--max-tools",
    ):
        assert text in result.stdout


def test_a_malformed_key_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("alice:sk-alice\nsk-bare-key\n")
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve.gateway", "--insecure", "--api-key-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "keys.txt line 2: expected NAME:KEY" in bad.stderr
    assert "sk-bare-key" not in bad.stderr


def test_process_serves_until_sigterm_then_stops_cleanly() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.gateway", "--host", "127.0.0.1", "--port", "0",
         "--grpc-port", "0", "--internal-port", "0", "--shutdown-grace-s", "1",
         *cluster_pki().args("gateway", "gateway-cli")],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        started = None
        for line in process.stderr:
            event = json.loads(line)
            if event["event"] == "gateway_started":
                started = event
                break
        assert started is not None and started["http_port"] > 0 and started["grpc_port"] > 0
        assert started["internal_port"] > 0
        assert started["internal_plane"] == "mtls gateway/gateway-cli"
        base = f"http://127.0.0.1:{started['http_port']}"
        live = urllib.request.urlopen(f"{base}/livez", timeout=10)
        assert json.loads(live.read())["status"] == "alive"
        # NOTE: no prefill or decode registered: not ready.
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"{base}/health", timeout=10)
        assert not_ready.value.code == 503
        body = json.loads(not_ready.value.read())
        assert (body["status"], body["internal_plane"]) == ("not_ready", "mtls")
        process.send_signal(signal.SIGTERM)
        remaining = process.stderr.read()
        assert process.wait(timeout=20) == 0
        assert "gateway_stopped" in remaining
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--internal-port"])
def test_a_taken_port_fails_the_start_in_one_line(flag: str) -> None:
    """Another process listening on a port: exit 1 naming it, no traceback (a gRPC port is
    not shared with it, as gRPC's default SO_REUSEPORT would)."""
    ports = {"--port": "0", "--grpc-port": "0", "--internal-port": "0"}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        taken_port = taken.getsockname()[1]
        ports[flag] = str(taken_port)
        result = subprocess.run(
            [sys.executable, "-m", "pdserve.gateway", "--insecure", "--host", "127.0.0.1",
             *[arg for pair in ports.items() for arg in pair]],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    # NOTE: gRPC's core logs its own line about the bind before ours.
    assert result.stderr.splitlines()[-1] == (
        f"pdserve-gateway: cannot listen on 127.0.0.1:{taken_port}: "
        + ("Address already in use" if flag == "--port"
           else "the port is in use (another server there?) or the address is not this host's")
    ), result.stderr  # fmt: skip
    assert "Traceback" not in result.stderr
    assert any(json.loads(line)["event"] == "listen_failed" for line in result.stderr.splitlines()
               if line.startswith("{"))  # fmt: skip


def test_the_gateway_never_imports_torch_or_numpy() -> None:
    code = (
        "import sys, pdserve.gateway.server, pdserve.gateway.__main__; "
        "import pdserve.gateway.routing.router; "
        "heavy = {'torch', 'numpy'} & set(sys.modules); assert not heavy, f'imported {heavy}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
