"""Read the deployment files the way Docker, compose and Kubernetes do, for tests/deploy.

What a container runs is the image's ENTRYPOINT/CMD and ENV (from its Dockerfile) overridden by
the compose service or the pod spec. :func:`compose_processes` and :func:`k8s_processes` resolve
each service or pod into a :class:`Process`: its argv and environment as the container gets them,
so a test can run them as local processes and the files cannot drift from the commands.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
POD_INDEX_LABEL = "metadata.labels['apps.kubernetes.io/pod-index']"
# Flags being added in parallel to ps-server/ps-worker. Until a command's --help lists one, the
# deployment files already set it, and the parity run drops it for that command (see env_for_local).
PENDING_FLAG_ENV = {"PS_METRICS_PORT", "PS_CHECKPOINT_DIR"}


@dataclass(frozen=True)
class Image:
    """The final stage of a Dockerfile: what a container of it runs by default."""

    dockerfile: Path
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]

    @property
    def command_name(self) -> str:
        """``ps-server`` or ``ps-worker``: the program the image's ENTRYPOINT runs (the worker
        images' ``python -m ps_worker.entrypoint`` runs ps-worker or the user's script)."""
        if self.entrypoint[:3] == ["python", "-m", "ps_worker.entrypoint"]:
            return "ps-worker"
        return Path(self.entrypoint[0]).name if self.entrypoint else ""


@dataclass
class Process:
    """One container (compose service or pod) as argv and environment.

    Attributes:
        name: the service or pod name.
        names: every DNS name others may use for it (ps-0, or ps-0.ps and longer forms).
        image: the image it runs.
        argv: the command line, after ENTRYPOINT/CMD/command/args resolution.
        env: the environment, image ENV overridden by the deployment's.
        health_argv: compose healthcheck test (exec form), if any.
        stop_grace_seconds: how long the deployment waits after SIGTERM before SIGKILL.
        files: a path inside the container -> the file of this host mounted there (compose secrets).
    """

    name: str
    names: set[str]
    image: Image
    argv: list[str]
    env: dict[str, str]
    health_argv: list[str] = field(default_factory=list)
    stop_grace_seconds: float = 10.0
    files: dict[str, str] = field(default_factory=dict)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _exec_form(args: str) -> list[str]:
    if args.startswith("["):
        return list(json.loads(args))
    return ["/bin/sh", "-c", args]


def parse_dockerfile(path: Path) -> Image:
    """The final stage's ENTRYPOINT, CMD and ENV (PATH left out: it names the image's venv).

    Raises:
        ValueError: an ENV value refers to another variable (not resolved here).
    """
    instructions = _instructions(path.read_text())
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    entrypoint: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = {}
    for word, args in instructions[last_from + 1 :]:
        if word == "ENTRYPOINT":
            entrypoint, cmd = _exec_form(args), []
        elif word == "CMD":
            cmd = _exec_form(args)
        elif word == "ENV":
            parts = shlex.split(args)
            pairs = [p.split("=", 1) for p in parts] if "=" in parts[0] else [[parts[0], " ".join(parts[1:])]]
            for key, value in pairs:
                if key == "PATH":
                    continue
                if "$" in value:
                    raise ValueError(f"{path}: ENV {key}={value} refers to a variable; resolve it here first.")
                env[key] = value
    return Image(path, entrypoint, cmd, env)


def run_tool(argv: list[str], timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command with a timeout, capturing text output."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


ENTRYPOINT_ENV = {"PS_SCRIPT", "PS_MODULE"}
"""What the worker images' entry point reads (ps_worker.entrypoint), beside ps-worker's own twins."""


def compose_config(
    docker_compose: str, env_file: Path, overrides: tuple[Path, ...] = (), env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``docker-compose config`` output: the model compose runs, interpolated and merged (with the
    ``overrides`` files after docker-compose.yml, as ``-f`` would; ``env`` the variables compose sees)."""
    files = [arg for path in (REPO / "docker-compose.yml", *overrides) for arg in ("-f", str(path))]
    done = run_tool([docker_compose, *files, "--env-file", str(env_file), "config"], cwd=REPO, env=env)
    if done.returncode != 0:
        raise AssertionError(f"docker-compose config failed:\n{done.stderr}")
    return yaml.safe_load(done.stdout)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a .env file (comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def image_by_name(config: dict[str, Any]) -> dict[str, Image]:
    """Image name -> parsed Dockerfile, for every compose service that builds one."""
    images: dict[str, Image] = {}
    for service in config["services"].values():
        build = service.get("build")
        if build:
            context = Path(build["context"])
            images[service["image"]] = parse_dockerfile(context / build.get("dockerfile", "Dockerfile"))
    return images


def _docker_argv(image: Image, entrypoint: list[str] | None, command: list[str] | None) -> list[str]:
    """Docker's rule: an overridden entrypoint drops the image's CMD."""
    if isinstance(entrypoint, str) or isinstance(command, str):
        raise ValueError("use the exec (list) form for entrypoint and command")
    head = entrypoint if entrypoint is not None else image.entrypoint
    tail = command if command is not None else (image.cmd if entrypoint is None else [])
    return [*head, *tail]


def _seconds(value: str | int | float | None, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, int | float):
        return float(value)
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def compose_processes(config: dict[str, Any], profiles: set[str]) -> list[Process]:
    """The services ``docker compose up`` starts with ``profiles`` that run an image built here."""
    images = image_by_name(config)
    processes = []
    for name, service in config["services"].items():
        service_profiles = set(service.get("profiles", []))
        if (service_profiles and not service_profiles & profiles) or service["image"] not in images:
            continue
        image = images[service["image"]]
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        test = service.get("healthcheck", {}).get("test", [])
        if test and test[0] not in ("CMD", "NONE"):
            raise ValueError(f"{name}: use the CMD exec form for the healthcheck test")
        processes.append(
            Process(
                name=name,
                names={name, *service.get("hostname", "").split()},
                image=image,
                argv=_docker_argv(image, service.get("entrypoint"), service.get("command")),
                env={**image.env, **{k: str(v) for k, v in environment.items()}},
                health_argv=list(test[1:]) if test[:1] == ["CMD"] else [],
                stop_grace_seconds=_seconds(service.get("stop_grace_period"), 10.0),
                files=_compose_secrets(service, config.get("secrets", {})),
            )
        )
    return processes


def _compose_secrets(service: dict[str, Any], secrets: dict[str, Any]) -> dict[str, str]:
    """Where compose mounts a service's secrets (``/run/secrets/TARGET``) -> their files on this host."""
    files = {}
    for entry in service.get("secrets", []):
        source = entry if isinstance(entry, str) else entry["source"]
        target = source if isinstance(entry, str) else entry.get("target") or source
        files[target if target.startswith("/") else f"/run/secrets/{target}"] = secrets[source]["file"]
    return files


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args; $$ escapes; unknown names stay."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def k8s_processes(resources: list[dict[str, Any]], images: dict[str, Image]) -> list[Process]:
    """Every pod of every StatefulSet in rendered manifests, as a :class:`Process`."""
    by_kind_name = {(r["kind"], r["metadata"]["name"]): r for r in resources}
    processes = []
    for sts in (r for r in resources if r["kind"] == "StatefulSet"):
        spec = sts["spec"]
        pod_spec = spec["template"]["spec"]
        (container,) = pod_spec["containers"]
        if container["image"] not in images:
            raise AssertionError(f"{container['image']} is not built by any docker-compose.yml service")
        image = images[container["image"]]
        namespace = sts["metadata"].get("namespace", "default")
        for ordinal in range(spec["replicas"]):
            pod = f"{sts['metadata']['name']}-{ordinal}"
            env = dict(image.env)
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    env.update(by_kind_name[("ConfigMap", source["configMapRef"]["name"])]["data"])
                elif "secretRef" in source:
                    secret = by_kind_name[("Secret", source["secretRef"]["name"])]
                    env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
                else:
                    raise NotImplementedError(f"envFrom {source}")
            for item in container.get("env", []):
                env[item["name"]] = _k8s_env_value(item, pod, ordinal, env, by_kind_name)
            command = [_k8s_expand(a, env) for a in container["command"]] if "command" in container else None
            args = [_k8s_expand(a, env) for a in container["args"]] if "args" in container else None
            governing = spec["serviceName"]
            fqdn = f"{pod}.{governing}.{namespace}.svc"
            processes.append(
                Process(
                    name=pod,
                    names={f"{pod}.{governing}", f"{pod}.{governing}.{namespace}", fqdn, f"{fqdn}.cluster.local"},
                    image=image,
                    argv=_docker_argv(image, command, args),
                    env=env,
                    health_argv=_grpc_probe_argv(container.get("readinessProbe")),
                    stop_grace_seconds=float(pod_spec.get("terminationGracePeriodSeconds", 30)),
                )
            )
    return processes


def _grpc_probe_argv(probe: dict[str, Any] | None) -> list[str]:
    """The kubelet's grpc probe, asked instead by the image's own checker (same Health.Check call)."""
    if not probe:
        return []
    if "grpc" not in probe:
        raise NotImplementedError(f"only grpc readiness probes are emulated, not {probe}")
    argv = ["python", "-m", "ps_server.healthcheck", f"127.0.0.1:{probe['grpc']['port']}"]
    service = probe["grpc"].get("service")
    return [*argv, "--service", service] if service else argv


def _k8s_env_value(
    item: dict[str, Any], pod: str, ordinal: int, env: dict[str, str], by_kind_name: dict[tuple[str, str], Any]
) -> str:
    if "value" in item:
        return _k8s_expand(str(item["value"]), env)
    source = item["valueFrom"]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        if path == POD_INDEX_LABEL:
            return str(ordinal)
        if path == "metadata.name":
            return pod
        raise NotImplementedError(f"fieldRef {path}")
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return base64.b64decode(by_kind_name[("Secret", ref["name"])]["data"][ref["key"]]).decode()
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return by_kind_name[("ConfigMap", ref["name"])]["data"][ref["key"]]
    raise NotImplementedError(f"valueFrom {source}")


def help_env_names(command: str) -> set[str]:
    """The ``PS_*`` twins that ``command --help`` lists (``[env PS_X]``)."""
    done = run_tool([str(VENV_BIN / command), "--help"], timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"{command} --help failed:\n{done.stderr}")
    return set(re.findall(r"\[env (PS_[A-Z0-9_]+)\]", " ".join(done.stdout.split())))
