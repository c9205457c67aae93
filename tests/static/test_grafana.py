"""Grafana in compose.yaml (deploy/grafana/): the provisioned data sources address the
compose services, and the dashboard queries only metrics and labels the services export,
with the panels the issue asks for (an SLA row with TTFT P95 against its 300 ms target,
cold start, KV transfer).

No PromQL parser runs here (promtool is not installed): the queries are checked for the
names they use and for balanced brackets.
"""
from __future__ import annotations

import functools
import json
import re

import pytest

from tests.static.test_compose import REPO_ROOT, default_config
from tests.static.test_observability import (
    DASHBOARD,
    GRAFANA_PROVISIONING,
    host_port,
    load_yaml,
)

# What the services export (services/common/metrics/). A histogram is queried through its
# _bucket, _sum or _count series; a counter through _total.
HISTOGRAMS = {"baton_time_to_first_token_seconds", "baton_time_per_output_token_seconds",
              "baton_inter_token_latency_seconds", "baton_e2e_request_latency_seconds",
              "baton_request_queue_duration_seconds", "baton_kv_transfer_duration_seconds",
              "baton_prefill_rpc_leg_duration_seconds", "baton_request_prompt_tokens",
              "baton_request_generation_tokens", "baton_request_prefill_time_seconds",
              "baton_request_decode_time_seconds", "baton_request_inference_time_seconds", "baton_iteration_tokens",
              "baton_kv_block_lifetime_seconds", "baton_kv_block_idle_before_evict_seconds",
              "baton_kv_block_reuse_gap_seconds", "baton_request_params_n", "baton_request_max_num_generation_tokens"}
COUNTERS = {"baton_prompt_tokens_total", "baton_generation_tokens_total", "baton_request_success_total",
            "baton_request_errors_total", "baton_kv_transfer_bytes_total", "baton_prefix_cache_queries_total",
            "baton_prefix_cache_hits_total", "baton_router_requests_total", "baton_spec_decode_num_draft_tokens_total",
            "baton_spec_decode_num_accepted_tokens_total", "baton_spec_decode_num_drafts_total",
            "baton_spec_decode_num_accepted_tokens_per_pos_total", "baton_num_preemptions_total",
            "baton_kv_disk_tier_hit_blocks_total", "baton_kv_events_batches_sent_total",
            "baton_kv_events_batches_dropped_total"}
GAUGES = {"baton_kv_pages_used", "baton_kv_pages_free", "baton_requests_running", "baton_requests_waiting",
          "baton_engine_init_duration_seconds", "baton_weight_loading_duration_seconds",
          "baton_warmup_duration_seconds", "baton_router_redis_up", "baton_kv_tier_bytes_used",
          "baton_kv_disk_tier_bytes_used", "baton_kv_pages_fenced"}
SERIES = ({f"{name}{suffix}" for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
          | COUNTERS | GAUGES)
# Labels the services put on their metrics, Prometheus' target labels, and the histograms' `le`.
LABELS = {"model", "service", "instance", "exported_instance", "job", "le", "transport", "finish_reason", "reason",
          "decision", "position", "leg"}
TTFT_TARGET_S = 0.3


@functools.cache
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    """Every panel of the dashboard, rows included, in order (a collapsed row holds its own)."""
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def exprs(panel: dict) -> list[str]:
    return [target["expr"] for target in panel.get("targets", []) if target.get("expr")]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bbaton_[a-z0-9_]+\b", expr))


def balanced(expr: str) -> bool:
    """Brackets outside string literals pair up (no PromQL parser here; promtool is not installed)."""
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def rows() -> dict[str, list[dict]]:
    """The dashboard's panels under each row's title, by position (gridPos.y) as Grafana lays them out."""
    out: dict[str, list[dict]] = {}
    ordered = sorted(dashboard()["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    current = None
    for panel in ordered:
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], list(panel.get("panels", [])))
        elif current is not None:
            current.append(panel)
    return out


def datasources() -> dict[str, dict]:
    config = load_yaml(GRAFANA_PROVISIONING / "datasources" / "datasources.yaml")
    return {source["uid"]: source for source in config["datasources"]}


@pytest.mark.parametrize("kind, service, port", [("prometheus", "prometheus", 9090), ("jaeger", "jaeger", 16686)])
def test_datasources_point_at_the_compose_services(kind, service, port):
    [source] = [source for source in datasources().values() if source["type"] == kind]
    assert host_port(source["url"]) == (service, port)
    assert source.get("access", "proxy") == "proxy"  # Grafana's server reaches them, not the browser
    assert service in default_config()["services"]


def test_dashboard_provider_reads_the_mounted_folder():
    config = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "baton.yaml")
    [provider] = config["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboard_parses_and_every_panel_uses_a_provisioned_datasource():
    board = dashboard()
    assert board["uid"] == "baton" and board["schemaVersion"] >= 36
    ids = [panel["id"] for panel in panels()]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    uids = set(datasources())
    for panel in panels():
        if panel["type"] == "row":
            continue
        assert exprs(panel), f"panel {panel['title']!r} has no query"
        for source in [panel.get("datasource"), *(t.get("datasource") for t in panel["targets"])]:
            assert source is None or source["uid"] in uids, f"{panel['title']!r}: datasource {source}"


def test_panels_fit_the_grid_without_overlapping():
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[x, y]!r}"
                cells[x, y] = panel["title"]


def test_every_query_names_only_metrics_and_labels_the_services_export():
    defined = {var["name"] for var in dashboard()["templating"]["list"]}
    queries = [(panel["title"], expr) for panel in panels() for expr in exprs(panel)]
    queries += [(f"${var['name']}", var["definition"]) for var in dashboard()["templating"]["list"]]
    for title, expr in queries:
        assert balanced(expr), f"{title!r}: unbalanced brackets in {expr}"
        unknown = metric_names(expr) - SERIES
        assert not unknown, f"{title!r} queries {sorted(unknown)}, which no service exports"
        # Selectors, `by (...)` and `without (...)` name labels only.
        labels = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels |= {label.strip() for label in group.split(",") if label.strip()}
        assert labels <= LABELS, f"{title!r} uses labels {sorted(labels - LABELS)}"
        variables = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval", "__interval", "__range"}
        assert variables <= defined, f"{title!r} uses undefined variables {sorted(variables - defined)}"


def test_every_metric_on_the_dashboard_is_defined_in_the_services():
    """Catches a rename on either side: each family appears by name in services/ (a counter
    without its _total, as prometheus_client declares it)."""
    source = "\n".join(path.read_text() for path in (REPO_ROOT / "services").rglob("*.py"))
    for name in sorted(HISTOGRAMS | COUNTERS | GAUGES):
        family = name.removesuffix("_total")
        assert re.search(rf"[\"']{family}(_total)?[\"']", source), f"{family} is not defined in services/"


def sla_panel() -> dict:
    [panel] = [panel for panel in rows()["SLA"]
               if any("histogram_quantile(0.95" in e and "baton_time_to_first_token_seconds_bucket" in e
                      for e in exprs(panel))]
    return panel


def test_sla_panel_shows_ttft_p95_against_the_300_ms_target():
    panel = sla_panel()
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "s"
    steps = defaults["thresholds"]["steps"]
    assert TTFT_TARGET_S in [step["value"] for step in steps], steps
    assert "line" in defaults["custom"]["thresholdsStyle"]["mode"]


@pytest.mark.parametrize("row, metrics", [
    ("SLA", ["baton_time_to_first_token_seconds_bucket", "baton_time_per_output_token_seconds_bucket",
             "baton_generation_tokens_total", "baton_request_errors_total", "baton_request_success_total",
             "baton_kv_pages_used", "baton_kv_pages_free", "baton_requests_waiting", "baton_requests_running"]),
    ("Cold start", ["baton_engine_init_duration_seconds", "baton_weight_loading_duration_seconds",
                    "baton_warmup_duration_seconds"]),
    ("KV transfer", ["baton_kv_transfer_duration_seconds_bucket", "baton_kv_transfer_bytes_total"]),
])
def test_rows_show_what_the_issue_asks(row, metrics):
    assert row in rows(), f"no row {row!r}: {list(rows())}"
    shown = set().union(*(metric_names(e) for panel in rows()[row] for e in exprs(panel)))
    assert set(metrics) <= shown, f"row {row!r} lacks {sorted(set(metrics) - shown)}"


def test_kv_transfer_time_is_shown_by_transport_at_p50_and_p95():
    queries = [e for panel in rows()["KV transfer"] for e in exprs(panel)
               if "baton_kv_transfer_duration_seconds_bucket" in e]
    for q in ("0.5", "0.95"):
        assert any(f"histogram_quantile({q}," in e and re.search(r"by \(le, transport\)", e) for e in queries), q
