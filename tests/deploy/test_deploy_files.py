"""deploy/ parses and is valid by the real tools, and its parts agree with each other."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from deploy_tools import DEPLOY, K8S, K8S_VERSIONS, REPO, Compose, Kubeconform
from packaging.requirements import Requirement

from proxy.settings import ENV_PREFIX, Settings, variable_name

COMPOSE_FILES = ("docker-compose.yml", "docker-compose.twins.yml")
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
EAGLE3_FLAGS = (
    "--speculative-algorithm=EAGLE3",
    "--speculative-draft-model-path=",
    "--speculative-num-steps=",
    "--speculative-eagle-topk=",
    "--speculative-num-draft-tokens=",
    "--max-running-requests=48",
    "--enable-metrics",
    "--enable-trace",
    "--otlp-traces-endpoint=jaeger:4317",
)


def env_example_names() -> set[str]:
    """Variables .env.example sets or shows (a commented `# NAME=default` line counts)."""
    text = (DEPLOY / ".env.example").read_text()
    return set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", text, flags=re.M))


def env_example_entries() -> dict[str, tuple[str, str]]:
    """Variable -> (the value .env.example shows, the comment lines right above it, joined)."""
    entries: dict[str, tuple[str, str]] = {}
    comment: list[str] = []
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        shown = re.match(r"^#? ?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if shown:
            entries[shown[1]] = (shown[2], " ".join(comment))
            comment = []
        elif line.startswith("#"):
            comment.append(line.removeprefix("#").strip())
        else:
            comment = []
    return entries


def setting_names() -> set[str]:
    return {variable_name(name) for name in Settings.model_fields}


def seconds(duration: str | int | float) -> float:
    """A compose duration ("40s", "1m30s") or a number of seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([\d.]+)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def k8s_documents() -> dict[tuple[str, str], dict]:
    documents = {}
    for name in MANIFESTS:
        for document in yaml.safe_load_all((K8S / name).read_text()):
            documents[(document["kind"], document["metadata"]["name"])] = document
    return documents


# ---- docker compose ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_is_valid(compose: Compose, name: str) -> None:
    done = compose.run("--env-file", ".env.example", "-f", name, "config", "--quiet")
    assert done.returncode == 0, done.stderr


def test_compose_rejects_what_is_wrong(compose: Compose, tmp_path: Path) -> None:
    """The validator is live: a misspelt key and a missing required variable both fail."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text((DEPLOY / "docker-compose.yml").read_text().replace("start_period:", "start_periode:", 1))
    done = compose.run("--env-file", str(DEPLOY / ".env.example"), "-f", str(broken), "config", "--quiet")
    assert done.returncode != 0 and "start_periode" in done.stderr

    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = compose.run("--env-file", str(empty), "-f", "docker-compose.yml", "config", "--quiet")
    assert done.returncode != 0 and "MODEL_PATH" in done.stderr


def test_real_stack_runs_eagle3_beside_a_throughput_server(compose: Compose) -> None:
    services = compose.config("docker-compose.yml")["services"]
    assert set(services) == {"sglang-spec", "sglang-base", "specroute", "jaeger"}
    spec, base = services["sglang-spec"]["command"], services["sglang-base"]["command"]
    for flag in EAGLE3_FLAGS:
        assert any(arg.startswith(flag) for arg in spec), flag
    assert not any(arg.startswith("--speculative") for arg in base)
    assert {"--enable-metrics", "--enable-trace", "--otlp-traces-endpoint=jaeger:4317"} <= set(base)
    for name in ("sglang-spec", "sglang-base"):
        service = services[name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        # A model load takes minutes: probes in the start period must not count as failures.
        assert seconds(service["healthcheck"]["start_period"]) >= 600
        assert service["healthcheck"]["test"][-1].endswith(":30000/health")
    proxy = services["specroute"]
    assert {name: dep["condition"] for name, dep in proxy["depends_on"].items()} == {
        "sglang-spec": "service_healthy",
        "sglang-base": "service_healthy",
        "jaeger": "service_healthy",
    }
    assert proxy["environment"]["SPECROUTE_SPEC_URLS"] == "http://sglang-spec:30000"
    assert proxy["environment"]["SPECROUTE_BASE_URLS"] == "http://sglang-base:30000"
    # docker stop waits stop_grace_period before SIGKILL: it must outlast the drain and the last
    # span export (Tracing.stop's limit).
    assert seconds(proxy["stop_grace_period"]) >= float(proxy["environment"]["SPECROUTE_DRAIN_TIMEOUT_S"]) + 10 + 5
    assert "13133/status" in services["jaeger"]["healthcheck"]["test"][-1]
    # Published ports bind loopback unless BIND_ADDRESS says otherwise.
    assert {port["host_ip"] for s in services.values() for port in s.get("ports", [])} == {"127.0.0.1"}
    # Exposing the proxy leaves the servers on loopback: SGLang serves /abort_request (abort_all)
    # and /flush_cache to anyone who connects.
    exposed = compose.config("docker-compose.yml", env={"BIND_ADDRESS": "0.0.0.0"})["services"]
    addresses = {name: {port["host_ip"] for port in s.get("ports", [])} for name, s in exposed.items()}
    assert addresses == {
        "specroute": {"0.0.0.0"},
        "sglang-spec": {"127.0.0.1"},
        "sglang-base": {"127.0.0.1"},
        "jaeger": {"127.0.0.1"},
    }


def test_twin_stack_is_the_same_stack_on_twins(compose: Compose) -> None:
    real = compose.config("docker-compose.yml")["services"]
    twins = compose.config("docker-compose.twins.yml")["services"]
    assert set(twins) == set(real)
    for name in ("specroute", "jaeger"):
        assert twins[name] == real[name], name
    for name, mode in (("sglang-spec", "spec"), ("sglang-base", "base")):
        assert twins[name]["command"][:3] == ["specroute", "sim", f"--mode={mode}"]
        assert "deploy" not in twins[name]  # no GPU


def test_every_tunable_is_in_env_example() -> None:
    names = env_example_names()
    missing = sorted(setting_names() - names)
    assert not missing, f"add these settings to deploy/.env.example: {missing}"
    used = set()
    for name in COMPOSE_FILES:
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (DEPLOY / name).read_text()))
    assert not sorted(used - names), "compose variables missing from .env.example"
    stale = sorted(n for n in names if n.startswith(ENV_PREFIX) and n not in setting_names())
    assert not stale, f"not settings of the proxy: {stale}"


def test_env_example_shows_each_policy_parameter_as_declared() -> None:
    # Default and help of a policy's parameter come from its declaration (policies/*.py).
    from policies import registry
    from proxy.settings import policy_setting

    entries = env_example_entries()
    wrong = []
    for policy, params in registry.declared_params().items():
        for param in params.model_fields:
            field = Settings.model_fields[policy_setting(policy, param)]
            variable = variable_name(policy_setting(policy, param))
            if entries.get(variable) != (str(field.default), field.description):
                wrong.append(f"# {field.description}\n# {variable}={field.default}")
    assert not wrong, "deploy/.env.example should show:\n" + "\n".join(wrong)


def test_every_setting_reaches_the_proxy_container(compose: Compose) -> None:
    environment = compose.config("docker-compose.yml")["services"]["specroute"]["environment"]
    missing = sorted(setting_names() - set(environment))
    assert not missing, f"list these in the specroute service's environment: {missing}"
    # The proxy ignores unknown SPECROUTE_* variables, so a misspelt one would pass silently.
    assert not sorted(n for n in environment if n.startswith(ENV_PREFIX) and n not in setting_names())


def test_proxy_configmap_names_only_real_settings() -> None:
    data = k8s_documents()[("ConfigMap", "specroute")]["data"]
    unknown = sorted(n for n in data if n not in setting_names() and not n.startswith("OTEL_"))
    assert not unknown, unknown
    Settings(**{field: data[variable_name(field)] for field in Settings.model_fields if variable_name(field) in data})


# ---- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint(hadolint: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(DEPLOY / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # ... and hadolint is live: an unpinned base image and a root user are reported.
    bad = tmp_path / "Dockerfile"
    bad.write_text('FROM python:latest\nUSER root\nCMD ["python"]\n')
    done = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3007" in done.stdout


def test_dockerfile_is_small_non_root_pinned_and_checked() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    image = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, flags=re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", image), image
    assert re.search(r"^USER 10001", text, flags=re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, flags=re.M)
    assert text.count("FROM ") == 2  # build stage, then a runtime stage without pip's leftovers
    assert 'CMD ["specroute", "serve"]' in text


def test_build_context_holds_exactly_what_the_image_copies() -> None:
    """deploy/Dockerfile.dockerignore lets through each COPY source (and so no .venv)."""
    copied = set()
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied.update(source.rstrip("/") for source in line.split()[1:-1])
    allowed = {
        line[1:].rstrip("/")
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert copied == allowed
    assert all((REPO / source).exists() for source in copied)


def test_image_pins_every_runtime_dependency() -> None:
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            pins[requirement.name.lower().replace("_", "-")] = specifier.version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in deploy/constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} breaks {line}"


# ---- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_are_valid_kubernetes(kubeconform: Kubeconform, version: str) -> None:
    done = kubeconform.run(*(str(K8S / name) for name in MANIFESTS), version=version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        f"{len(k8s_documents())} resources found in {len(MANIFESTS)} files - Valid: {len(k8s_documents())},"
        in done.stdout
    )


def test_kubeconform_rejects_what_is_wrong(kubeconform: Kubeconform) -> None:
    text = (K8S / "specroute.yaml").read_text()
    broken = text.replace("terminationGracePeriodSeconds: ", "terminationGracePeriod: ", 1)
    done = kubeconform.run("-", version=K8S_VERSIONS[-1], stdin=broken)
    assert done.returncode != 0 and "terminationGracePeriod" in done.stdout
    wrong_type = text.replace("containerPort: 8000", 'containerPort: "8000"', 1)
    done = kubeconform.run("-", version=K8S_VERSIONS[-1], stdin=wrong_type)
    assert done.returncode != 0 and "containerPort" in done.stdout


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomization_renders_every_manifest(kubeconform: Kubeconform) -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(rendered.stdout)}
    assert kinds == set(k8s_documents())
    done = kubeconform.run("-", version=K8S_VERSIONS[-1], stdin=rendered.stdout)
    assert done.returncode == 0, done.stdout


def test_kustomization_names_every_image_the_manifests_run() -> None:
    """The `images:` stanza is where an operator sets registry and tags: it must name each image
    the manifests run, with the tag they pin, or an edit there silently misses a container."""
    stanza = {i["name"]: i["newTag"] for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]}
    running = set()
    for document in k8s_documents().values():
        pod = document.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            running.add(tuple(container["image"].rsplit(":", 1)))
    assert running == set(stanza.items())


def test_proxy_shutdown_fits_in_the_grace_period() -> None:
    documents = k8s_documents()
    pod = documents[("Deployment", "specroute")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    drain = float(documents[("ConfigMap", "specroute")]["data"]["SPECROUTE_DRAIN_TIMEOUT_S"])
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # Kubernetes counts the preStop hook inside the grace period, then sends SIGTERM; the drain
    # and the last span export (Tracing.stop's limit, 10 s) must end before SIGKILL, with a small
    # margin for exit, and not much more.
    assert pod["terminationGracePeriodSeconds"] == pre_stop + drain + 10 + 5
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["failureThreshold"] == 1
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_autoscaler_and_budget_cover_the_proxy() -> None:
    documents = k8s_documents()
    labels = documents[("Deployment", "specroute")]["spec"]["template"]["metadata"]["labels"]
    hpa = documents[("HorizontalPodAutoscaler", "specroute")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specroute"}
    assert hpa["minReplicas"] >= 2
    pdb = documents[("PodDisruptionBudget", "specroute")]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["minAvailable"] < hpa["minReplicas"]  # a node drain can always evict one


def test_proxy_reaches_every_pool_pod_by_dns() -> None:
    """Each pool URL names one pod of a StatefulSet behind a headless Service, on its port."""
    documents = k8s_documents()
    config = documents[("ConfigMap", "specroute")]["data"]
    for variable, pool in (("SPECROUTE_SPEC_URLS", "sglang-spec"), ("SPECROUTE_BASE_URLS", "sglang-base")):
        service = documents[("Service", pool)]["spec"]
        statefulset = documents[("StatefulSet", pool)]["spec"]
        assert service["clusterIP"] == "None" and statefulset["serviceName"] == pool
        urls = config[variable].split(",")
        assert len(urls) == statefulset["replicas"]
        for ordinal, url in enumerate(urls):
            assert url == f"http://{pool}-{ordinal}.{pool}:{service['ports'][0]['port']}"
    spec_args = documents[("StatefulSet", "sglang-spec")]["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in EAGLE3_FLAGS:
        assert any(arg.startswith(flag.replace("jaeger:4317", "$(OTLP_TRACES_ENDPOINT)")) for arg in spec_args), flag


def test_only_the_proxy_reaches_the_sglang_servers() -> None:
    """SGLang serves /abort_request (abort_all), /flush_cache and weight updates without a key: the
    NetworkPolicy admits to both pools' pods only the proxy's pods, on the servers' port."""
    documents = k8s_documents()
    policy = documents[("NetworkPolicy", "sglang-from-specroute")]["spec"]
    selected = {value for rule in policy["podSelector"]["matchExpressions"] for value in rule["values"]}
    assert policy["policyTypes"] == ["Ingress"]
    for pool in ("sglang-spec", "sglang-base"):
        pod = documents[("StatefulSet", pool)]["spec"]["template"]
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] in selected
        assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == ["http"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    proxy_labels = documents[("Deployment", "specroute")]["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= proxy_labels.items()
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${NAME:-default}` substitution (the only form the proxy's ports use)."""
    return re.sub(r"\$\{([A-Z0-9_]+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)


def test_the_published_proxy_port_is_the_images_and_env_example_says_to_leave_specroute_port() -> None:
    """From an operator's probe: SPECROUTE_PORT=9000 in .env moved the listener while 8000 stayed
    published. The published container port stays the image's 8000 (publishing SPECROUTE_PORT
    breaks the stack's commands run outside Docker with SPECROUTE_PORT=0: compose refuses target
    port 0), and .env.example says to leave SPECROUTE_PORT unset under compose. Read without
    Docker's compose: the YAML and compose's substitution rule."""
    [published] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["specroute"]["ports"]
    assert interpolate(published, {"PROXY_PUBLISH_PORT": "80"}) == "127.0.0.1:80:8000"
    _, comment = env_example_entries()["SPECROUTE_HOST"]  # the lines above the pair
    assert "leave SPECROUTE_PORT unset" in " ".join(comment.split())


def test_env_example_names_every_built_in_profile() -> None:
    from fleet.profile import builtin_names

    _, comment = env_example_entries()["SPECROUTE_PROFILE"]  # the comment lines above it
    named = set(re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+", comment))
    assert set(builtin_names()) <= named, sorted(set(builtin_names()) - named)
