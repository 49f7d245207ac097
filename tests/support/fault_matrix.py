"""The fault matrix: which faults, on which targets, in which phase of a request, the suite
injects; what each cell's last run said; and the table an operator reads.

A cell is (fault, target, phase). Each is one of:

* built: `tests/e2e/test_fault_matrix.py` runs it. It passes when every stream either
  completes equal to an undisturbed run (nothing lost or duplicated) or ends with a typed error
  whose message carries no transport string, within the request's deadline; and every block
  and lease of every instance is free afterwards.
* not applicable: the fault cannot meet the target in that phase (the reason is given).
* not built: a cell that can happen and that no test injects yet.

`make chaos` runs every built cell and prints the table (`tools/fault_matrix.py`); `make test`
runs the ``fast`` cells, which cover each built fault and each built phase at least once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

FAULTS = (
    "sigkill",  # the process dies (and is restarted, as the launcher or Kubernetes does)
    "sigstop",  # the process freezes (SIGCONT once the outcome is in)
    "partition",  # network namespaces: the target's host is cut off (a gateway: from the instances)
    "slow_link",  # network namespaces: the target's link is slowed (a rate; netem's delay too)
    "store_gone",  # the KV store (redis) dies
    "registry_gone",  # etcd dies
    "disk_full",  # the file store's disk fills
)
TARGETS = ("gateway", "prefill", "prefill_rank", "decode", "decode_rank", "store", "registry")
PHASES = (
    "queued",  # waiting in the gateway's admission queue
    "prefilling",  # the prompt is computed, its KV pushed layer by layer to the decode's lease
    "decoding",  # tokens stream from the decode
    "resuming",  # a resumable stream is taken over after its gateway left
    "kept",  # a background (kept) response runs with no client attached
    "cancelling",  # the client went away; the lease is being released
)

# NOTE: the process faults meet processes; the store and registry faults meet their server.
_PROCESS_FAULTS = frozenset({"sigkill", "sigstop", "partition", "slow_link"})
NETWORK_FAULTS = frozenset({"partition", "slow_link"})
_SERVER_OF_FAULT = {"store_gone": "store", "registry_gone": "registry", "disk_full": "store"}


@dataclass(frozen=True)
class Cell:
    """One fault on one target in one phase.

    Attributes:
        variant: What else holds while the fault lands (e.g. ``other_restarting``: the only
            other instance of the target's role is down and coming back).
        fast: Run by `make test` (else only by `make chaos`).
    """

    fault: str
    target: str
    phase: str
    variant: str = ""
    fast: bool = False

    @property
    def is_rank(self) -> bool:
        """The target is one rank of an instance split by tensor parallelism."""
        return self.target.endswith("_rank")

    @property
    def role(self) -> str:
        """The role of the instance the target is (or is a rank of)."""
        return self.target.removesuffix("_rank")

    @property
    def cell_id(self) -> str:
        """The cell's name in test ids and in the results file."""
        parts = [self.fault, self.target, self.phase, *([self.variant] if self.variant else [])]
        return "-".join(parts)


# NOTE: `make test`'s cells of the network faults, one each and a few seconds each: a prefill
# cut off while it pushes a prompt's KV; the gateway's link slowed while prompts come in.
_FAST_NETWORK_CELLS = frozenset(
    {("partition", "prefill", "prefilling"), ("slow_link", "gateway", "prefilling")}
)

BUILT = (
    Cell("sigkill", "decode", "decoding", "other_restarting", fast=True),
    Cell("sigkill", "decode", "decoding"),
    Cell("sigkill", "decode", "prefilling"),
    Cell("sigkill", "decode", "cancelling", fast=True),
    Cell("sigkill", "prefill", "prefilling"),
    Cell("sigkill", "prefill", "decoding"),
    Cell("sigkill", "prefill", "cancelling"),
    Cell("sigstop", "decode", "decoding"),
    Cell("sigstop", "decode", "prefilling"),
    Cell("sigstop", "decode", "cancelling"),
    Cell("sigstop", "prefill", "prefilling"),
    Cell("sigstop", "prefill", "decoding"),
    Cell("sigstop", "prefill", "cancelling"),
    Cell("sigkill", "decode", "queued", fast=True),
    Cell("sigkill", "prefill", "queued"),
    Cell("sigstop", "decode", "queued"),
    Cell("sigstop", "prefill", "queued"),
    Cell("sigkill", "decode", "kept", fast=True),
    Cell("sigstop", "decode", "kept"),
    Cell("sigkill", "prefill", "kept"),
    Cell("sigkill", "decode", "resuming"),
    Cell("sigstop", "decode", "resuming", fast=True),
    Cell("sigkill", "prefill", "resuming"),
    Cell("sigkill", "prefill_rank", "prefilling"),
    Cell("sigkill", "prefill_rank", "decoding"),
    Cell("sigkill", "decode_rank", "prefilling"),
    Cell("sigkill", "decode_rank", "decoding"),
    Cell("sigstop", "prefill", "kept"),
    Cell("sigstop", "prefill", "resuming"),
    Cell("sigkill", "prefill_rank", "queued"),
    Cell("sigkill", "prefill_rank", "cancelling"),
    Cell("sigkill", "prefill_rank", "kept"),
    Cell("sigkill", "prefill_rank", "resuming"),
    Cell("sigkill", "decode_rank", "queued"),
    Cell("sigkill", "decode_rank", "cancelling"),
    Cell("sigkill", "decode_rank", "kept"),
    Cell("sigkill", "decode_rank", "resuming"),
    Cell("store_gone", "store", "queued"),
    Cell("store_gone", "store", "kept"),
    Cell("store_gone", "store", "resuming"),
    Cell("registry_gone", "registry", "prefilling"),
    Cell("registry_gone", "registry", "cancelling"),
    Cell("store_gone", "store", "prefilling"),
    Cell("store_gone", "store", "decoding"),
    Cell("store_gone", "store", "cancelling"),
    Cell("registry_gone", "registry", "queued"),
    Cell("registry_gone", "registry", "decoding"),
    Cell("registry_gone", "registry", "kept"),
    Cell("registry_gone", "registry", "resuming"),
    Cell("sigstop", "decode_rank", "queued"),
    Cell("sigstop", "decode_rank", "prefilling"),
    Cell("sigstop", "decode_rank", "decoding"),
    Cell("sigstop", "decode_rank", "resuming"),
    Cell("sigstop", "decode_rank", "kept"),
    Cell("sigstop", "decode_rank", "cancelling"),
    Cell("sigstop", "prefill_rank", "queued"),
    Cell("sigstop", "prefill_rank", "prefilling"),
    Cell("sigstop", "prefill_rank", "decoding"),
    Cell("sigstop", "prefill_rank", "resuming"),
    Cell("sigstop", "prefill_rank", "kept"),
    Cell("sigstop", "prefill_rank", "cancelling"),
    Cell("sigstop", "gateway", "queued"),
    Cell("sigstop", "gateway", "prefilling"),
    Cell("sigstop", "gateway", "decoding"),
    Cell("sigstop", "gateway", "resuming"),
    Cell("sigstop", "gateway", "kept"),
    Cell("sigstop", "gateway", "cancelling"),
    # NOTE: a killed gateway, started again in its place, on the cluster with etcd (its
    # resumable requests outlive it there): clients resume their streams; background responses
    # and streams nobody follows are adopted. Its decoding cell is injected elsewhere.
    *(
        Cell("sigkill", "gateway", phase)
        for phase in ("queued", "prefilling", "resuming", "kept", "cancelling")
    ),
    *(
        Cell(fault, target, phase, fast=(fault, target, phase) in _FAST_NETWORK_CELLS)
        for fault in ("partition", "slow_link")
        for target in ("decode", "prefill", "gateway")
        for phase in PHASES
    ),
    # NOTE: the KV store's (redis) and the registry's (etcd) test host cut off or slowed; not
    # in `make test` (a cluster of seven test hosts of its own).
    *(
        Cell(fault, target, phase)
        for fault in ("partition", "slow_link")
        for target in ("store", "registry")
        for phase in PHASES
    ),
    # NOTE: the file store's disk (a small tmpfs) filled to the last byte; not in `make test`
    # (a cluster of its own, on a file store on that disk).
    *(
        Cell("disk_full", "store", phase)
        for phase in ("queued", "prefilling", "resuming", "kept", "cancelling")
    ),
)


# NOTE: cells another test file injects (each in `make test`), with what it does; the matrix
# lists them so the table is whole, and counts them apart from its own runs.
ELSEWHERE: dict[tuple[str, str, str], str] = {
    ("sigkill", "gateway", "decoding"): "test_resumable_responses.py::"
    "test_streams_outlive_a_killed_gateway (resumable streams go on at the other gateway); "
    "test_etcd_gateways.py::test_a_killed_gateway_fails_only_its_streams_retryably",
    ("partition", "decode", "decoding"): "test_multi_host.py::"
    "test_partitioned_decode_moves_its_streams_and_rejoins (network namespaces)",
    ("registry_gone", "registry", "decoding"): "test_etcd_gateways.py::"
    "test_requests_keep_succeeding_while_etcd_restarts",
    ("store_gone", "store", "decoding"): "test_kv_store_tier.py::"
    "test_store_down_offload_falls_back_without_losing_tokens",
    ("disk_full", "store", "decoding"): "test_chaos.py::TestPreemption::"
    "test_preemption_storm_while_the_store_breaks (every write to the file store fails; a "
    "full disk is not simulated)",
}


def not_applicable(fault: str, target: str, phase: str) -> str | None:
    """Why (fault, target, phase) cannot happen, or None when it can."""
    if fault in _PROCESS_FAULTS:
        if target in ("store", "registry") and fault in ("sigkill", "sigstop"):
            return "the store and registry faults are their own rows (store_gone, registry_gone)"
        if fault in NETWORK_FAULTS and target.endswith("_rank"):
            return (
                "the ranks of a split instance run on one host and meet over its loopback and "
                "shared memory: no link between them to cut or slow (the instance's link is "
                f"the {target.removesuffix('_rank')} row)"
            )
        return None
    if target != _SERVER_OF_FAULT[fault]:
        return f"{fault} is a fault of the {_SERVER_OF_FAULT[fault]}"
    return None


def status_of(fault: str, target: str, phase: str) -> str:
    """``built``, ``elsewhere``, ``n/a: <why>`` or ``not built`` for one cell."""
    if any((c.fault, c.target, c.phase) == (fault, target, phase) for c in BUILT):
        return "built"
    if (fault, target, phase) in ELSEWHERE:
        return "elsewhere"
    why = not_applicable(fault, target, phase)
    return f"n/a: {why}" if why else "not built"


def record(path: Path, cell: Cell, outcome: str, seconds: float, detail: str) -> None:
    """Appends one run of `cell` to the results file (JSON lines)."""
    line = {"cell": cell.cell_id, "outcome": outcome, "seconds": round(seconds, 2)}
    line["detail"] = detail
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")


def read_results(path: Path) -> dict[str, dict[str, object]]:
    """The last run of each cell in the results file, by cell id."""
    results: dict[str, dict[str, object]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                results[str(entry["cell"])] = entry
    return results


def render(results: dict[str, dict[str, object]], cells: Iterable[Cell] = BUILT) -> str:
    """The table of built cells with their last results, the counts, the cells other test
    files inject, and the grid of every (fault, target) pair by phase (``ok``, ``FAIL``, ``-``
    not run, ``e`` injected by another test file, ``n/a``, ``.`` not built)."""
    cells = list(cells)
    lines = ["| cell | variant | fast | outcome | s | detail |", "|---|---|---|---|---|---|"]
    counts = {"passed": 0, "failed": 0, "not run": 0}
    for cell in cells:
        result = results.get(cell.cell_id)
        outcome = str(result["outcome"]) if result else "not run"
        counts[outcome if outcome in counts else "failed"] += 1
        seconds = f"{result['seconds']}" if result else ""
        detail = str(result["detail"]) if result else ""
        name = f"{cell.fault} {cell.target} {cell.phase}"
        lines.append(
            f"| {name} | {cell.variant} | {'yes' if cell.fast else ''} | {outcome} | "
            f"{seconds} | {detail} |"
        )
    total_s = sum(float(str(r["seconds"])) for r in results.values())
    statuses = [status_of(f, t, p) for f in FAULTS for t in TARGETS for p in PHASES]
    num_na = sum(s.startswith("n/a") for s in statuses)
    num_unbuilt = statuses.count("not built")
    num_elsewhere = statuses.count("elsewhere")
    applicable = len(statuses) - num_na
    summary = (
        f"cells: {len(statuses)} in all, {num_na} not applicable, {applicable} applicable: "
        f"{len({(c.fault, c.target, c.phase) for c in cells})} built here, {num_elsewhere} "
        f"injected by other test files, {num_unbuilt} not built. "
        f"Runs: {counts['passed']} passed, {counts['failed']} failed, {counts['not run']} not "
        f"run, {total_s:.0f} s."
    )
    grid = ["", "| fault | target | " + " | ".join(PHASES) + " |"]
    grid.append("|---|---|" + "---|" * len(PHASES))
    for fault in FAULTS:
        for target in TARGETS:
            marks = []
            for phase in PHASES:
                status = status_of(fault, target, phase)
                if status == "built":
                    ran = [
                        results.get(c.cell_id)
                        for c in cells
                        if (c.fault, c.target, c.phase) == (fault, target, phase)
                    ]
                    if any(r is not None and r["outcome"] != "passed" for r in ran):
                        marks.append("FAIL")
                    elif all(r is not None for r in ran):
                        marks.append("ok")
                    else:
                        marks.append("-")
                elif status == "elsewhere":
                    marks.append("e")
                else:
                    marks.append("n/a" if status.startswith("n/a") else ".")
            if any(mark != "n/a" for mark in marks):
                grid.append(f"| {fault} | {target} | " + " | ".join(marks) + " |")
    elsewhere = ["", "| injected elsewhere | by |", "|---|---|"]
    elsewhere += [f"| {' '.join(key)} | {test} |" for key, test in ELSEWHERE.items()]
    return "\n".join([summary, "", *lines, *elsewhere, *grid])
