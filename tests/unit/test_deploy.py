"""deploy/: every file parses, and every command line in it is one the real CLI accepts.

Command lines (`governor serve ...`, `worker serve ...`) go through the real argparse parsers and
the config dataclasses' validation, so a renamed flag, a bad value or a forbidden combination
fails here. Ports and addresses used by probes, annotations, scrape targets and health checks
must equal the ones those command lines configure. Which metrics the queries name is checked
against a live governor in tests/integration/test_deploy_live.py.
"""

from __future__ import annotations

import argparse
import configparser
import copy
import dataclasses
import json
import math
import re
import shlex
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from governor.shell.cli import build_parser as governor_parser
from governor.shell.config import GovernorConfig
from governor.shell.config_file import load_config
from govwire.options import ConfigError, given
from worker.cli import build_parser as worker_parser
from worker.config import WorkerConfig
from worker.errors import StartupError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
TOKEN_FLAGS = ("auth_token_file", "worker_auth_token_file")
SANDBOXING = {
    "DynamicUser": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "SystemCallFilter": "@system-service",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictNamespaces": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
}


# --- command lines through the real CLI ------------------------------------------------------


class Parsed:
    """A command line as the CLI sees it: the config it yields and the secret files it names."""

    def __init__(self, config: Any, token_files: dict[str, str]) -> None:
        self.config = config
        self.token_files = token_files  # flag field -> path as written in the deploy file


def _flag_names(cls: type) -> set[str]:
    """The flags govwire.options generates for a config dataclass, spelled out in full."""
    names = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls) if "help" in f.metadata}
    return names | {"--no-" + n[2:] for n in names}


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str], cls: type) -> argparse.Namespace:
    # argparse accepts unambiguous prefixes (--drain-timeout for --drain-timeout-s); a deploy file
    # should not rely on a prefix staying unambiguous as flags are added.
    for arg in argv:
        flag = arg.partition("=")[0]
        assert not flag.startswith("--") or flag in _flag_names(cls), f"{flag} is not a {cls.__name__} flag"
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse printed why to stderr, which pytest shows
        pytest.fail(f"the CLI rejects {list(argv)} (exit {exc.code})")
    except StartupError as exc:  # the worker's parser raises what argparse would print
        pytest.fail(f"the CLI rejects {list(argv)}: {exc}")


def _with_readable_secrets(values: dict[str, Any], secret: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The secret files exist only where the deploy file runs; validate against a stand-in."""
    named = {name: values[name] for name in TOKEN_FLAGS if values.get(name)}
    return {**values, **dict.fromkeys(named, str(secret))}, named


def parse_governor(argv: Sequence[str], secret: Path) -> Parsed:
    """`argv` after the `governor` program name, split at `--` as governor.shell.cli.main does."""
    args, worker_args = list(argv), []
    if "--" in args:
        cut = args.index("--")
        args, worker_args = args[:cut], args[cut + 1 :]
    namespace = _parse(governor_parser(), args, GovernorConfig)
    assert namespace.command == "serve", argv
    values, named = _with_readable_secrets(given(GovernorConfig, namespace), secret)
    config = load_config(values, tuple(worker_args))
    if worker_args:  # what the spawned worker will be given (plus the governor's own --listen)
        parse_worker(["serve", *worker_args], secret)
    return Parsed(config, named)


def parse_worker(argv: Sequence[str], secret: Path) -> Parsed:
    namespace = _parse(worker_parser(), argv, WorkerConfig)
    values, named = _with_readable_secrets(given(WorkerConfig, namespace), secret)
    return Parsed(WorkerConfig(**values), named)


def parse_command(argv: Sequence[str], secret: Path) -> tuple[str, Parsed]:
    """A whole command line whose program is `governor` or `worker` (any path to them)."""
    program = Path(argv[0]).name
    if program == "governor":
        return program, parse_governor(argv[1:], secret)
    if program == "worker":
        return program, parse_worker(argv[1:], secret)
    raise AssertionError(f"not a governor or worker command line: {argv}")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("a-test-token-of-reasonable-length\n")
    return path


def test_the_checker_rejects_unknown_flags_and_invalid_values(secret: Path) -> None:
    # Guards the guard: a checker that accepted everything would make every test below vacuous.
    with pytest.raises(AssertionError, match="--no-such-flag"):
        parse_governor(["serve", "--no-such-flag"], secret)
    with pytest.raises(AssertionError, match="--drain-timeout "):
        parse_governor(["serve", "--drain-timeout", "5"], secret)
    with pytest.raises(pytest.fail.Exception):
        parse_governor(["serve", "--integrity", "sometimes"], secret)
    with pytest.raises(ValueError, match="--worker-auth-token-file"):
        parse_governor(["serve", "--worker-auth-token-file", "/x"], secret)
    with pytest.raises(pytest.fail.Exception):
        parse_worker(["serve", "--device", "tpu"], secret)


# --- every file is covered ---------------------------------------------------------------------


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def test_every_deploy_file_has_a_parser_and_the_readme_lists_it() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in deploy_files():
        rel = path.relative_to(DEPLOY).as_posix()
        assert path.name in ("README.md",) or f"`{rel}`" in readme, f"deploy/README.md does not list {rel}"
        kind = _kind(path)
        assert kind is not None, f"no test parses deploy/{rel}; add it to _kind()"


def _kind(path: Path) -> str | None:
    name = path.name
    if name.startswith("Dockerfile"):
        return "dockerignore" if name.endswith(".dockerignore") else "dockerfile"
    return {
        ".yaml": "yaml",
        ".yml": "yaml",
        ".json": "json",
        ".service": "systemd",
        ".conf": "systemd",
        ".md": "markdown",
        ".toml": "config",
    }.get(path.suffix)


def test_the_example_config_loads_as_written_and_with_its_tables_uncommented(tmp_path: Path, secret: Path) -> None:
    example = DEPLOY / "config" / "governor.toml"
    config = load_config({"config": str(example)}, environ={})
    assert (config.max_inflight, config.http_port, config.promise_horizon_ms) == (32, 8080, 1000.0)
    # Its commented-out tables and the token file, as a user would uncomment them.
    lines = []
    for line in example.read_text().splitlines():
        body = line.removeprefix("# ")
        if line.startswith("# ") and (body.startswith("[[") or re.match(r"[a-z_]+ = ", body)):
            line = body.replace("/run/secrets/governor-tokens", str(secret)).split("   #", 1)[0]
        lines.append(line)
    uncommented = tmp_path / "governor.toml"
    uncommented.write_text("\n".join(lines) + "\n")
    full = load_config({"config": str(uncommented)}, environ={})
    assert full.worker and full.worker[0].startswith("http://127.0.0.1:8000/v1") and full.tenant
    assert full.auth_token_file == str(secret)


def test_every_yaml_and_json_file_parses() -> None:
    for path in deploy_files():
        if _kind(path) == "yaml":
            assert [doc for doc in yaml.safe_load_all(path.read_text()) if doc], path
        elif _kind(path) == "json":
            json.loads(path.read_text())


# --- Dockerfiles ---------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path} ends in a continuation line"
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_runs_a_valid_governor_as_non_root_with_a_health_check(name: str, secret: Path) -> None:
    path = DEPLOY / name
    instructions = dockerfile_instructions(path)
    by_kind: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_kind.setdefault(keyword, []).append(rest)

    assert instructions[0][0] == "FROM"
    expected_base = "python:3.11-slim" if name == "Dockerfile" else "pytorch/pytorch:"
    assert by_kind["FROM"][0].startswith(expected_base)
    runs = " && ".join(by_kind["RUN"])
    install = "pip install '.[worker]'"  # the worker's extra: torch and transformers
    if name == "Dockerfile":  # torch from the CPU index, before the project pulls in the CUDA wheels
        assert runs.index("--index-url https://download.pytorch.org/whl/cpu") < runs.index(install)
    assert install in runs
    copied = {rest.split()[0] for keyword, rest in instructions if keyword == "COPY"}
    packages = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    wanted = {pattern.rstrip("*") for pattern in packages["find"]["include"]}
    assert wanted <= copied, f"{name} does not copy {wanted - copied}, which `pip install .` needs"

    user = by_kind["USER"][-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "USER must be numeric and not root (runAsNonRoot)"
    assert instructions.index(("USER", by_kind["USER"][-1])) > max(
        i for i, (k, _) in enumerate(instructions) if k == "RUN"
    ), "the last USER must come after every RUN"

    cmd = json.loads(by_kind["CMD"][-1])  # exec form: no shell between the signal and the governor
    _, parsed = parse_command(cmd, secret)
    config = parsed.config
    assert config.host == "0.0.0.0" and parsed.token_files.get("auth_token_file"), (
        "a non-loopback bind needs --auth-token-file"
    )
    assert {int(p) for p in by_kind["EXPOSE"][0].split()} == {config.port, config.metrics_port}

    (healthcheck,) = by_kind["HEALTHCHECK"]
    options, _, check = healthcheck.partition("CMD ")
    assert re.search(r"--start-period=\d+s", options)
    check_argv = json.loads(check)
    assert check_argv[:2] == ["python", "-c"]
    compile(check_argv[2], "<healthcheck>", "exec")
    assert f"http://127.0.0.1:{config.metrics_port}/healthz" in check_argv[2]


@pytest.mark.parametrize("name", ["Dockerfile.dockerignore", "Dockerfile.cuda.dockerignore"])
def test_dockerignore_sends_what_the_dockerfile_copies_and_no_venv(name: str) -> None:
    patterns = [p for p in (DEPLOY / name).read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[0] == "*", "allow-list: exclude everything first"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    dockerfile = DEPLOY / name.removesuffix(".dockerignore")
    copied = {
        src.rstrip("/")
        for keyword, rest in dockerfile_instructions(dockerfile)
        if keyword == "COPY"
        for src in rest.split()[:-1]
    }
    assert copied <= allowed, f"{dockerfile.name} copies {copied - allowed}, which {name} excludes"
    assert ".venv" not in allowed


# --- Kubernetes ----------------------------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"]) if "metadata" in doc else (doc["kind"], path.name)
                assert key not in objects, f"{key} defined twice"
                objects[key] = doc
    return objects


def the(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for (k, _), o in objects.items() if k == kind]
    return obj


def test_k8s_objects_have_the_expected_kinds_and_api_versions() -> None:
    kinds = {(o["apiVersion"], k) for (k, _), o in k8s_objects().items()}
    assert kinds == {
        ("v1", "Secret"),
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"),
        ("policy/v1", "PodDisruptionBudget"),
        ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
    }


def test_the_disruption_budget_covers_the_pods_and_never_blocks_a_drain() -> None:
    objects = k8s_objects()
    budget, deployment = the(objects, "PodDisruptionBudget"), the(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # minAvailable 1 with the HPA's minimum of one replica would make every node drain wait for ever.
    assert "minAvailable" not in budget["spec"] and budget["spec"]["maxUnavailable"] == 1


def test_kustomization_lists_existing_files() -> None:
    kustomization = the(k8s_objects(), "Kustomization")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


def _containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def _secret_key_at(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """The (Secret name, key) a file path inside the container comes from."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            secret = volumes[mount["name"]]["secret"]
            relative = path[len(prefix) :]
            keys = {item["path"]: item["key"] for item in secret.get("items", [])} or {relative: relative}
            return secret["secretName"], keys[relative]
    raise AssertionError(f"{container['name']}: nothing mounted at {path}")


def test_k8s_deployment_wires_app_governor_and_gpu_worker_together(secret: Path) -> None:
    objects = k8s_objects()
    deployment = the(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    containers = _containers(deployment)
    governor_c, worker_c, app_c = containers["governor"], containers["worker"], containers["app"]

    program, gov = parse_command(governor_c["command"] + governor_c.get("args", []), secret)
    assert program == "governor"
    program, wrk = parse_command(worker_c["command"] + worker_c.get("args", []), secret)
    assert program == "worker"
    g: GovernorConfig = gov.config
    w: WorkerConfig = wrk.config

    # The governor connects to the worker beside it, with the worker's own secret.
    assert g.worker == (w.listen,) and w.listen.startswith("127.0.0.1:")
    worker_secret = _secret_key_at(pod, governor_c, gov.token_files["worker_auth_token_file"])
    assert worker_secret == _secret_key_at(pod, worker_c, wrk.token_files["auth_token_file"])
    assert worker_c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in governor_c.get("resources", {}).get("limits", {})

    # The app reaches the governor on localhost (as its comment says) with the client secret the
    # governor demands, mounted where the comment says. No environment variable claims a setting
    # nothing reads.
    assert f"127.0.0.1:{g.port}" in (DEPLOY / "k8s" / "deployment.yaml").read_text()
    assert not [e for e in app_c.get("env", []) if e["name"].startswith("GOVERNOR_")]
    client_secret = _secret_key_at(pod, governor_c, gov.token_files["auth_token_file"])
    assert client_secret == _secret_key_at(pod, app_c, "/etc/governor/client/client-token")
    assert (g.metrics_host or g.host) == "0.0.0.0", "probes and scrapes come from outside the pod's loopback"
    assert g.host == "127.0.0.1", "only the app in the pod talks NDJSON"
    secret_obj = the(objects, "Secret")
    assert {client_secret[1], worker_secret[1]} <= set(secret_obj["stringData"])
    assert client_secret[0] == worker_secret[0] == secret_obj["metadata"]["name"]

    # Probes and scrape annotations point at the governor's metrics endpoint.
    assert governor_c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": g.metrics_port}
    assert governor_c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": g.metrics_port}
    ports = {p["name"]: p["containerPort"] for p in governor_c["ports"]}
    assert ports == {"ndjson": g.port, "metrics": g.metrics_port}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(g.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"

    # Shutdown: the grace period covers the drain, and the worker outlives the governor's drain.
    assert pod["terminationGracePeriodSeconds"] > g.drain_timeout_s + 5
    hook = "\n".join(worker_c["lifecycle"]["preStop"]["exec"]["command"])
    assert f"http://127.0.0.1:{g.metrics_port}/healthz" in hook
    compile(worker_c["lifecycle"]["preStop"]["exec"]["command"][-1], "<preStop>", "exec")

    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in containers.values():
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_k8s_metrics_service_monitor_and_network_policy_reach_the_metrics_port(secret: Path) -> None:
    objects = k8s_objects()
    deployment = the(objects, "Deployment")
    governor_c = _containers(deployment)["governor"]
    g: GovernorConfig = parse_command(governor_c["command"], secret)[1].config
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    service = the(objects, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    container_ports = {p["name"]: p["containerPort"] for p in governor_c["ports"]}
    assert container_ports[port["targetPort"]] == g.metrics_port

    monitor = the(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"

    policy = the(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert admitted == {g.metrics_port}, "only the metrics port is reachable from outside the pod"


def adapter_rules() -> list[dict[str, Any]]:
    """The rules of deploy/prometheus/adapter-values.yaml: Helm values (`rules.custom`), which merge
    with the adapter release's own instead of replacing its config."""
    values = yaml.safe_load((DEPLOY / "prometheus" / "adapter-values.yaml").read_text())
    assert set(values) == {"rules"} and set(values["rules"]) == {"custom"}
    rules: list[dict[str, Any]] = values["rules"]["custom"]
    return rules


def test_hpa_scales_the_deployment_on_the_adapter_metrics() -> None:
    objects = k8s_objects()
    hpa = the(objects, "HorizontalPodAutoscaler")
    deployment = the(objects, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in deployment["spec"], "the HPA owns the count: apply -k would reset it"
    rules = {rule["name"]["as"]: rule for rule in adapter_rules()}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods"
        rule = rules[metric["pods"]["metric"]["name"]]
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        assert re.fullmatch(r"\d+m|0?\.\d+", str(metric["pods"]["target"]["averageValue"]))


def _quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def simulate_hpa(metrics: dict[str, float], load: float, capacity: int, replicas: int, minutes: int) -> list[int]:
    """The HPA's algorithm (kubernetes.io, Horizontal Pod Autoscaling): each Pods metric proposes
    ceil(replicas x value / target) unless within the 10% tolerance, the largest proposal wins,
    scale-down takes the highest recommendation of the 10-minute window. `load`: requests the
    clients keep in flight over all pods; each pod admits up to `capacity`, yields the rest."""
    history: list[int] = []
    window: list[int] = []
    for _ in range(minutes):
        admitted = min(load, replicas * capacity)
        values = {
            "governor_utilisation": admitted / (replicas * capacity),
            "governor_yield_ratio": (load - admitted) / load if load else 0.0,
        }
        proposals = []
        for name, target in metrics.items():
            ratio = values[name] / target
            proposals.append(replicas if abs(ratio - 1) <= 0.1 else math.ceil(replicas * ratio))
        desired = min(max(max(proposals), 1), 8)
        window = (window + [desired])[-10:]
        replicas = desired if desired > replicas else max(window)
        history.append(replicas)
    return history


@pytest.mark.parametrize("load", [10, 45, 100, 250])
def test_the_hpa_settles_on_the_shipped_metrics_and_the_yield_ratio_alone_saws(load: float) -> None:
    hpa = the(k8s_objects(), "HorizontalPodAutoscaler")
    metrics = {
        m["pods"]["metric"]["name"]: _quantity(str(m["pods"]["target"]["averageValue"])) for m in hpa["spec"]["metrics"]
    }
    capacity = 32  # --max-inflight
    shipped = simulate_hpa(metrics, load, capacity, replicas=1, minutes=120)
    settled = shipped[-60:]
    assert len(set(settled)) == 1, f"load {load}: still moving in the last hour: {settled}"
    assert settled[0] * capacity >= load or settled[0] == 8  # enough pods, unless at maxReplicas
    assert (
        settled[0] == min(8, max(1, math.ceil(load / (capacity * 0.7 * 1.1))))
        or settled[0] * capacity * 0.7 >= load * 0.9
    )
    yields_only = simulate_hpa({"governor_yield_ratio": metrics["governor_yield_ratio"]}, load, capacity, 4, 120)
    if capacity < load < 8 * capacity:  # more than one pod's worth: it drops a pod until yields return
        assert len(set(yields_only[-60:])) > 1, "the old configuration oscillates (its sawtooth)"


# --- systemd -------------------------------------------------------------------------------------


def read_unit(*paths: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values, with drop-ins applied in order (an empty value resets a list)."""
    unit: dict[str, dict[str, list[str]]] = {}
    for path in paths:
        parser = configparser.RawConfigParser(strict=False, interpolation=None, delimiters=("=",))
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        # configparser keeps the last of repeated keys; systemd appends, so collect them first.
        section = ""
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                unit.setdefault(section, {})
                continue
            key, sep, value = line.partition("=")
            assert sep and section, f"{path}: not a key=value line in a section: {line}"
            values = unit[section].setdefault(key.strip(), [])
            if value.strip():
                values.append(value.strip())
            else:
                values.clear()
        parser.read_string(path.read_text())  # and configparser agrees it is well formed
    return unit


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert values, f"[{section}] {key}= missing"
    return values[-1]


def exec_start(unit: dict[str, dict[str, list[str]]], secret: Path) -> tuple[str, Parsed]:
    (line,) = unit["Service"]["ExecStart"]
    return parse_command(shlex.split(line), secret)


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, value
    return int(match[1]) * (60 if match[2] == "min" else 1)


GOVERNOR_UNIT = SYSTEMD / "governor.service"
WORKER_UNIT = SYSTEMD / "governor-worker.service"
EXTERNAL_DROP_IN = SYSTEMD / "governor.service.d" / "external-worker.conf"


@pytest.mark.parametrize(
    "paths",
    [(GOVERNOR_UNIT,), (GOVERNOR_UNIT, EXTERNAL_DROP_IN), (WORKER_UNIT,)],
    ids=["governor", "governor+external-worker", "worker"],
)
def test_systemd_units_are_sandboxed_and_run_valid_command_lines(paths: tuple[Path, ...], secret: Path) -> None:
    unit = read_unit(*paths)
    for key, value in SANDBOXING.items():
        if value:
            assert one(unit, "Service", key) == value, key
        else:
            assert unit["Service"].get(key) == [], f"{key}= must be present and empty"
    assert "RuntimeDirectory" in unit["Service"] or "worker" in paths[0].name
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    program, parsed = exec_start(unit, secret)
    config = parsed.config
    assert program == ("worker" if paths[0] == WORKER_UNIT else "governor")
    # Secret files come from LoadCredential= (readable by the DynamicUser), as %d/NAME.
    credentials = {c.partition(":")[0] for c in unit["Service"].get("LoadCredential", [])}
    for path in parsed.token_files.values():
        assert path.startswith("%d/") and path[3:] in credentials, path
    if program == "governor":
        assert config.host == "127.0.0.1"
        assert one(unit, "Service", "KillMode") == "mixed", "signal only the governor: it drains, then stops its worker"
    else:
        assert config.listen.startswith("127.0.0.1:")
    # Both drain on SIGTERM: systemd must not SIGKILL them mid-drain.
    assert _seconds(one(unit, "Service", "TimeoutStopSec")) > config.drain_timeout_s + 5
    # ProtectClock= would hide /dev/nvidia* on systemd < 253 (it implies a device allow-list).
    assert "ProtectClock" not in unit["Service"] and "DevicePolicy" not in unit["Service"]


def test_systemd_external_worker_drop_in_points_the_governor_at_the_worker_unit(secret: Path) -> None:
    governor = read_unit(GOVERNOR_UNIT, EXTERNAL_DROP_IN)
    worker = read_unit(WORKER_UNIT)
    g: GovernorConfig = exec_start(governor, secret)[1].config
    w: WorkerConfig = exec_start(worker, secret)[1].config
    assert g.worker == (w.listen,)
    assert not g.worker_args
    assert WORKER_UNIT.name in governor["Unit"]["After"]  # so the governor stops (drains) first
    assert WORKER_UNIT.name in governor["Unit"]["Wants"]
    # Both sides read the same secret file.
    assert governor["Service"]["LoadCredential"] == worker["Service"]["LoadCredential"]


# --- Prometheus and Grafana ----------------------------------------------------------------------


def test_prometheus_scrape_target_is_the_systemd_governor_metrics_endpoint(secret: Path) -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for rule_file in prometheus["rule_files"]:
        assert (DEPLOY / rule_file).is_file(), rule_file
    (job,) = prometheus["scrape_configs"]
    (static,) = job["static_configs"]
    g: GovernorConfig = exec_start(read_unit(GOVERNOR_UNIT), secret)[1].config
    assert static["targets"] == [f"{g.host}:{g.metrics_port}"]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert "for" not in rule or re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    exprs = " ".join(r["expr"] for r in rules)
    for metric in (
        "governor_yielded_total",
        "governor_worker_restarts_total",
        "governor_max_inflight",
        'governor_rejected_total{reason="integrity"}',
        "governor_endpoint_up",
        "governor_connections_shed_total",
    ):
        assert metric in exprs


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads((DEPLOY / "grafana" / "governor-dashboard.json").read_text())
    return board


def test_grafana_dashboard_is_importable() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            for variable in re.findall(r"\$(\w+)", target["expr"]):
                assert variable in variables or variable.startswith("__"), variable
    exprs = " ".join(dashboard_expressions())
    for needle in (
        "governor_max_inflight",
        "histogram_quantile(0.99, sum by (le) (rate(governor_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(governor_request_duration_seconds_bucket",
        "rate(governor_worker_step_sequences_total",
        "rate(governor_worker_generated_tokens_total",
    ):
        assert needle in exprs


# --- PromQL in deploy/, shared with tests/integration/test_deploy_live.py ------------------------


def dashboard_expressions() -> Iterator[str]:
    board = dashboard()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["definition"]


def promql_expressions() -> dict[str, str]:
    """Every PromQL expression in deploy/, keyed by where it is."""
    out: dict[str, str] = {}
    for rule in alert_rules():
        out[f"alerts.yml:{rule['alert']}"] = rule["expr"]
    for i, expr in enumerate(dashboard_expressions()):
        out[f"governor-dashboard.json:{i}"] = expr
    for i, rule in enumerate(adapter_rules()):
        out[f"prometheus-adapter:{i}:seriesQuery"] = rule["seriesQuery"]
        out[f"prometheus-adapter:{i}:metricsQuery"] = rule["metricsQuery"]
    return out


METRIC = re.compile(r"\bgovernor_[a-z_]+\b")
SELECTOR = re.compile(r"\b(governor_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")


def referenced_metrics(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def referenced_label_values(expr: str) -> set[tuple[str, str, str]]:
    """(metric, label, value) for literal label values a selector names (each alternative of a regex)."""
    out: set[tuple[str, str, str]] = set()
    for metric, body in SELECTOR.findall(expr):
        for label, _, value in MATCHER.findall(body):
            if "$" in value or label in ("namespace", "pod", "instance", "job"):
                continue  # dashboard variables and target labels Prometheus adds
            out.update((metric, label, v) for v in value.split("|") if v)
    return out


def test_promql_extraction_finds_every_metric_family() -> None:
    exprs = promql_expressions()
    assert any(k.startswith("alerts.yml") for k in exprs)
    assert any(k.startswith("governor-dashboard.json") for k in exprs)
    assert any(k.startswith("prometheus-adapter") for k in exprs)
    names = set().union(*(referenced_metrics(e) for e in exprs.values()))
    assert {"governor_inflight", "governor_request_duration_seconds_bucket", "governor_yielded_total"} <= names
    assert ("governor_rejected_total", "reason", "integrity") in set().union(
        *(referenced_label_values(e) for e in exprs.values())
    )


# --- the fleet overlay ---------------------------------------------------------------------------


def json_patch_add(document: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 `add` and `replace` operations (all the overlays use), as kustomize applies them
    (a `replace` needs its target to exist)."""
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = op["path"].lstrip("/").split("/")
        node = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "replace":
            node[int(last) if isinstance(node, list) else last]  # noqa: B018 (raises if absent)
            node[int(last) if isinstance(node, list) else last] = op["value"]
        elif isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            node[last] = op["value"]
    return document


FLEET = DEPLOY / "k8s-fleet"


def fleet_deployment() -> dict[str, Any]:
    """The Deployment as the fleet overlay leaves it (its one patch applied)."""
    kustomization = yaml.safe_load((FLEET / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s", "redis.yaml"]
    (patch,) = kustomization["patches"]
    assert patch["target"]["kind"] == "Deployment" and patch["target"]["name"] == "inference"
    deployment = copy.deepcopy(the(k8s_objects(), "Deployment"))
    assert deployment["metadata"]["name"] == "inference"
    assert deployment["spec"]["template"]["spec"]["containers"][1]["name"] == "governor"  # the patch's index
    return json_patch_add(deployment, yaml.safe_load((FLEET / patch["path"]).read_text()))  # type: ignore[no-any-return]


def fleet_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay's own objects, and its example Secret (which the kustomization leaves out)."""
    docs = [
        *yaml.safe_load_all((FLEET / "redis.yaml").read_text()),
        yaml.safe_load((FLEET / "secret.yaml").read_text()),
    ]
    return {(o["kind"], o["metadata"]["name"]): o for o in docs}


def test_fleet_overlay_gives_every_governor_a_valid_fleet_on_its_own_valkey(secret: Path) -> None:
    deployment = fleet_deployment()
    governor = _containers(deployment)["governor"]

    redis = fleet_objects()
    assert set(redis) == {
        ("Secret", "governor-fleet-redis"),
        ("Service", "governor-fleet-redis"),
        ("StatefulSet", "governor-fleet-redis"),
        ("NetworkPolicy", "governor-fleet-redis"),
    }
    (env,) = governor["env"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["key"] in redis[("Secret", ref["name"])]["stringData"]
    command = [arg.replace(f"$({env['name']})", "pw") for arg in governor["command"]]
    config = parse_command(command, secret)[1].config
    placeholder = redis[("Secret", ref["name"])]["stringData"][ref["key"]]
    with pytest.raises(ConfigError, match="placeholder"):  # the example Secret's password, applied unedited
        parse_command([arg.replace(f"$({env['name']})", placeholder) for arg in governor["command"]], secret)
    service = redis[("Service", "governor-fleet-redis")]
    assert config.fleet == f"redis://:pw@{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    assert config.fleet_max_inflight > config.max_inflight and config.fleet_max_qps > 0

    statefulset = redis[("StatefulSet", "governor-fleet-redis")]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    pod = statefulset["spec"]["template"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    (valkey,) = pod["spec"]["containers"]
    assert valkey["env"][0]["valueFrom"]["secretKeyRef"] == ref  # the password the governors use
    assert "--requirepass" in valkey["command"] and "$(REDIS_PASSWORD)" in valkey["command"]
    policy = redis[("NetworkPolicy", "governor-fleet-redis")]
    (allowed,) = policy["spec"]["ingress"]
    inference_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert allowed["from"][0]["podSelector"]["matchLabels"].items() <= inference_labels.items()
    assert allowed["ports"][0]["port"] == service["spec"]["ports"][0]["port"]


def _lower_bound(requirements: Sequence[str], name: str) -> str:
    """The `>=` bound of `name` among requirement strings (markers ignored)."""
    for requirement in requirements:
        match = re.fullmatch(rf"{name}>=([0-9.]+)(\s*;.*)?", requirement.replace(" ", "").replace(";", " ;"))
        if match:
            return match.group(1)
    raise AssertionError(f"no {name}>= among {requirements}")


def test_the_declared_torch_bound_fits_transformers_and_the_cuda_image() -> None:
    """The worker's lower bounds must be installable together, and the CUDA image must meet them:
    transformers 5 switches PyTorch off below 2.6, so `GPT2LMHeadModel` would not import."""
    from importlib.metadata import requires

    from packaging.version import Version

    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    ours = Version(_lower_bound(pyproject["project"]["optional-dependencies"]["worker"], "torch"))
    theirs = Version(_lower_bound([r for r in requires("transformers") or [] if 'extra == "torch"' in r], "torch"))
    assert ours >= theirs, f"torch>={ours} but the transformers installed needs torch>={theirs}"
    base = re.search(r"^FROM pytorch/pytorch:([0-9.]+)-", (DEPLOY / "Dockerfile.cuda").read_text(), re.M)
    assert base is not None, "Dockerfile.cuda no longer starts from a pytorch/pytorch:<version>-… image"
    assert Version(base.group(1)) >= ours, f"the CUDA image's torch {base.group(1)} is below torch>={ours}"


GAIE = DEPLOY / "gaie"
INFERENCE_POOL_SPEC = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
ENDPOINT_PICKER_REF = {"group", "kind", "name", "port", "failureMode"}


def gaie_deployment() -> dict[str, Any]:
    """The Deployment as the GAIE overlay leaves it (its one patch applied)."""
    kustomization = yaml.safe_load((GAIE / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s", "inferencepool.yaml", "networkpolicy.yaml"]
    (patch,) = kustomization["patches"]
    assert patch["target"]["kind"] == "Deployment" and patch["target"]["name"] == "inference"
    deployment = copy.deepcopy(the(k8s_objects(), "Deployment"))
    governor = deployment["spec"]["template"]["spec"]["containers"][1]
    assert governor["name"] == "governor" and governor["command"][2] == "--host"  # the patch's indices
    return json_patch_add(deployment, yaml.safe_load((GAIE / patch["path"]).read_text()))  # type: ignore[no-any-return]


def gaie_objects() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [yaml.safe_load((GAIE / name).read_text()) for name in ("inferencepool.yaml", "networkpolicy.yaml")]
    return {(o["kind"], o["metadata"]["name"]): o for o in docs}


def test_the_gaie_overlay_makes_the_governed_pods_an_inference_pool(secret: Path) -> None:
    """The InferencePool's CRD is not on a package registry (GAIE ships it in its release
    manifests), so it is checked here by the structure of GAIE's v1 API (api/v1/inferencepool_types.go):
    required selector.matchLabels and targetPorts (1-8 ports), an endpointPickerRef with a name and,
    for a Service, a port, and no field v1 does not have."""
    deployment = gaie_deployment()
    governor = _containers(deployment)["governor"]
    config = parse_command(governor["command"], secret)[1].config
    assert config.host == "0.0.0.0" and config.http_port == 8000 and config.auth_token_file  # still a token
    assert config.gateway_policy().trusted and config.gateway_policy().objectives  # parsed as the governor does
    assert {"name": "http", "containerPort": config.http_port} in governor["ports"]

    objects = gaie_objects()
    pool = objects[("InferencePool", "inference")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= INFERENCE_POOL_SPEC and {"selector", "targetPorts"} <= set(spec)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["targetPorts"] == [{"number": config.http_port}]  # the front door, whose /metrics it scrapes too
    picker = spec["endpointPickerRef"]
    assert set(picker) <= ENDPOINT_PICKER_REF and picker["name"]
    assert picker.get("kind", "Service") != "Service" or 1 <= picker["port"]["number"] <= 65535
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")

    policy = objects[("NetworkPolicy", "inference-front-door")]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": config.http_port}]
