"""Settings and the CLI as a user meets them: env vars, .env files, one-line errors, masking."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.settings import SettingsError, load_settings

SPECROUTE = [sys.executable, "-m", "proxy.cli"]


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECROUTE_", "OTEL_"))}
    return subprocess.run(SPECROUTE + args, env={**clean, **env}, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SPECROUTE_SPEC_URLS": "127.0.0.1:30000"}, "SPECROUTE_SPEC_URLS"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_PORT": "eighty"}, "SPECROUTE_PORT"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_POLICY": "fastest"}, "SPECROUTE_POLICY"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_CHUNK_TIMEOUT_S": "-1"}, "SPECROUTE_CHUNK_TIMEOUT_S"),
        ({}, "SPECROUTE_SPEC_URLS"),  # no upstream at all
        # Accepted once, then every request answered a plain-text 500:
        ({"SPECROUTE_SPEC_URLS": "http://:30000"}, "SPECROUTE_SPEC_URLS"),
        ({"SPECROUTE_BASE_URLS": "http://gpu-a:300000"}, "SPECROUTE_BASE_URLS"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_TOTAL_TIMEOUT_S": "inf"}, "SPECROUTE_TOTAL_TIMEOUT_S"),
        (
            {"SPECROUTE_BASE_URLS": "http://a:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        # A blank host made uvicorn listen on every interface (an empty one means unset: 127.0.0.1):
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_HOST": " "}, "SPECROUTE_HOST"),
        ({"SPECROUTE_BASE_URLS": "http://gpu a:30000"}, "SPECROUTE_BASE_URLS"),
        # Credentials in a URL would reach every client in x-specroute-backend:
        ({"SPECROUTE_BASE_URLS": "http://user:secret@gpu-a:30000"}, "SPECROUTE_BASE_URLS"),
        # uvicorn's trace level logs each request's query string, where a client may put its key:
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_LOG_LEVEL": "trace"}, "SPECROUTE_LOG_LEVEL"),
        # A review's findings: each started, looked healthy and failed every request to the pool.
        ({"SPECROUTE_BASE_URLS": "http://a:1/v1"}, "SPECROUTE_BASE_URLS"),  # the SDKs' base_url style
        ({"SPECROUTE_BASE_URLS": "http://a:1/v1/"}, "SPECROUTE_BASE_URLS"),
        ({"SPECROUTE_BASE_URLS": "http://a:1/?"}, "SPECROUTE_BASE_URLS"),  # an empty query
        ({"SPECROUTE_BASE_URLS": "http://a:1/#"}, "SPECROUTE_BASE_URLS"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_BASE_API_KEY": "clé-secret"}, "SPECROUTE_BASE_API_KEY"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_SPEC_API_KEY": "a\nb-secret"}, "SPECROUTE_SPEC_API_KEY"),
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_SPEC_API_KEY": " "}, "SPECROUTE_SPEC_API_KEY"),
        # The SDK's HTTP exporter failed every export to it, and the proxy looked traced:
        ({"SPECROUTE_BASE_URLS": "http://a:1", "OTEL_EXPORTER_OTLP_ENDPOINT": "jaeger:4318"}, "OTEL_EXPORTER_OTLP"),
        # A limit that refuses every chat:
        ({"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_MAX_JSON_ITEMS": "1"}, "SPECROUTE_MAX_JSON_ITEMS"),
    ],
)
def test_a_wrong_setting_stops_serve_with_one_line_naming_it(
    env: dict[str, str], variable: str, tmp_path: Path
) -> None:
    result = run(["serve"], env, tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback
    assert variable in lines[0] and lines[0].startswith("specroute: ")
    assert "secret" not in lines[0]


def test_config_prints_effective_settings_with_secrets_masked(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        "SPECROUTE_BASE_URLS=http://10.0.0.2:30000,http://10.0.0.3:30000\nSPECROUTE_BASE_API_KEY=sk-base-secret\n"
    )
    result = run(["config"], {"SPECROUTE_SPEC_API_KEY": "sk-spec-secret", "SPECROUTE_MAX_ATTEMPTS": "2"}, tmp_path)
    assert result.returncode == 0, result.stderr
    rows = dict(
        line.split(None, 1) if len(line.split(None, 1)) == 2 else (line.strip(), "")
        for line in result.stdout.splitlines()
    )
    assert rows["SPECROUTE_BASE_URLS"] == "http://10.0.0.2:30000,http://10.0.0.3:30000"  # from .env
    assert rows["SPECROUTE_MAX_ATTEMPTS"] == "2"  # from the environment
    assert rows["SPECROUTE_SPEC_API_KEY"] == rows["SPECROUTE_BASE_API_KEY"] == "********"
    assert "secret" not in result.stdout


def test_a_misspelt_variable_is_named_with_the_setting_it_meant(tmp_path: Path) -> None:
    # pydantic-settings ignores unknown variables: a typo would leave its setting at the default.
    (tmp_path / ".env").write_text("SPECROUTE_DRAIN_TIMOUT_S=5\n")
    env = {
        "SPECROUTE_BASE_URLS": "http://a:1",
        "SPECROUTE_POLCY": "threshold",
        "SPECROUTE_Max_Attempts": "4",  # names match in any case, as pydantic-settings reads them
        # Kubernetes' service links for a Service named specroute: not settings, not typos.
        "SPECROUTE_SERVICE_HOST": "10.96.0.12",
        "SPECROUTE_SERVICE_PORT_HTTP": "8000",
        "SPECROUTE_PORT_8000_TCP_ADDR": "10.96.0.12",
    }
    result = run(["config"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "specroute: warning: SPECROUTE_DRAIN_TIMOUT_S is not a setting (did you mean SPECROUTE_DRAIN_TIMEOUT_S?);"
        " it is ignored (`specroute config` lists them)",
        "specroute: warning: SPECROUTE_POLCY is not a setting (did you mean SPECROUTE_POLICY?);"
        " it is ignored (`specroute config` lists them)",
    ]
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["SPECROUTE_POLICY", "goodput"] in rows and ["SPECROUTE_MAX_ATTEMPTS", "4"] in rows


def test_a_kubernetes_service_link_in_the_port_is_named_as_such(tmp_path: Path) -> None:
    env = {"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_PORT": "tcp://10.96.0.12:8000"}
    result = run(["config"], env, tmp_path)
    assert result.returncode == 2
    assert "SPECROUTE_PORT: 'tcp://10.96.0.12:8000' is a Kubernetes service link" in result.stderr


def test_a_sampler_the_sdk_would_not_know_stops_the_proxy_with_one_line(tmp_path: Path) -> None:
    """From an operator's probe: OTEL_TRACES_SAMPLER=bogus only warned, and every request was
    traced (the SDK falls back to its default); so did a ratio out of range or not a number."""
    base = {"SPECROUTE_BASE_URLS": "http://a:1"}
    for env, said in (
        ({"OTEL_TRACES_SAMPLER": "traceidraio"}, "OTEL_TRACES_SAMPLER: unknown sampler 'traceidraio'"),
        ({"OTEL_TRACES_SAMPLER": " traceidratio"}, "OTEL_TRACES_SAMPLER: unknown sampler ' traceidratio'"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG: '1.5'"),
        ({"OTEL_TRACES_SAMPLER_ARG": "ten percent"}, "OTEL_TRACES_SAMPLER_ARG: 'ten percent' is not a number"),
    ):
        result = run(["config"], {**base, **env}, tmp_path)
        assert result.returncode == 2, result.stderr
        assert said in result.stderr and "Traceback" not in result.stderr, result.stderr
    fine = run(
        ["config"],
        {**base, "OTEL_TRACES_SAMPLER": "ParentBased_TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
        tmp_path,
    )
    assert fine.returncode == 0, fine.stderr


def test_resource_attributes_the_sdk_would_skip_stop_the_proxy_with_one_line(tmp_path: Path) -> None:
    """From earlier notes: a pair without "=" in OTEL_RESOURCE_ATTRIBUTES was skipped by the SDK
    with its own warning, written bare, several times (each process that builds a resource, one
    of them at import), and the attribute was missing from every span."""
    base = {"SPECROUTE_BASE_URLS": "http://a:1"}
    for value, said in (
        ("team=ml,deployment.environment", "'deployment.environment' is not key=value"),
        ("team=ml,", "an empty pair (a comma too many, or spaces alone)"),
        ("=ml", "'=ml' is not key=value"),
    ):
        result = run(["serve"], {**base, "OTEL_RESOURCE_ATTRIBUTES": value}, tmp_path)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("specroute: invalid setting OTEL_RESOURCE_ATTRIBUTES: ") and said in line, line
    fine = run(["config"], {**base, "OTEL_RESOURCE_ATTRIBUTES": "team=ml, deployment.environment=prod%20eu"}, tmp_path)
    assert fine.returncode == 0, fine.stderr
    assert "OTEL_RESOURCE_ATTRIBUTES" in fine.stdout and fine.stderr == ""


def test_an_address_the_proxy_cannot_listen_on_stops_serve_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:  # a port in use; and a host that is not this machine's
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for env in (
            {"SPECROUTE_HOST": "127.0.0.1", "SPECROUTE_PORT": str(port)},
            {"SPECROUTE_HOST": "192.0.2.1", "SPECROUTE_PORT": "0"},  # TEST-NET-1: never local
        ):
            result = run(["serve"], {"SPECROUTE_BASE_URLS": "http://127.0.0.1:1", **env}, tmp_path)
            assert result.returncode == 2, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("specroute: SPECROUTE_HOST / SPECROUTE_PORT"), lines
            assert env["SPECROUTE_HOST"] in lines[0] and "startup complete" not in result.stderr


def unreadable_profiles(folder: Path) -> dict[str, tuple[str, str]]:
    """Profiles `specroute serve` cannot read, by case: (SPECROUTE_PROFILE, what the line must say)."""
    (folder / "bad.json").write_text('{"name": "bad", "step": ')
    (folder / "dir.json").mkdir()
    (folder / "list.json").write_text("[1, 2]")
    # A built-in profile copied alone: its step table is looked for beside the copy.
    builtin = Path(__file__).parents[2] / "fleet" / "profiles" / "h200-llama8b.json"
    (folder / "copied.json").write_text(builtin.read_text())
    cases = {
        "bad-json": ("bad.json", "'bad.json' is not valid JSON"),
        "directory": ("dir.json", "cannot read profile file 'dir.json' (IsADirectoryError"),
        "not-an-object": ("list.json", "'list.json' is not a JSON object"),
        "copied-builtin": (
            "copied.json",
            f"cannot read the step table 'h200-llama8b-step-ms.csv', looked for at {folder / 'h200-llama8b-step-ms.csv'}",
        ),
    }
    if os.geteuid() != 0:  # root reads a file whatever its mode
        (folder / "locked.json").write_text("{}")
        (folder / "locked.json").chmod(0)
        cases["permission"] = ("locked.json", "cannot read profile file 'locked.json' (PermissionError")
    return cases


@pytest.mark.parametrize("command", ["serve", "config"])
def test_a_profile_that_cannot_be_read_stops_start_up_with_one_line(command: str, tmp_path: Path) -> None:
    for case, (profile, said) in unreadable_profiles(tmp_path).items():
        result = run([command], {"SPECROUTE_BASE_URLS": "http://127.0.0.1:1", "SPECROUTE_PROFILE": profile}, tmp_path)
        assert result.returncode == 2, (case, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (case, result.stderr)  # no traceback
        assert lines[0].startswith("specroute: invalid setting SPECROUTE_PROFILE: "), (case, lines)
        assert said in lines[0], (case, lines)


def test_an_empty_value_means_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What an uncommented `NAME=` line of deploy/.env.example gives.
    (tmp_path / ".env").write_text(
        "SPECROUTE_BASE_URLS=http://a:1\nSPECROUTE_TRACES=\nSPECROUTE_HOST=\n"
        "SPECROUTE_BASE_API_KEY=\nSPECROUTE_PROFILE=\n"
    )
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert (settings.traces, settings.host, settings.base_api_key, settings.profile) == (None, "127.0.0.1", None, None)


def test_config_masks_a_password_in_the_otlp_endpoint(tmp_path: Path) -> None:
    env = {"SPECROUTE_BASE_URLS": "http://a:1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://user:hunter2@collector:4318"}
    result = run(["config"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout and "collector:4318" in result.stdout


def test_environment_wins_over_dotenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text("SPECROUTE_SPEC_URLS=http://from-dotenv:1\nSPECROUTE_DRAIN_TIMEOUT_S=7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECROUTE_SPEC_URLS", "http://from-env:1/ , http://from-env:2")
    settings = load_settings()
    assert settings.spec_urls == ["http://from-env:1", "http://from-env:2"]
    assert settings.drain_timeout_s == 7


def test_the_same_server_in_both_pools_is_refused() -> None:
    with pytest.raises(SettingsError, match="more than once"):
        load_settings(spec_urls="http://a:1", base_urls="http://a:1")


@pytest.mark.parametrize(
    ("values", "named"),
    [
        # Every spec reading stale before the next poll: `stale` sent all 12 idle requests to base.
        ({"poll_interval_ms": 2000, "stale_ms": 100}, "SPECROUTE_STALE_MS"),
        ({"poll_interval_ms": 600, "stale_ms": 1000}, "SPECROUTE_STALE_MS"),
        ({"outlier_slow_factor": 0.5}, "SPECROUTE_OUTLIER_SLOW_FACTOR"),  # ejects a server as fast as its pool
        ({"num_draft_tokens": 0}, "SPECROUTE_NUM_DRAFT_TOKENS"),
        ({"keep_alive_timeout_s": 1e300}, "SPECROUTE_KEEP_ALIVE_TIMEOUT_S"),  # a 300-digit Keep-Alive header
    ],
)
def test_settings_that_contradict_each_other_are_refused(values: dict[str, float], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        load_settings(base_urls="http://a:1", **values)
    load_settings(base_urls="http://a:1", poll_interval_ms=500, stale_ms=1000, outlier_slow_factor=0)  # the edges pass
    # An ejection longer than the longest is capped at it, as before (a setting users may have).
    load_settings(base_urls="http://a:1", outlier_ejection_s=600)


def test_a_pool_key_is_sent_without_the_whitespace_around_it() -> None:
    """A Secret written with `echo key > file` ends in a newline: every request to the pool
    failed with a 500 ("Forbidden control character detected in headers")."""
    settings = load_settings(base_urls="http://a:1", base_api_key="sk-pool-key\n", spec_api_key=" sk-other ")
    assert settings.base_api_key is not None and settings.base_api_key.get_secret_value() == "sk-pool-key"
    assert settings.spec_api_key is not None and settings.spec_api_key.get_secret_value() == "sk-other"


def test_every_contradiction_is_named_at_once_with_its_values() -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(base_urls="http://a:1", poll_interval_ms=1000, stale_ms=100, outlier_slow_factor=1)
    message = str(refused.value)
    assert "SPECROUTE_STALE_MS (100)" in message and "SPECROUTE_POLL_INTERVAL_MS (1000)" in message
    assert "SPECROUTE_OUTLIER_SLOW_FACTOR (1)" in message


def test_sim_subcommand_is_the_twin_cli(tmp_path: Path) -> None:
    result = run(["sim", "--help"], {}, tmp_path)
    assert result.returncode == 0
    assert "--mode" in result.stdout and "--time-scale" in result.stdout


def test_readme_configuration_table_lists_every_setting() -> None:
    from pydantic import AliasChoices

    from proxy.settings import ENV_PREFIX, Settings

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        variable = alias.choices[-1] if isinstance(alias, AliasChoices) else ENV_PREFIX + name.upper()
        assert f"| `{variable}` |" in readme, f"README's configuration table lacks {variable}"


def test_readme_rows_of_policy_parameters_are_their_declarations() -> None:
    # The policies declare their parameters (policies/*.py, PolicyParams): default and help here
    # come from there, so the table cannot drift from what `specroute config` and the code use.
    from policies import registry
    from proxy.settings import Settings, policy_setting, variable_name

    rows = set((Path(__file__).parents[2] / "README.md").read_text().splitlines())
    expected = []
    for policy, params in registry.declared_params().items():
        for param in params.model_fields:
            name = policy_setting(policy, param)
            field = Settings.model_fields[name]
            expected.append(f"| `{variable_name(name)}` | `{field.default}` | {field.description} |")
    wrong = [row for row in expected if row not in rows]
    assert not wrong, "README's configuration table should have these rows:\n" + "\n".join(wrong)


def test_ctrl_c_stops_serve_and_its_span_export_without_a_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: the proxy drains and exits 130, its
    span export process (its own group) exports what it holds and ends with it, and its body
    worker (in its group, the signal blocked from its start) ends without a traceback."""
    import signal
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECROUTE_", "OTEL_"))}
    env = {
        **clean,
        "SPECROUTE_BASE_URLS": "http://127.0.0.1:9",
        "SPECROUTE_PORT": str(port),
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
    }
    proc = subprocess.Popen(
        SPECROUTE + ["serve"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # As from a terminal: a shell's background job (make test &) inherits SIGINT ignored, and
        # a process started so never gets the KeyboardInterrupt the exit status comes from.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 30
        children: list[int] = []
        while not children and time.monotonic() < deadline:  # ready once the export process runs
            assert proc.poll() is None, proc.communicate()
            children = [
                int(c)
                for task in Path(f"/proc/{proc.pid}/task").iterdir()
                for c in (task / "children").read_text().split()
            ]
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    children = []
            time.sleep(0.05)
        assert children, "no span export process"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert "Traceback" not in err, err

    def gone(child: int) -> bool:
        try:
            return "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            return True

    # multiprocessing's resource tracker (the body worker's) reads until its last writer exits,
    # the proxy: it ends just after it.
    deadline = time.monotonic() + 10
    while not all(gone(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(child) for child in children), children


@pytest.mark.parametrize("export", ["process", "inline"])
def test_a_batch_processor_setting_the_otel_sdk_refuses_stops_start_up(tmp_path: Path, export: str) -> None:
    """A queue smaller than a batch: the SDK refuses it when a batch processor is made. In the
    export child that killed every child as it started and tracing stayed off while the proxy
    looked healthy; now both ways of exporting stop start-up with one line."""
    env = {
        "SPECROUTE_BASE_URLS": "http://127.0.0.1:1",
        "SPECROUTE_PORT": "0",
        "SPECROUTE_TRACE_EXPORT": export,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
    }
    result = run(["serve"], env, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("specroute: OTEL_BSP_* (the span batch processor")
    assert "startup complete" not in result.stderr


def test_the_policy_name_is_case_insensitive_like_the_log_level(tmp_path: Path) -> None:
    # `Goodput` was refused while `INFO` passed; the registry's spelling is what runs.
    result = run(["config"], {"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_POLICY": "Round-Robin"}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "SPECROUTE_POLICY" in result.stdout and "round-robin" in result.stdout.split("SPECROUTE_POLICY", 1)[1]
    assert load_settings(base_urls="http://a:1", policy="GOODPUT").policy == "goodput"
    with pytest.raises(SettingsError, match="SPECROUTE_POLICY") as refused:
        load_settings(base_urls="http://a:1", policy="Fastest")
    from policies import registry

    assert f"choose one of {', '.join(registry.names())}" in str(refused.value)  # the valid names, listed


def test_a_profile_with_negative_step_costs_stops_start_up_naming_the_field(tmp_path: Path) -> None:
    # From an operator's probe: it started cleanly and every prediction came out negative.
    doc = '{"name":"neg","step":{"kind":"affine","fixed_ms":-5,"per_token_ms":-1},"prefill":{"kind":"step"}}'
    (tmp_path / "neg.json").write_text(doc)
    result = run(["serve"], {"SPECROUTE_BASE_URLS": "http://127.0.0.1:1", "SPECROUTE_PROFILE": "neg.json"}, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "specroute: invalid setting SPECROUTE_PROFILE: bad profile file: step.fixed_ms is -5.0;"
        " it must be a finite number >= 0"
    ]


def test_the_cost_models_lull_is_a_setting_inf_the_wall_clock(tmp_path: Path) -> None:
    """SPECROUTE_COSTMODEL_LULL_S reaches the router's cost model: unset, a lull ages what was
    learned by one half-life at most; inf, by the wall clock (as before 2026-12-06)."""
    import math

    from proxy.server import build_app

    base = {"SPECROUTE_BASE_URLS": "http://a:1"}
    for value, ok in (("inf", True), ("30", True), ("0", False), ("nan", False), ("-1", False)):
        result = run(["config"], {**base, "SPECROUTE_COSTMODEL_LULL_S": value}, tmp_path)
        assert (result.returncode == 0) is ok, result.stderr
        if not ok:
            assert "SPECROUTE_COSTMODEL_LULL_S" in result.stderr
    served, wall = (
        build_app(load_settings(base_urls=["http://a:1"], **lull)).router.fleet.cost
        for lull in ({}, {"costmodel_lull_s": math.inf})
    )
    assert served.lull_s == served.half_life_s and wall.lull_s == math.inf
    for cost in (served, wall):
        cost.observe("base", 4, 10.0, now=0.0)
    assert served.clock(600.0) == served.half_life_s and wall.clock(600.0) == 600.0


def test_names_read_in_any_case_and_a_grpc_endpoint_without_a_scheme(tmp_path: Path) -> None:
    """A built-in profile named in capitals is the built-in (policy names are read so too); the
    SDK's gRPC exporter takes `host:port`, so only an HTTP endpoint needs its scheme."""
    env = {
        "SPECROUTE_BASE_URLS": "http://127.0.0.1:1",
        "SPECROUTE_PROFILE": "Kimi-MoE",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "jaeger:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    result = run(["config"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^SPECROUTE_PROFILE +kimi-moe$", result.stdout, re.M), result.stdout


def test_a_check_across_settings_reads_as_one(tmp_path: Path) -> None:
    env = {"SPECROUTE_BASE_URLS": "http://a:1", "SPECROUTE_STALE_MS": "50"}
    result = run(["config"], env, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "specroute: invalid settings: SPECROUTE_STALE_MS (50) must be at least twice SPECROUTE_POLL_INTERVAL_MS (100)"
    )
