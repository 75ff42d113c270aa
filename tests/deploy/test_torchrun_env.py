"""The compose file and the k8s manifests give every worker torchrun's whole environment: a script's
gloo process group (metrics, barriers) meets at rank 0 on a fixed port (issue 44)."""

from __future__ import annotations

from typing import Any

from test_k8s import by_kind, container, env_of

MASTER_PORT = "29500"


def test_compose_workers_meet_at_rank_0_s_alias(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    for profile in ("cpu", "gpu"):
        workers = {n: s for n, s in services.items() if s.get("profiles") == [profile]}
        assert len(workers) == 2
        for worker in workers.values():
            assert (worker["environment"]["MASTER_ADDR"], worker["environment"]["MASTER_PORT"]) == (
                "rank-0",
                MASTER_PORT,
            )
        # only one profile runs at a time, so rank 0's service of each answers to the one alias
        (rank_0,) = [s for s in workers.values() if s["environment"]["PS_RANK"] == "0"]
        assert rank_0["networks"]["default"]["aliases"] == ["rank-0"]
        assert all("networks" not in s for s in workers.values() if s is not rank_0)


def test_k8s_workers_meet_at_worker_0_through_their_headless_service(rendered_k8s: list[dict[str, Any]]) -> None:
    sts = by_kind(rendered_k8s, "StatefulSet", "worker")
    env = env_of(container(sts))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}",
        MASTER_PORT,
    )
    service = by_kind(rendered_k8s, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: worker-0.worker names the pod
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    # gloo connects every pair of ranks on ports it picks: the workers' policy lets workers in on any port
    policy = by_kind(rendered_k8s, "NetworkPolicy", "worker")["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    (peers,) = [r for r in policy["ingress"] if "from" in r]
    assert "ports" not in peers
    (source,) = peers["from"]
    assert source["podSelector"]["matchLabels"].items() <= labels.items()
