"""checkov passes on the rendered deploy/k8s manifests and deploy/docker, with the skips of
deploy/checkov.yaml, each of which carries its reason."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from deploy_tools import CHECKOV_DEFAULT, require_tool
from deployment import REPO, run_tool

CONFIG = REPO / "deploy" / "checkov.yaml"


def run_checkov(files: list[Path], tmp_path: Path) -> dict[str, dict[str, int]]:
    """checkov with deploy/checkov.yaml on ``files``; asserts no failed check and no parsing error.

    Returns:
        check type -> its summary (passed, failed, resource_count, ...).
    """
    checkov = os.environ.get("CHECKOV") or require_tool("checkov", CHECKOV_DEFAULT)
    argv = [checkov, "--config-file", str(CONFIG), "--framework", "kubernetes", "dockerfile", "-o", "json"]
    for path in files:
        argv += ["-f", str(path)]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}  # no mapping download: only registries are reachable
    done = run_tool(argv, timeout=180, cwd=tmp_path, env=env)
    assert done.stdout.strip(), done.stderr
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    summaries = {r["check_type"]: r["summary"] for r in reports}
    assert set(summaries) == {"kubernetes", "dockerfile"}, summaries
    failed = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "\n".join(failed)
    assert all(s["parsing_errors"] == 0 for s in summaries.values()), summaries
    assert done.returncode == 0, done.stderr
    return summaries


def test_checkov_passes(rendered_k8s_yaml: str, tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(rendered_k8s_yaml)
    dockerfiles = sorted((REPO / "deploy" / "docker").glob("*.Dockerfile"))
    summaries = run_checkov([rendered, *dockerfiles], tmp_path)
    assert summaries["kubernetes"]["resource_count"] >= 8 and summaries["dockerfile"]["resource_count"] == 3


def test_checkov_passes_on_the_user_script_overlay_and_image(rendered_user_script_yaml: str, tmp_path: Path) -> None:
    rendered = tmp_path / "user-script.yaml"
    rendered.write_text(rendered_user_script_yaml)
    summaries = run_checkov([rendered, REPO / "deploy" / "docker" / "examples" / "user.Dockerfile"], tmp_path)
    assert summaries["kubernetes"]["resource_count"] >= 9 and summaries["dockerfile"]["resource_count"] == 1


def test_every_skip_has_a_reason() -> None:
    lines = CONFIG.read_text().splitlines()
    start = lines.index("skip-check:")
    reason = False
    skips = 0
    for line in lines[start + 1 :]:
        text = line.strip()
        if text.startswith("#"):
            reason = True
        elif re.fullmatch(r"- CKV2?_[A-Z0-9]+_\d+", text):
            assert reason, f"{text} has no reason above it"
            skips += 1
        elif text:
            break
    assert 0 < skips <= 6, "keep the skip list short"
