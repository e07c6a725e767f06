"""deploy/ through the real tools its users' pipelines run: promtool, kubernetes-validate, hadolint,
systemd-analyze. tests/unit/test_deploy.py checks what only this project knows (its CLI accepts the
command lines, the ports agree); these check what the tools know (schemas, Dockerfile practice,
systemd's parser). A missing tool skips with the way to get it (tests/deploy_tools.py).

The ServiceMonitor, the InferencePool and the Kustomizations have no schema in kubernetes-validate
(two CRDs, and kustomize's own config); neither the prometheus-operator's CRD nor GAIE's is on a
package registry, so the ServiceMonitor and the InferencePool are checked by structure in
test_deploy.py (and the ServiceMonitor live, the way the operator scrapes it, in
tests/integration/test_deploy_live.py). The kustomizations are built by `kubectl kustomize` where
kubectl is installed (it is on no package registry this project can install from).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_tools import tool
from tests.unit.test_deploy import (
    DEPLOY,
    FLEET,
    GAIE,
    K8S,
    SYSTEMD,
    fleet_deployment,
    fleet_objects,
    gaie_deployment,
    gaie_objects,
    k8s_objects,
)

# The oldest Kubernetes still in wide use, one in the middle, and the newest the tool knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.33.0", "1.37.0")
NO_SCHEMA = {"Kustomization", "ServiceMonitor", "InferencePool"}
DOCKERFILES = sorted(p for p in DEPLOY.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))
# `systemd-analyze security` rates exposure 0.0 (locked down) to 10.0; "OK" ends at 3.9. Both
# units score about 2 (the governor 1.7, the worker 2.1: it keeps @resources for torch's threads).
MAX_EXPOSURE = 2.5


def kubernetes_validate_module() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="the dev extra installs it: `make test`")


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, **kwargs)


def test_promtool_accepts_the_alert_rules_and_the_shipped_config() -> None:
    promtool = tool("promtool")
    rules = run([promtool, "check", "rules", "--lint=all", "--lint-fatal", str(DEPLOY / "prometheus" / "alerts.yml")])
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS" in rules.stdout
    config = run([promtool, "check", "config", "--lint=all", "--lint-fatal", str(DEPLOY / "prometheus.yml")])
    assert config.returncode == 0, config.stdout + config.stderr
    assert "1 rule files found" in config.stdout  # the relative rule_files path resolves


def test_promtool_runs_the_shipped_alert_unit_tests() -> None:
    """deploy/prometheus/alerts_test.yml: when each alert fires, with which labels and text."""
    tests = DEPLOY / "prometheus" / "alerts_test.yml"
    result = run([tool("promtool"), "test", "rules", tests.name], cwd=tests.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every object `kubectl apply -k deploy/k8s` or `-k deploy/k8s-fleet` would send."""
    base = [(f"k8s/{kind}/{name}", obj) for (kind, name), obj in k8s_objects().items()]
    fleet = [(f"k8s-fleet/{kind}/{name}", obj) for (kind, name), obj in fleet_objects().items()]
    gaie = [(f"gaie/{kind}/{name}", obj) for (kind, name), obj in gaie_objects().items()]
    patched = [
        ("k8s-fleet/Deployment/inference (patched)", fleet_deployment()),
        ("gaie/Deployment/inference (patched)", gaie_deployment()),
    ]
    return [*base, *fleet, *gaie, *patched]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_validate_accepts_every_manifest_strictly(version: str) -> None:
    kubernetes_validate = kubernetes_validate_module()
    checked = 0
    for where, obj in manifests():
        if obj["kind"] in NO_SCHEMA:
            continue
        try:  # strict: a misspelt or misplaced field is an error, not silently dropped by the API server
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} is invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked >= 11  # Deployment (and patched x2), HPA, Service, NetworkPolicy x3, Secret x2, StatefulSet...


def test_kubernetes_validate_rejects_a_misplaced_field() -> None:
    """The check above can fail: strict validation catches a field at the wrong level."""
    kubernetes_validate = kubernetes_validate_module()
    deployment = fleet_deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["replicas"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def kustomize(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """What `kubectl apply -k directory` would send, built by kustomize itself."""
    built = run([tool("kubectl"), "kustomize", str(directory)])
    assert built.returncode == 0, built.stderr
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(built.stdout) if o}


def test_kustomize_builds_the_kustomizations_into_the_objects_the_tests_model() -> None:
    """The tests above read the manifests themselves (and apply the fleet patch themselves);
    kustomize's own build must agree, and pass kubernetes-validate too."""
    kubernetes_validate = kubernetes_validate_module()
    base = kustomize(K8S)
    expected = {key for key in k8s_objects() if key[0] not in ("Kustomization", "Secret")}  # the example Secret
    assert set(base) == expected
    fleet = kustomize(FLEET)
    assert set(fleet) == expected | {key for key in fleet_objects() if key[0] != "Secret"}
    assert fleet[("Deployment", "inference")] == fleet_deployment()
    gaie = kustomize(GAIE)
    assert set(gaie) == expected | set(gaie_objects())
    assert gaie[("Deployment", "inference")] == gaie_deployment()
    for (kind, _), obj in [*base.items(), *fleet.items(), *gaie.items()]:
        if kind not in NO_SCHEMA:
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes_the_dockerfile(dockerfile: Path) -> None:
    """With hadolint's default rules; an ignore is written on its line with the reason."""
    result = run([tool("hadolint"), "--no-color", str(dockerfile)])
    assert result.returncode == 0, result.stdout + result.stderr


def _units_with_a_venv(tmp_path: Path) -> Path:
    """deploy/systemd/ with ExecStart= pointing at this venv's scripts, which must exist for
    `verify`: what /opt/governor/.venv is once the documented install step has run."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "governor").exists() or not (bin_dir / "worker").exists():
        pytest.skip("the governor and worker scripts are not installed beside this Python (`make test` does it)")
    for path in SYSTEMD.rglob("*"):
        if path.is_file():
            target = tmp_path / path.relative_to(SYSTEMD)
            target.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_text()
            assert "/opt/governor/.venv/bin" in text or path.suffix == ".conf", path
            target.write_text(text.replace("/opt/governor/.venv/bin", str(bin_dir)))
    return tmp_path


def _systemd_analyze(units: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Outside a booted systemd it still parses the units, drop-ins included, and reports unknown
    # keys and bad values, as it would on the host.
    env = {"SYSTEMD_UNIT_PATH": f"{units}:", "PATH": "/usr/bin:/bin", "SYSTEMD_COLORS": "0"}
    return run([tool("systemd-analyze"), *args, "governor.service", "governor-worker.service"], cwd=units, env=env)


def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    result = _systemd_analyze(_units_with_a_venv(tmp_path), "verify", "--man=no")
    assert result.returncode == 0, result.stderr
    complaints = [line for line in result.stderr.splitlines() if str(tmp_path) in line]
    assert not complaints, "\n".join(complaints)


def test_systemd_analyze_verify_reports_a_bad_key_in_the_drop_in(tmp_path: Path) -> None:
    """The check above can fail, and reads the drop-in that points the governor at the worker unit."""
    units = _units_with_a_venv(tmp_path)
    (drop_in,) = (units / "governor.service.d").glob("*.conf")
    drop_in.write_text(drop_in.read_text().replace("[Service]", "[Service]\nTimeoutStopSecs=5", 1))
    result = _systemd_analyze(units, "verify", "--man=no")
    assert "TimeoutStopSecs" in result.stderr


def test_systemd_analyze_security_rates_both_units_ok(tmp_path: Path) -> None:
    result = _systemd_analyze(
        _units_with_a_venv(tmp_path),
        "security",
        "--offline=true",
        f"--threshold={round(MAX_EXPOSURE * 10)}",
        "--no-pager",
    )
    levels = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]
    assert len(levels) == 2, result.stdout + result.stderr
    assert result.returncode == 0, "\n".join(levels)
