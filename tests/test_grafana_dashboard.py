"""docs/deployment/grafana-dashboard.json imports cleanly and graphs only metrics the daemon declares."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from superfluid.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "deployment" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
METRIC = re.compile(r"\bsuperfluid_[a-z0-9_]+\b")
# what an operator asks of the dashboard: lanes, queue by class, first-token time, decode and prefill rates,
# the KV tiers, prefix hits by tier, workers and leases
COVERED = {
    "superfluid_lanes_active",
    "superfluid_queue_depth",
    "superfluid_ttft_seconds_bucket",
    "superfluid_decode_tokens_total",
    "superfluid_prefill_tokens_total",
    "superfluid_kv_slots",
    "superfluid_host_cache_bytes",
    "superfluid_park_bytes",
    "superfluid_prefix_hits_total",
    "superfluid_worker_up",
    "superfluid_leases_held",
}


def declared_names() -> set[str]:
    """The sample names of every family the daemon's registry declares: its collectors asked with no
    model loaded, keys on and a shared store, so that each family is there, with no samples."""
    metrics = Metrics()
    leases = SimpleNamespace(held=set(), takeovers=0, lost=0)
    metrics.attach(
        SimpleNamespace(models=SimpleNamespace(loaded=list), running={}, store=SimpleNamespace(leases=leases))
    )
    metrics.watch_gate(SimpleNamespace(keyed=True, counts={}, keys=[]))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the variables' queries."""
    found = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    return found + [variable["query"]["query"] for variable in board["templating"]["list"]]


def test_the_declared_names_are_the_exposition_s() -> None:
    names = declared_names()
    assert {"superfluid_ttft_seconds_bucket", "superfluid_decode_tokens_total", "superfluid_leases_held"} <= names
    assert "superfluid_queue_depth" in names and "superfluid_queue_depth_total" not in names


def test_every_panel_has_a_title_targets_and_the_imported_datasource() -> None:
    board = dashboard()
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert board["panels"]
    for panel in board["panels"]:
        assert panel["title"].strip(), panel
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        assert panel["datasource"] == DATASOURCE and all(t["datasource"] == DATASOURCE for t in panel["targets"])
    assert all(variable["datasource"] == DATASOURCE for variable in board["templating"]["list"])


def test_panel_ids_and_target_refs_are_unique() -> None:
    panels = dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def balanced(expression: str) -> bool:
    """Whether the brackets of a PromQL expression (outside its quoted label values) pair up."""
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in re.sub(r'"[^"]*"', '""', expression):
        if char in "([{":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack


def test_every_metric_graphed_is_one_the_daemon_declares() -> None:
    declared = declared_names()
    graphed: set[str] = set()
    for expression in expressions(dashboard()):
        used = set(METRIC.findall(expression))
        assert used, f"no superfluid metric in {expression!r}"
        assert balanced(expression), f"unbalanced brackets in {expression!r}"
        assert used <= declared, f"{sorted(used - declared)} in {expression!r} are not metrics of the daemon"
        graphed |= used
    assert graphed >= COVERED, f"nothing graphs {sorted(COVERED - graphed)}"
