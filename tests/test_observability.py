"""What operators are shown is real: every metric and label that an alert, a dashboard panel
or a doc names is exported by a live process.

One edge node (``edgecache serve --metrics-listen``) stages and serves a small version, a
training process reads an epoch through ``EdgeDataset(metrics_port=0)``, and the controller
(``edgecache controller --metrics-listen``) runs a round; their ``/metrics`` are scraped and
every sample name, type and label name is collected. Then deploy/alerts.yml, the Grafana
dashboards and the docs are read: each metric they reference must be an exported sample
(counters as ``_total``, histograms as ``_bucket``/``_sum``/``_count``), each label in a
selector, ``by (...)``, legend or ``$labels`` must be there, the alerts must pass
``promtool check rules`` and fire on series with the live label sets (``promtool test
rules``), and deploy/prometheus.yml must pass ``promtool check config``. The promtool parts
skip where promtool is absent (Debian: ``apt-get install prometheus``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.request import urlopen

import pytest
import yaml
from edgeutil import publish, stub, write_parquet_shards
from prometheus_client.parser import text_string_to_metric_families

from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "alerts.yml"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", DEPLOY / "README.md"]
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
METRIC = re.compile(r"\bedgecache_[a-z0-9_]*[a-z0-9]\b")
AGGREGATIONS = "sum|min|max|avg|count|stddev|stdvar|topk|bottomk|quantile|group|count_values"


@dataclass
class Exported:
    """What one or more ``/metrics`` pages hold."""

    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name → label names
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (sample, label)
    families: dict[str, str] = field(default_factory=dict)  # family name → type
    by_process: dict[str, set[str]] = field(default_factory=dict)  # process → family names
    created: dict[str, set[str]] = field(default_factory=dict)  # process → `_created` samples

    def add(self, process: str, text: str) -> None:
        for family in text_string_to_metric_families(text):
            self.created.setdefault(process, set()).update(
                s.name for s in family.samples if s.name.endswith("_created")
            )
            if family.name.endswith("_created"):
                continue  # prometheus_client's creation timestamps, not metrics of ours
            self.families[family.name] = family.type
            self.by_process.setdefault(process, set()).add(family.name)
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    self.values.setdefault((sample.name, label), set()).add(value)


def scrape(address: str) -> str:
    return urlopen(f"http://{address}/metrics", timeout=10).read().decode()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The three processes' /metrics after real work: a node, a training process, a controller."""
    import torch

    from edgecache.clients import EdgeDataset

    root = tmp_path_factory.mktemp("observability")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "origin", 2, rows=500)
    publish(registry, f"file://{root}/origin", "tokens")
    found = Exported()
    node = start_local_node(
        "eu-west",
        root / "cache",
        registry,
        capacity="64MiB",
        extra_args=["--metrics-listen", "127.0.0.1:0"],
    )
    try:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        with EdgeDataset("tokens@1", endpoints=[node.address], batch_size=16, metrics_port=0) as ds:
            for _ in ds.watch(torch.utils.data.DataLoader(ds, batch_size=None)):
                pass
            found.add("client", scrape(f"127.0.0.1:{ds.metrics_port}"))
        (root / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  eu-west:\n    nodes: ['{node.address}']\n"
        )
        start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        (root / "schedule.yaml").write_text(
            f"jobs:\n  - name: j\n    region: eu-west\n    start: '{start}'\n"
            "    duration: 60m\n    datasets: [tokens@1]\n"
        )
        found.add("controller", controller_metrics(root))
        found.add("node", scrape(node.metrics_address))
    finally:
        node.stop()
    return found


def controller_metrics(root: Path) -> str:
    """``edgecache controller --metrics-listen`` after its first round, then SIGTERM."""
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "edgecache.clients.cli", "controller"),
            *("--config", str(root / "edgecache.yaml")),
            *("--schedule", str(root / "schedule.yaml")),
            *("--interval", "0.5", "--lease-ttl", "5", "--metrics-listen", "127.0.0.1:0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        address = next(
            (line.split()[-1] for line in process.stdout if line.startswith("metrics on ")), None
        )
        assert address, "the controller never served metrics"
        deadline = time.monotonic() + 30
        while True:
            text = scrape(address)
            if re.search(r"^edgecache_controller_ticks_total [1-9]", text, re.M):
                return text
            assert time.monotonic() < deadline, "no planning round in 30 s"
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


# ----------------------------------------------------------- reading PromQL


def closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced: {text!r}")


def selectors(expr: str) -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    """Each ``edgecache_…`` selector: its name and its (label, op, value) matchers."""
    for match in re.finditer(r"\b(edgecache_[a-z0-9_]+)\s*(\{[^}]*\})?", expr):
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', match.group(2) or "")
        yield match.group(1), matchers


def groupings(expr: str) -> Iterator[tuple[str, list[str], str]]:
    """Each ``by``/``without``/``on``/``ignoring`` clause: keyword, labels, and its scope
    (the aggregation's argument, or the whole expression for vector matching)."""
    for match in re.finditer(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels = [label.strip() for label in match.group(2).split(",") if label.strip()]
        scope = expr
        if match.group(1) in ("by", "without"):
            after = expr[match.end() :].lstrip()
            if after.startswith("("):  # sum by (x) (ARG)
                begin = match.end() + expr[match.end() :].index("(")
                scope = expr[begin : closing(expr, begin) + 1]
            else:  # sum (ARG) by (x)
                end = expr[: match.start()].rstrip()
                assert end.endswith(")"), expr
                depth, i = 0, len(end) - 1
                while True:
                    depth += end[i] == ")"
                    depth -= end[i] == "("
                    if depth == 0:
                        break
                    i -= 1
                scope = end[i:]
        yield match.group(1), labels, scope


def output_labels(expr: str, exported: Exported) -> set[str]:
    """The labels an expression's result can carry (what a legend or ``$labels`` may use)."""
    expr = expr.strip()
    head = re.match(
        rf"^(?:histogram_quantile\s*\([^,]+,\s*)?(?:{AGGREGATIONS})\s*(by|without)?\s*(\(([^)]*)\))?",
        expr,
    )
    if head and head.group(1) == "by":
        return {label.strip() for label in head.group(3).split(",")} - {"le"}
    if head and head.group(1) is None and not expr.startswith("histogram_quantile"):
        return set()  # sum(...) without by: no labels
    names = {name for name, _ in selectors(expr)}
    return set().union(*(exported.labels.get(n, set()) for n in names)) | TARGET_LABELS


def check_expression(where: str, expr: str, exported: Exported) -> list[str]:
    """Every way ``expr`` could query something nothing exports."""
    problems = []
    for name, matchers in selectors(expr):
        if name not in exported.labels:
            family = exported.families.get(name)
            hint = f" (a {family}: query {name}_total)" if family == "counter" else ""
            problems.append(f"{where}: {name} is not exported{hint}")
            continue
        for label, op, value in matchers:
            if label not in exported.labels[name] | TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {label!r}")
            elif op == "=" and "$" not in value and label not in TARGET_LABELS:
                if value not in exported.values.get((name, label), set()):
                    problems.append(f'{where}: {name}{{{label}="{value}"}} is never exported')
    for keyword, labels, scope in groupings(expr):
        names = {name for name, _ in selectors(scope)}
        have = set().union(*(exported.labels.get(n, set()) for n in names)) | TARGET_LABELS
        for label in set(labels) - have:
            problems.append(f"{where}: {keyword} ({label}) but {sorted(names)} have no {label!r}")
    return problems


def alert_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_targets() -> Iterator[tuple[str, str, str]]:
    """(where, expr, legend) of every query in every dashboard, template variables included."""
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query or ""
            values = re.match(r"label_values\((.*),\s*(\w+)\)$", query.strip())
            if values:  # label_values(SELECTOR, LABEL): LABEL must be on SELECTOR
                query = f"sum by ({values.group(2)}) ({values.group(1)})"
            yield f"{path.name} variable ${variable['name']}", query, ""
        panels = list(dashboard["panels"])
        panels += [inner for panel in panels for inner in panel.get("panels", [])]
        for panel in panels:
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel['id']} {panel['title']!r}"
                yield where, target["expr"], target.get("legendFormat", "")


# ------------------------------------------------------------------ tests


def test_the_live_processes_export_what_the_code_declares(exported: Exported) -> None:
    assert {"node", "client", "controller"} <= set(exported.by_process)
    assert "edgecache_read_first_chunk_seconds_bucket" in exported.labels
    assert exported.labels["edgecache_cache_used_bytes"] == {"region", "node"}
    assert exported.labels["edgecache_controller_node_up"] == {"region", "node", "address"}
    assert exported.labels["edgecache_client_read_bytes_total"] == {"rank", "dataset", "endpoint"}


PROCESS_FAMILIES = {  # prometheus_client's ProcessCollector, on Linux
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_cpu_seconds",
    "process_open_fds",
    "process_max_fds",
}


def test_node_and_controller_processes_serve_no_created_series(exported: Exported) -> None:
    """A `_created` series per counter doubled the counters a scrape stores; the node's and
    the controller's processes are theirs alone, so they go (a training process, which may
    hold its own metrics too, keeps prometheus_client's default)."""
    assert exported.by_process["node"] and exported.by_process["controller"]
    assert not exported.created["node"] and not exported.created["controller"], exported.created


def test_the_node_serves_the_standard_process_metrics(exported: Exported) -> None:
    """Its memory bound is watched with process_resident_memory_bytes: a private registry
    had none of them."""
    assert {"process_resident_memory_bytes", "process_cpu_seconds"} <= exported.by_process["node"]


def test_metric_names_follow_prometheus_conventions(exported: Exported) -> None:
    for family, kind in exported.families.items():
        # Ours are edgecache_*; the node also serves prometheus_client's standard process_*.
        assert family.startswith("edgecache_") or family in PROCESS_FAMILIES, family
        if kind == "counter":
            assert f"{family}_total" in exported.labels, family
        else:
            assert not family.endswith("_total"), f"{family} is a {kind}, named like a counter"
        # Base units only: seconds and bytes, never milli-, kilo-, …
        assert not re.search(r"_(ms|milliseconds|minutes|hours|kb|mb|gb|kib|mib|gib)(_|$)", family)
        if kind == "histogram":
            assert re.search(r"_(seconds|bytes)$", family), f"{family}: histogram without a unit"


def test_every_alert_queries_exported_metrics_and_labels(exported: Exported) -> None:
    problems = []
    for rule in alert_rules():
        where = f"alert {rule['alert']}"
        problems += check_expression(where, rule["expr"], exported)
        assert list(selectors(rule["expr"])), f"{where} watches no edgecache metric"
        available = output_labels(rule["expr"], exported)
        for text in rule.get("annotations", {}).values():
            for label in set(re.findall(r"\$labels\.(\w+)", text)) - available:
                problems.append(f"{where}: annotation uses $labels.{label}, not in its result")
    assert not problems, "\n".join(problems)


def test_every_alert_is_a_runbook() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for rule in alert_rules():
        assert f"`{rule['alert']}`" in readme, (
            f"deploy/README.md's alert table lacks {rule['alert']}"
        )
        annotations = rule.get("annotations", {})
        assert annotations.get("summary"), rule["alert"]
        description = annotations.get("description", "")
        # What to do, naming a command, a metric or a file an operator can act on.
        assert "Do:" in description, f"{rule['alert']}: the description says what it means only"
        assert re.search(r"edgecache |kubectl|EDGECACHE_|edgecache_|docs/", description)
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), rule["alert"]


def test_every_dashboard_query_exists_on_live_metrics(exported: Exported) -> None:
    problems = []
    queried = 0
    for where, expr, legend in dashboard_targets():
        queried += 1
        problems += check_expression(where, expr, exported)
        if legend:
            for label in set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)):
                if label not in output_labels(expr, exported):
                    problems.append(f"{where}: legend {{{{{label}}}}} is not in {expr!r}")
    assert queried and not problems, "\n".join(problems)


def test_dashboard_variables_are_used_and_datasources_provisioned() -> None:
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    uids = {source["uid"] for source in provisioned["datasources"]}
    for path in DASHBOARDS:
        text = path.read_text()
        dashboard = json.loads(text)
        for variable in dashboard.get("templating", {}).get("list", []):
            uses = text.count(f"${variable['name']}") + text.count(f"${{{variable['name']}")
            assert uses, f"{path.name}: ${variable['name']} filters nothing"
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        # Panels ask the dashboard's Prometheus variable, so the dashboard imports into any
        # Grafana (pick its Prometheus); provisioned here, it defaults to ours.
        sources = {
            v["name"]: v for v in dashboard["templating"]["list"] if v["type"] == "datasource"
        }
        assert sources.get("datasource", {}).get("query") == "prometheus", path.name
        assert sources["datasource"]["current"]["value"] in uids, path.name
        for source in re.findall(r'"uid": "([^"]+)"', json.dumps(dashboard["panels"])):
            assert source == "${datasource}", f"{path.name}: datasource {source} is fixed"


def test_every_metric_the_docs_name_exists(exported: Exported) -> None:
    problems = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"\b(edgecache_[a-z0-9_]+)(\{[^}`]*\})?", text):
            name, labels = match.group(1), match.group(2)
            if name.endswith("_"):  # a prefix: edgecache_controller_*
                continue
            where = f"{path.relative_to(ROOT)}: {name}"
            sample = name if name in exported.labels else None
            if sample is None and exported.families.get(name) in ("histogram", "summary"):
                sample = (
                    f"{name}_bucket" if f"{name}_bucket" in exported.labels else f"{name}_count"
                )
            if sample is None:
                problems.append(f"{where} is not exported")
                continue
            for item in re.findall(r'(\w+)(?:="([^"]*)")?', (labels or "")[1:-1]):
                label, values = item
                if label not in exported.labels[sample]:
                    problems.append(f"{where} has no label {label!r}")
                for value in filter(None, values.replace("\\|", "|").split("|")):
                    if value not in exported.values.get((sample, label), set()):
                        problems.append(f'{where}{{{label}="{value}"}} is never exported')
    assert not problems, "\n".join(problems)


DOC_OF = {
    "node": ROOT / "docs" / "edge-node.md",
    "client": ROOT / "docs" / "dataset.md",
    "controller": ROOT / "docs" / "operations.md",
}


@pytest.mark.parametrize("process", ["node", "client", "controller"])
def test_every_exported_metric_is_documented_where_its_process_is(
    exported: Exported, process: str
) -> None:
    text = DOC_OF[process].read_text()
    missing = sorted(f for f in exported.by_process[process] if f not in text)
    assert not missing, f"{DOC_OF[process].relative_to(ROOT)} does not name {missing}"


def test_scrape_jobs_match_the_compose_and_kubernetes_ports() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    node_port = re.search(r"EDGECACHE_METRICS_LISTEN=\S+:(\d+)", dockerfile).group(1)
    for target in jobs["edgecache"]["static_configs"][0]["targets"]:
        host, port = target.rsplit(":", 1)
        assert host in compose and port == node_port, target
        listen = compose[host].get("environment", {}).get("EDGECACHE_METRICS_LISTEN")
        assert listen is None or listen.endswith(f":{port}"), (target, listen)
    (controller,) = jobs["edgecache-controller"]["static_configs"][0]["targets"]
    host, port = controller.rsplit(":", 1)
    command = compose[host]["command"]
    assert command[command.index("--metrics-listen") + 1].endswith(f":{port}")
    # Kubernetes: the annotation ports are the containers' metrics ports.
    for path in (
        DEPLOY / "k8s" / "base" / "statefulset.yaml",
        DEPLOY / "k8s" / "controller" / "deployment.yaml",
    ):
        pod = yaml.safe_load(path.read_text())["spec"]["template"]
        port = pod["metadata"]["annotations"]["prometheus.io/port"]
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == int(port), path
    assert "rule_files" in config and config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    mounts = compose["prometheus"]["volumes"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts


# ---------------------------------------------------------------- promtool


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("no promtool (Debian: apt-get install prometheus)")
    return exe


def test_promtool_checks_the_rules_and_the_config(tmp_path: Path) -> None:
    exe = promtool()
    out = subprocess.run([exe, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["rule_files"] = [str(ALERTS)]  # where compose mounts it
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([exe, "check", "config", str(path)], capture_output=True, text=True)
    if "field kubernetes_sd_configs not found" in out.stdout + out.stderr:
        # Debian builds promtool without Kubernetes service discovery: check the rest.
        config["scrape_configs"] = [
            job for job in config["scrape_configs"] if "kubernetes_sd_configs" not in job
        ]
        path.write_text(yaml.safe_dump(config))
        out = subprocess.run([exe, "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


NODE = 'region="eu-west", node="n1"'  # an edge node's labels
CTL = 'job="edgecache-controller", instance="controller:9091"'  # a scraped controller
STANDBY = 'job="edgecache-controller", instance="standby:9091"'


def series(name: str, labels: str, values: str) -> dict:
    return {"series": f"{name}{{{labels}}}" if labels else name, "values": values}


def fires(at: str, alert: str, severity: str, **labels: str) -> dict:
    expected = {"severity": severity, **labels}
    return {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": expected}]}


def quiet(at: str, alert: str) -> dict:
    return {"eval_time": at, "alertname": alert, "exp_alerts": []}


EU = {"region": "eu-west"}
N1 = {"region": "eu-west", "node": "n1"}
C1 = {"job": "edgecache-controller", "instance": "controller:9091"}
FIRST_CHUNK = "edgecache_read_first_chunk_seconds_bucket"
READS = "edgecache_reads_total"  # each ReadShard once, by how it ended
# promtool unit tests: each alert fires on series shaped like the live ones (the test checks
# their label names against /metrics), and stays quiet where it should. One step a minute.
ALERT_TESTS: list[dict] = [
    {
        "input_series": [
            series(FIRST_CHUNK, f'{NODE}, result="ok", le="5.0"', "0x30"),
            series(FIRST_CHUNK, f'{NODE}, result="ok", le="10.0"', "0+10x30"),
            series(FIRST_CHUNK, f'{NODE}, result="ok", le="+Inf"', "0+10x30"),
            series(
                "edgecache_client_data_wait_seconds_total",
                'rank="0", dataset="tokens@1"',
                "0+30x30",  # 30 s a minute: half the time
            ),
            series("edgecache_origin_retries_total", NODE, "0+10x30"),
            series("edgecache_origin_fetches_total", NODE, "0+10x30"),
            series("edgecache_cache_pinned_bytes", NODE, "95x40"),
            series("edgecache_cache_capacity_bytes", NODE, "100x40"),
            # Half the reads fail on the node's side (origin lost an object).
            series(READS, f'{NODE}, result="ok"', "0+10x30"),
            series(READS, f'{NODE}, result="FAILED_PRECONDITION"', "0+10x30"),
            series(
                "edgecache_controller_node_up",
                'region="eu-west", node="n1", address="n1:7070"',
                "0x30",
            ),
        ],
        "alert_rule_test": [
            fires("20m", "EdgecacheDataStall", "warning", **EU),
            fires("20m", "EdgecacheTrainingWaitsForData", "warning", rank="0", dataset="tokens@1"),
            fires("20m", "EdgecacheOriginErrors", "warning", **EU),
            fires("20m", "EdgecacheReadsFailing", "critical", **EU),
            quiet("20m", "EdgecacheCacheFull"),
            fires("35m", "EdgecacheCacheFull", "warning", **N1),
            fires(
                "5m",
                "EdgecacheNodeDown",
                "critical",
                region="eu-west",
                node="n1",
                address="n1:7070",
            ),
            # No controller scraped at all: nothing runs the schedule.
            fires("15m", "EdgecacheControllerStalled", "critical"),
        ],
    },
    {
        "input_series": [
            series("edgecache_controller_jobs_unready_at_start_total", "", "0 0 0 1 1 1"),
            series("edgecache_controller_tasks", 'state="late"', "1x10"),
            series("edgecache_controller_jobs_infeasible", "", "0 1x10"),  # from minute 1
            series("edgecache_staged_shards_total", f'{NODE}, result="failed"', "0 1 2 3"),
            series("edgecache_corrupt_chunks_total", NODE, "0 1 1 1"),
            # One refusal a second at max_streams from minute 2 on.
            series("edgecache_refused_calls_total", f'{NODE}, limit="max_streams"', "0 0 0+60x20"),
            series("edgecache_cache_disk_full", NODE, "0 0 1x10"),
            series("edgecache_controller_leader", CTL, "1x20"),
            series("edgecache_controller_last_tick_timestamp_seconds", CTL, "0+60x20"),
            series("edgecache_controller_ticks_total", CTL, "5x20"),  # no round succeeds
            series("edgecache_controller_tick_errors_total", CTL, "0+1x20"),
            series("edgecache_controller_schedule_valid", CTL, "0x20"),
            # A node failing the plan's evictions at every round from minute 2 on.
            series("edgecache_controller_evictions_failed_total", CTL, "0 0 0+1x30"),
            series("edgecache_controller_pin_failures_total", CTL, "0x32"),
        ],
        "alert_rule_test": [
            quiet("12m", "EdgecacheControllerNodeActionsFailing"),  # not yet 15 min of it
            fires("20m", "EdgecacheControllerNodeActionsFailing", "warning", **C1),
            fires("4m", "EdgecacheJobStartedWithoutData", "critical"),
            fires("6m", "EdgecacheStagingLate", "warning"),
            quiet("4m", "EdgecacheJobCannotBeMet"),  # not yet 5 min of it
            fires("7m", "EdgecacheJobCannotBeMet", "warning"),
            fires("3m", "EdgecacheStagingFailed", "warning", **EU),
            quiet("5m", "EdgecacheCacheDiskFull"),
            fires("8m", "EdgecacheCacheDiskFull", "critical", **N1),
            fires("3m", "EdgecacheCorruptChunks", "warning", **N1),
            quiet("11m", "EdgecacheNodeAtMaxStreams"),  # not yet 10 min of it
            fires("14m", "EdgecacheNodeAtMaxStreams", "warning", **N1),
            quiet("15m", "EdgecacheControllerStalled"),  # failing rounds still tick
            fires("16m", "EdgecacheControllerRoundsFailing", "critical", **C1),
            fires("6m", "EdgecacheScheduleInvalid", "warning", **C1),
        ],
    },
    {
        # A healthy node: reads its clients cancel or ask wrongly are no failing reads, and
        # an LRU cache at its capacity with little pinned is no full cache.
        "input_series": [
            series(READS, f'{NODE}, result="ok"', "0+10x30"),
            series(READS, f'{NODE}, result="CANCELLED"', "0+10x30"),
            series(READS, f'{NODE}, result="NOT_FOUND"', "0+10x30"),
            series("edgecache_cache_used_bytes", NODE, "100x40"),
            series("edgecache_cache_pinned_bytes", NODE, "40x40"),
            series("edgecache_cache_capacity_bytes", NODE, "100x40"),
            # A refusal now and then (a burst of readers starting): no alert.
            series("edgecache_refused_calls_total", f'{NODE}, limit="max_streams"', "0+3x40"),
        ],
        "alert_rule_test": [
            quiet("25m", "EdgecacheReadsFailing"),
            quiet("25m", "EdgecacheNodeAtMaxStreams"),
            quiet("35m", "EdgecacheCacheFull"),
        ],
    },
    {
        # A healthy leader beside a standby one (whose schedule gauge stays 0): all quiet.
        "input_series": [
            series("edgecache_controller_leader", CTL, "1x20"),
            series("edgecache_controller_leader", STANDBY, "0x20"),
            series("edgecache_controller_schedule_valid", STANDBY, "0x20"),
            series("edgecache_controller_schedule_valid", CTL, "1x20"),
            series("edgecache_controller_last_tick_timestamp_seconds", CTL, "0+60x20"),
            series("edgecache_controller_ticks_total", CTL, "0+1x20"),
            series("edgecache_controller_tick_errors_total", CTL, "0+1x20"),
            # Failures long ago (the counters hold, nothing new): no alert.
            series("edgecache_controller_evictions_failed_total", CTL, "3x30"),
            series("edgecache_controller_pin_failures_total", CTL, "2x30"),
        ],
        "alert_rule_test": [
            quiet("16m", "EdgecacheControllerStalled"),
            quiet("16m", "EdgecacheControllerRoundsFailing"),
            quiet("16m", "EdgecacheScheduleInvalid"),
            quiet("25m", "EdgecacheControllerNodeActionsFailing"),
        ],
    },
]


def test_alert_unit_tests_use_live_label_sets(exported: Exported) -> None:
    covered = set()
    for case in ALERT_TESTS:
        for series in case["input_series"]:
            name, labels = re.match(r"(\w+)(?:\{(.*)\})?$", series["series"]).groups()
            given = set(re.findall(r"(\w+)=", labels or ""))
            live = exported.labels.get(name)
            assert live is not None, f"{name} is not exported"
            assert given - TARGET_LABELS == live, (name, given, live)
        covered |= {test["alertname"] for test in case["alert_rule_test"] if test["exp_alerts"]}
    assert covered == {rule["alert"] for rule in alert_rules()}, "an alert that never fires"


def test_every_alert_fires_when_it_should_promtool(tmp_path: Path) -> None:
    exe = promtool()
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # the unit tests compare labels; annotations are prose
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    tests = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m"}
    tests["tests"] = [{"interval": "1m", **case} for case in ALERT_TESTS]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run(
        [exe, "test", "rules", "tests.yml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
