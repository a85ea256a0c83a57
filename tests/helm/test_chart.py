"""The chart as rendered by the real helm: lint, the manifests it produces, the values schema,
and the CRD it ships. No cluster is needed."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

import preshard
from preshard.controller import metrics
from preshard.settings import ENV_PREFIX, Settings
from tests.support.chart import (
    CHART,
    CHART_CRD,
    CRD_NAME,
    CRD_SOURCE,
    KUBE_VERSION,
    Manifest,
    container_env,
    of_kind,
    one,
    operator_container,
    rules_of,
    template,
    template_error,
)
from tests.support.tools import Tool

CUSTOM_VALUES: Final = Path(__file__).parent / "values" / "custom.yaml"
DASHBOARD: Final = CHART / "dashboards" / "preshard.json"
METRICS_PORT: Final = 9090
METRIC: Final = re.compile(r"\bpreshard_[a-z0-9_]+")
CRD_TEMPLATE: Final = "templates/crds.yaml"
KEEP_ANNOTATION: Final = "  annotations:\n    helm.sh/resource-policy: keep\n"

# What the operator may do, rule by rule; a change here is a change of the security contract
# documented in docs/install.md.
OPERATOR_RULES: Final = [
    (("preshard.dev",), ("shardedmodels",), ("get", "list", "watch", "patch")),
    (("preshard.dev",), ("shardedmodels/status",), ("patch",)),
    (("preshard.dev",), ("shardedmodels/finalizers",), ("update",)),
    (("batch",), ("jobs",), ("get", "list", "watch", "create", "delete")),
    (("",), ("pods",), ("get", "list", "watch")),
    (("",), ("pods/log",), ("get",)),
    (("apps",), ("deployments",), ("get", "list", "watch", "patch")),
    (("",), ("events",), ("create", "patch")),
    (("events.k8s.io",), ("events",), ("create", "patch")),
]


@pytest.fixture(scope="module")
def defaults(helm: Tool) -> list[Manifest]:
    """The chart rendered with its default values."""
    return template(helm)


@pytest.fixture(scope="module")
def namespaced(helm: Tool) -> list[Manifest]:
    """The chart rendered to watch two namespaces."""
    return template(helm, "--set", "watchNamespaces={team-a,team-b}")


@pytest.fixture(scope="module")
def custom(helm: Tool) -> list[Manifest]:
    """The chart rendered with every value changed."""
    return template(helm, "--values", str(CUSTOM_VALUES))


def crd_document(helm: Tool, *args: str) -> str:
    """The text helm renders for the CRD template, without the `# Source:` header."""
    output = helm.run(
        "template",
        "preshard",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--show-only",
        CRD_TEMPLATE,
        *args,
    ).stdout
    header = f"---\n# Source: preshard/{CRD_TEMPLATE}\n"
    assert output.startswith(header), output[:200]
    return output[len(header) :]


# Lint and metadata.


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["defaults", "custom"])
def test_lint_passes_in_strict_mode(helm: Tool, values: Path | None) -> None:
    args = ["--values", str(values)] if values else []
    result = helm.run("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *args)
    assert "0 chart(s) failed" in result.stdout


def test_chart_metadata_matches_the_operator() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == preshard.__version__
    assert chart["kubeVersion"] == ">=1.31.0-0"
    assert chart["maintainers"] == [{"name": "preshard maintainers"}]


def test_defaults_render_the_operator_and_nothing_more(defaults: list[Manifest]) -> None:
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in defaults)
    assert kinds == [
        ("ClusterRole", "preshard"),
        ("ClusterRole", "preshard-edit"),
        ("ClusterRole", "preshard-view"),
        ("ClusterRoleBinding", "preshard"),
        ("CustomResourceDefinition", CRD_NAME),
        ("Deployment", "preshard"),
        ("Service", "preshard-metrics"),
        ("ServiceAccount", "preshard"),
    ]


def test_names_and_labels_are_truncated_to_63_characters(helm: Tool) -> None:
    release, name = "r" * 53, "n" * 20
    manifests = template(
        helm,
        "--set",
        f"nameOverride={name}",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.dashboard.enabled=true",
        release=release,
    )
    fullname = f"{release}-{name}"[:63]
    # A Service's name is a DNS label.
    for kind in ("Service", "ServiceMonitor", "ConfigMap"):
        assert len(one(manifests, kind)["metadata"]["name"]) <= 63, kind
    assert one(manifests, "Deployment")["metadata"]["name"] == fullname
    assert one(manifests, "ServiceAccount")["metadata"]["name"] == fullname
    assert one(manifests, "Service")["metadata"]["name"] == f"{fullname[:55]}-metrics"
    for manifest in manifests:
        assert all(len(value) <= 63 for value in manifest["metadata"]["labels"].values())


# The operator Deployment.


def test_deployment_runs_one_hardened_operator(defaults: list[Manifest]) -> None:
    deployment = one(defaults, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "preshard"
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = operator_container(deployment)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["image"] == f"ghcr.io/preshard/preshard:{preshard.__version__}"
    assert container["command"] == ["preshard"]
    assert container["args"] == ["run", "--liveness=http://0.0.0.0:8080/healthz"]
    assert container["ports"] == [
        {"name": "healthz", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    assert container["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "healthz"},
        "initialDelaySeconds": 10,
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "384Mi"},
    }
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]


def test_default_settings_are_the_operators_defaults(defaults: list[Manifest]) -> None:
    env = container_env(operator_container(one(defaults, "Deployment")))
    assert all(name.startswith(ENV_PREFIX) for name in env)
    # But for the metrics port: the chart serves metrics, a bare `preshard run` does not.
    assert Settings.from_env(env) == dataclasses.replace(Settings(), metrics_port=METRICS_PORT)


def test_every_setting_is_configurable(custom: list[Manifest]) -> None:
    env = container_env(operator_container(one(custom, "Deployment")))
    settings = {f.name for f in dataclasses.fields(Settings)}
    assert {f"{ENV_PREFIX}{name.upper()}" for name in settings} == set(env)
    assert Settings.from_env(env) == Settings(
        serializer_image="registry.example.com:5000/mirror/preshard-serializer:0.1.0-cu128",
        tools_image=(
            "registry.example.com:5000/mirror/preshard@sha256:"
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
        ),
        image_pull_policy="Always",
        gpu_resource_name="amd.com/gpu",
        max_gpus_per_job=4,
        scratch_size="500Gi",
        num_readers=16,
        model_dir="/models/config",
        tensorizer_dir="/models/tensorizer",
        namespaces=("team-a", "team-b"),
        cleanup_timeout_seconds=0,
        retry_backoff_seconds=5,
        retry_backoff_max_seconds=60,
        log_format="json",
        metrics_port=9102,
        progress_seconds=5,
    )


def test_custom_values_reach_the_pod(custom: list[Manifest]) -> None:
    deployment = one(custom, "Deployment")
    assert deployment["metadata"]["name"] == "model-sharder"
    template_meta = deployment["spec"]["template"]["metadata"]
    assert template_meta["annotations"] == {"example.com/team": "inference"}
    assert template_meta["labels"]["example.com/cost-center"] == "ml"
    assert template_meta["labels"]["app.kubernetes.io/name"] == "shards"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing-operator"
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    # Helm merges maps with the defaults.
    assert pod["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "node-role.kubernetes.io/control-plane": "",
    }
    assert pod["tolerations"][0]["key"] == "node-role.kubernetes.io/control-plane"
    assert "nodeAffinity" in pod["affinity"]
    # The platform picks the user; the hardening stays.
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = operator_container(deployment)
    assert container["ports"][1] == {"name": "metrics", "containerPort": 9102, "protocol": "TCP"}
    assert container["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert container["imagePullPolicy"] == "Always"
    assert container["args"] == ["run", "--liveness=http://0.0.0.0:8080/healthz", "--verbose"]
    assert "livenessProbe" not in container
    assert container["resources"] == {
        "requests": {"cpu": "200m", "memory": "300Mi"},
        "limits": {"memory": "300Mi"},
    }
    # With an existing ServiceAccount and the CRD managed elsewhere, the chart makes neither.
    assert not of_kind(custom, "ServiceAccount")
    assert not of_kind(custom, "CustomResourceDefinition")


# RBAC.


def test_cluster_wide_rbac_grants_exactly_the_operators_rules(defaults: list[Manifest]) -> None:
    roles = {m["metadata"]["name"]: m for m in of_kind(defaults, "ClusterRole")}
    assert rules_of(roles["preshard"]) == OPERATOR_RULES
    binding = one(defaults, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "preshard",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "preshard", "namespace": "preshard-system"}
    ]
    assert not of_kind(defaults, "Role")
    assert not of_kind(defaults, "RoleBinding")


def test_namespaced_rbac_grants_the_same_rules_in_each_watched_namespace(
    namespaced: list[Manifest],
) -> None:
    roles = of_kind(namespaced, "Role")
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a", "team-b"]
    assert all(rules_of(role) == OPERATOR_RULES for role in roles)
    bindings = of_kind(namespaced, "RoleBinding")
    assert [b["metadata"]["namespace"] for b in bindings] == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "preshard", "namespace": "preshard-system"}
        ]
    operator_roles = [
        m for m in of_kind(namespaced, "ClusterRole") if m["metadata"]["name"] == "preshard"
    ]
    assert not operator_roles
    assert not of_kind(namespaced, "ClusterRoleBinding")
    env = container_env(operator_container(one(namespaced, "Deployment")))
    assert env["PRESHARD_NAMESPACES"] == "team-a,team-b"


@pytest.mark.parametrize("rendering", ["defaults", "namespaced", "custom"])
def test_no_rule_reaches_secrets_or_uses_wildcards(
    rendering: str, request: pytest.FixtureRequest
) -> None:
    manifests: list[Manifest] = request.getfixturevalue(rendering)
    roles = of_kind(manifests, "ClusterRole") + of_kind(manifests, "Role")
    assert roles
    for role in roles:
        for groups, resources, verbs in rules_of(role):
            assert "*" not in groups + resources + verbs, role["metadata"]["name"]
            assert not any(r.split("/")[0] == "secrets" for r in resources)
            assert "escalate" not in verbs
            assert "bind" not in verbs
            assert "impersonate" not in verbs


def test_aggregated_roles_let_namespace_users_manage_sharded_models(
    defaults: list[Manifest],
) -> None:
    roles = {m["metadata"]["name"]: m for m in of_kind(defaults, "ClusterRole")}
    view, edit = roles["preshard-view"], roles["preshard-edit"]
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert rules_of(view) == [
        (("preshard.dev",), ("shardedmodels", "shardedmodels/status"), ("get", "list", "watch"))
    ]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-view" not in edit["metadata"]["labels"]
    assert rules_of(edit) == [
        (
            ("preshard.dev",),
            ("shardedmodels",),
            ("create", "update", "patch", "delete", "deletecollection"),
        )
    ]


def test_rbac_can_be_left_to_the_cluster_admin(helm: Tool) -> None:
    manifests = template(helm, "--set", "rbac.create=false")
    kinds = {m["kind"] for m in manifests}
    assert kinds.isdisjoint({"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})


# The CRD.


def test_chart_ships_the_generated_crd_byte_for_byte() -> None:
    assert CHART_CRD.read_bytes() == CRD_SOURCE.read_bytes(), (
        "the chart's CRD differs from crds/: run `make crds`"
    )


def test_chart_has_no_crds_directory() -> None:
    # Helm would install a CRD found there once, never upgrade it, and clash with the template.
    assert not (CHART / "crds").exists()


def test_rendered_crd_is_the_generated_file(helm: Tool) -> None:
    assert crd_document(helm, "--set", "crds.keep=false") == CRD_SOURCE.read_text()


def test_kept_crd_differs_only_by_the_resource_policy(helm: Tool) -> None:
    rendered = crd_document(helm)
    assert rendered.replace(KEEP_ANNOTATION, "", 1) == CRD_SOURCE.read_text()
    parsed = yaml.safe_load(rendered)
    source = yaml.safe_load(CRD_SOURCE.read_text())
    assert parsed["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert parsed == source


def test_crd_can_be_left_out(helm: Tool) -> None:
    manifests = template(helm, "--set", "crds.enabled=false")
    assert not of_kind(manifests, "CustomResourceDefinition")


# values.yaml and its schema.


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set-string", "config.numReaders=8"], "at '/config/numReaders': got string, want"),
        (["--set", "crds.keep=maybe"], "at '/crds/keep': got string, want boolean"),
        (["--set", "replicaCount=2"], "additional properties 'replicaCount' not allowed"),
        (["--set", "config.numReaderz=8"], "additional properties 'numReaderz' not allowed"),
        (["--set", "config.logFormat=xml"], "at '/config/logFormat': value must be one of"),
        (["--set", "image.pullPolicy=Sometimes"], "at '/image/pullPolicy': value must be one of"),
        (["--set", "config.maxGpusPerJob=0"], "at '/config/maxGpusPerJob': minimum: got 0"),
        (["--set", "securityContext.runAsUser=0"], "at '/securityContext/runAsUser': minimum"),
        (["--set", "config.scratchSize=lots"], "at '/config/scratchSize': 'lots' does not match"),
        (["--set", "watchNamespaces={Team_A}"], "at '/watchNamespaces/0': 'Team_A' does not match"),
        (["--set", "image.digest=latest"], "at '/image/digest': 'latest' does not match"),
        (["--set", "config.numReaders=null"], "at '/config': missing property 'numReaders'"),
        (["--set", "metrics.port=8080"], "at '/metrics/port': 'not' failed"),
        (["--set", "metrics.port=0"], "at '/metrics/port': minimum: got 0"),
        (["--set-string", "metrics.enabled=yes"], "at '/metrics/enabled': got string, want"),
        (
            ["--set", "metrics.serviceMonitor.interval=soon"],
            "at '/metrics/serviceMonitor/interval': 'soon' does not match",
        ),
        (
            ["--set", "metrics.serviceMonitor.scrapeTimeout=10"],
            "at '/metrics/serviceMonitor/scrapeTimeout'",
        ),
        (["--set", "metrics.path=/m"], "additional properties 'path' not allowed"),
        (
            ["--set", "metrics.serviceMonitor.labels=null"],
            "at '/metrics/serviceMonitor': missing property 'labels'",
        ),
    ],
    ids=[
        "string-for-number",
        "string-for-boolean",
        "unknown-key",
        "unknown-nested-key",
        "log-format-enum",
        "pull-policy-enum",
        "gpus-minimum",
        "root-user",
        "quantity-pattern",
        "namespace-pattern",
        "digest-pattern",
        "setting-removed",
        "metrics-on-the-liveness-port",
        "metrics-port-zero",
        "metrics-enabled-string",
        "interval-pattern",
        "scrape-timeout-without-unit",
        "unknown-metrics-key",
        "service-monitor-labels-removed",
    ],
)
def test_schema_rejects_bad_values(helm: Tool, args: list[str], expected: str) -> None:
    error = template_error(helm, *args)
    assert "values don't meet the specifications of the schema" in error
    assert expected in error


# Metrics.


def test_a_cluster_ip_service_fronts_the_metrics_port(defaults: list[Manifest]) -> None:
    service, deployment = one(defaults, "Service"), one(defaults, "Deployment")
    assert service["metadata"]["namespace"] == "preshard-system"
    assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "metrics"
    assert "annotations" not in service["metadata"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    env = container_env(operator_container(deployment))
    assert Settings.from_env(env).metrics_port == METRICS_PORT
    assert not of_kind(defaults, "ServiceMonitor")
    assert not of_kind(defaults, "ConfigMap")


def test_metrics_can_be_turned_off(helm: Tool) -> None:
    manifests = template(helm, "--set", "metrics.enabled=false")
    assert not of_kind(manifests, "Service")
    container = operator_container(one(manifests, "Deployment"))
    assert [port["name"] for port in container["ports"]] == ["healthz"]
    env = container_env(container)
    assert env["PRESHARD_METRICS_PORT"] == "0"
    assert Settings.from_env(env).metrics_port == 0


def test_the_service_monitor_scrapes_the_metrics_service_only(custom: list[Manifest]) -> None:
    monitor, service = one(custom, "ServiceMonitor"), one(custom, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == "model-sharder"
    assert monitor["metadata"]["namespace"] == "preshard-system"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    pod_labels = one(custom, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= pod_labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["preshard-system"]}
    assert monitor["spec"]["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "interval": "1m",
            "scrapeTimeout": "20s",
            "honorLabels": True,
        }
    ]
    assert service["metadata"]["name"] == "model-sharder-metrics"
    assert service["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    assert service["spec"]["ports"][0]["port"] == 9102


def test_the_service_monitor_leaves_the_scrape_timeout_to_prometheus(helm: Tool) -> None:
    manifests = template(helm, "--set", "metrics.serviceMonitor.enabled=true")
    monitor = one(manifests, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "honorLabels": True}
    ]
    assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == "preshard"


def test_a_service_monitor_needs_metrics(helm: Tool) -> None:
    error = template_error(
        helm, "--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true"
    )
    assert "metrics.serviceMonitor.enabled needs metrics.enabled" in error


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets and variable queries."""
    panels = list(dashboard["panels"])
    panels += [nested for p in dashboard["panels"] for nested in p.get("panels", [])]
    queries = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    queries += [
        variable["definition"]
        for variable in dashboard["templating"]["list"]
        if variable["type"] == "query"
    ]
    return queries


def test_the_dashboard_shows_only_and_every_metric_the_operator_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = metrics.Metrics().sample_names()
    used = {name for query in dashboard_queries(dashboard) for name in METRIC.findall(query)}
    assert used, "the dashboard queries no preshard metric"
    assert used <= exported, f"not exported by the operator: {sorted(used - exported)}"
    families = {
        metrics.RECONCILE_PASSES,
        metrics.RECONCILE_DURATION,
        metrics.RECONCILE_ERRORS,
        metrics.SHARD_SETS,
        metrics.JOBS_STARTED,
        metrics.JOBS_FAILED,
        metrics.DEPLOYMENT_PATCHES,
        metrics.VERIFICATIONS,
        metrics.TIME_TO_READY,
        metrics.DATAPLANE_BYTES,
        metrics.DATAPLANE_DURATION,
        metrics.DATAPLANE_THROUGHPUT,
    }
    unshown = sorted(f for f in families if not any(name.startswith(f) for name in used))
    assert not unshown, f"metrics the dashboard does not show: {unshown}"


def test_the_dashboard_is_a_grafana_dashboard_on_a_chosen_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "preshard-operator"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_the_dashboard_ships_as_a_config_map_for_the_grafana_sidecar(
    custom: list[Manifest],
) -> None:
    config_map = one(custom, "ConfigMap")
    assert config_map["metadata"]["name"] == "model-sharder-dashboard"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Inference"}
    assert json.loads(config_map["data"]["preshard.json"]) == json.loads(DASHBOARD.read_text())


def test_existing_service_account_must_be_named(helm: Tool) -> None:
    error = template_error(helm, "--set", "serviceAccount.create=false")
    assert "serviceAccount.name is required when serviceAccount.create is false" in error


def _schema_paths(schema: dict[str, Any], root: dict[str, Any], prefix: str = "") -> set[str]:
    if "$ref" in schema:
        schema = root["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    paths: set[str] = set()
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        paths |= {path} | _schema_paths(sub, root, path + ".")
    return paths


def _values_keys() -> dict[str, bool]:
    """Each key path in values.yaml, and whether a comment line sits right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    keys: dict[str, bool] = {}
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9_-]*):", line)
        if match is None:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        path = ".".join(key for _, key in stack)
        keys[path] = number > 0 and lines[number - 1].strip().startswith("#")
    return keys


def test_every_value_is_declared_in_the_schema_and_commented() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    declared = _schema_paths(schema, schema)
    keys = _values_keys()
    chart_keys = {path: commented for path, commented in keys.items() if path in declared}
    top_level = {path for path in keys if "." not in path}
    assert top_level <= declared
    assert top_level | {"global"} == {path for path in declared if "." not in path}
    uncommented = sorted(path for path, commented in chart_keys.items() if not commented)
    assert not uncommented, f"values.yaml keys without a comment: {uncommented}"


def test_values_file_is_valid_against_its_own_schema(helm: Tool) -> None:
    # Every value passed explicitly, as a user copying values.yaml would.
    manifests = template(helm, "--values", str(CHART / "values.yaml"))
    assert one(manifests, "Deployment")
