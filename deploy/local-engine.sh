#!/usr/bin/env bash
# A Docker engine for grpc-ps on a Debian machine with no container registry and no systemd
# (a CI runner, a sandbox): everything the images need is made from Debian packages and from
# the wheels pip can already get on the host.
#
#   deploy/local-engine.sh up      install docker.io and docker-compose (Debian), start dockerd,
#                                  build the base image (debootstrap), serve the wheels on
#                                  127.0.0.1, build grpc-ps-server, grpc-ps-worker and a
#                                  Prometheus image, each once; writes $STATE/engine.env
#   deploy/local-engine.sh run CMD...
#                                  up, then CMD with engine.env exported, then down, whatever
#                                  happens (a trap): .ci/run runs the test suite this way
#   deploy/local-engine.sh down    remove the containers, networks and volumes of compose
#                                  projects named grpc-ps-ci-*, stop the wheel server, and, when
#                                  `up` started dockerd, stop it by its PID and remove the bridge
#                                  and iptables rules it created. Idempotent; never fails.
#
# Run as root (or with sudo available). Every docker command runs under `timeout`. What is kept
# between runs, so that a second `up` takes seconds: the Debian packages, the images and their
# layers (in /var/lib/docker), and the wheels in $CACHE. Environment:
#   GRPC_PS_ENGINE_STATE  state directory (default /var/tmp/grpc-ps-engine): PIDs, logs, engine.env
#   GRPC_PS_ENGINE_CACHE  wheel cache (default /var/cache/grpc-ps-engine)
#   GRPC_PS_BASE_IMAGE    base image to build on (default grpc-ps-base:bookworm, made by debootstrap
#                         when absent); Debian bookworm with python3, python3-venv, python-is-python3
#   DEBIAN_MIRROR         debootstrap's mirror (default http://deb.debian.org/debian)
#   GRPC_PS_INDEX_PORT    port of the wheel index on 127.0.0.1 (default 47631; a free one if taken)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
STATE=${GRPC_PS_ENGINE_STATE:-/var/tmp/grpc-ps-engine}
CACHE=${GRPC_PS_ENGINE_CACHE:-/var/cache/grpc-ps-engine}
BASE_IMAGE=${GRPC_PS_BASE_IMAGE:-grpc-ps-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=2.13.0
PROMETHEUS_IMAGE=grpc-ps-prometheus:ci
INDEX_PORT=${GRPC_PS_INDEX_PORT:-47631}
# Debian's CLI (20.10, the daemon's version), not whatever else is first on PATH: a newer CLI
# without the buildx plugin would fall back to the legacy builder with a warning anyway.
DOCKER=/usr/bin/docker
export DOCKER_HOST=unix:///var/run/docker.sock
# The legacy builder: BuildKit (compose v2's default) would try to fetch a frontend from a registry
# for any `# syntax=` line; the legacy builder needs nothing beyond the base image.
export DOCKER_BUILDKIT=0

started=$SECONDS
step() { printf 'local-engine [%4ds] %s\n' "$((SECONDS - started))" "$*"; }
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"

apt_install() {
    local missing=() pkg
    for pkg in "$@"; do dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg"); done
    ((${#missing[@]})) || return 0
    step "apt-get install ${missing[*]}"
    # No service may start from a package's postinst (no systemd here; dockerd is started below).
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy" && made_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 $sudo apt-get update -qq
    timeout 600 $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    ((made_policy)) && $sudo rm -f "$policy"
    return 0
}

docker_ok() { timeout 20 $DOCKER info >/dev/null 2>&1; }

start_dockerd() {
    if docker_ok; then
        step "dockerd: already answering on $DOCKER_HOST; using it (it will not be stopped)"
        return 0
    fi
    # Which iptables chains and bridges exist before: `down` removes only what this dockerd added.
    { iptables -S 2>/dev/null; iptables -t nat -S 2>/dev/null; } >"$STATE/iptables.before" || true
    # dockerd also turns on IP forwarding and sets the FORWARD policy to DROP: both are put back.
    cat /proc/sys/net/ipv4/ip_forward >"$STATE/ip_forward.before" 2>/dev/null || true
    ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' >"$STATE/bridges.before" || true
    step "dockerd: starting (log $STATE/dockerd.log)"
    rm -f "$STATE/dockerd.pid"
    setsid "$(command -v dockerd || echo /usr/sbin/dockerd)" --pidfile "$STATE/dockerd.pid" -H "$DOCKER_HOST" </dev/null >"$STATE/dockerd.log" 2>&1 &
    local launcher=$! deadline=$((SECONDS + 90))
    until docker_ok; do
        if ! kill -0 "$launcher" 2>/dev/null && ! { [[ -s $STATE/dockerd.pid ]] && kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null; }; then
            tail -n 40 "$STATE/dockerd.log" >&2
            echo "local-engine: dockerd exited at start (log above)" >&2
            return 1
        fi
        if ((SECONDS > deadline)); then
            tail -n 40 "$STATE/dockerd.log" >&2
            echo "local-engine: dockerd did not answer within 90 s (log above)" >&2
            return 1
        fi
        sleep 1
    done
    # Its own PID (from its pidfile), by which `down` stops it.
    cp "$STATE/dockerd.pid" "$STATE/dockerd.started"
    step "dockerd: up, pid $(cat "$STATE/dockerd.started")"
}

build_base_image() {
    if timeout 30 $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        step "base image $BASE_IMAGE: present"
        return 0
    fi
    if [[ $BASE_IMAGE != grpc-ps-base:bookworm ]]; then
        echo "local-engine: base image $BASE_IMAGE is not in the engine (docker load or import it first)" >&2
        return 1
    fi
    apt_install debootstrap
    local rootfs="$STATE/rootfs"
    $sudo rm -rf "$rootfs"
    step "base image: debootstrap bookworm (minbase + python3) from $MIRROR"
    timeout 900 $sudo debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
        bookworm "$rootfs" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 || {
        tail -n 30 "$STATE/debootstrap.log" >&2
        return 1
    }
    # The certificate authorities this host added locally (e.g. an egress proxy's), so that
    # HTTPS from a build behaves as on the host. Stays in this local image; never committed.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        $sudo cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        $sudo chroot "$rootfs" update-ca-certificates >/dev/null
    fi
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' | $sudo tee "$rootfs/etc/pip.conf" >/dev/null
    $sudo rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    step "base image: docker import -> $BASE_IMAGE"
    $sudo tar -C "$rootfs" -c . | timeout 300 $DOCKER import -c 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" >/dev/null
    $sudo rm -rf "$rootfs"
}

serve_wheels() {
    # torch (the CPU wheel) and every dependency of grpc-ps and of its build, as pip on this host
    # resolves them, laid out as a PEP 503 index: simple/<normalized name>/<files>.
    local wheels="$CACHE/wheels" index="$CACHE/index"
    # One resolution, with torch pinned: grpc-ps alone allows torch<3, and pip would pick the newest
    # torch and its CUDA wheels (gigabytes). A fresh directory each time, so the index holds exactly
    # this resolution; pip's own cache makes a second download quick.
    rm -rf "$wheels" && mkdir -p "$wheels"
    step "wheels: pip download torch==$TORCH_VERSION, grpc-ps's dependencies, setuptools -> $wheels"
    timeout 900 python3 -m pip download --quiet --disable-pip-version-check --dest "$wheels" \
        "torch==$TORCH_VERSION" "setuptools>=68" wheel "$REPO"
    rm -f "$wheels"/grpc[-_]ps-*
    if compgen -G "$wheels/nvidia*" >/dev/null || [[ $(find "$wheels" -name 'torch-*' | wc -l) -ne 1 ]]; then
        echo "local-engine: the wheels hold CUDA packages or several torch versions: $(ls "$wheels")" >&2
        return 1
    fi
    rm -rf "$index" && mkdir -p "$index/simple"
    local file name
    for file in "$wheels"/*; do
        name=$(basename "$file" | sed -E 's/^([A-Za-z0-9_.]+)-[0-9].*/\1/' | tr 'A-Z_.' 'a-z--')
        mkdir -p "$index/simple/$name"
        ln -f "$file" "$index/simple/$name/" 2>/dev/null || cp "$file" "$index/simple/$name/"
    done
    # A fixed port when it is free: the index URL is a build argument, and a new one each run would
    # make docker rebuild every layer after it (torch included) instead of using its cache.
    local port
    port=$(python3 -c '
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' "$INDEX_PORT")
    setsid python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" </dev/null >"$STATE/index.log" 2>&1 &
    echo $! >"$STATE/index.pid"
    INDEX_URL="http://127.0.0.1:$port/simple"
    local deadline=$((SECONDS + 30))
    until python3 -c "import urllib.request as u; u.urlopen('$INDEX_URL/torch/', timeout=5)" 2>/dev/null; do
        ((SECONDS < deadline)) || { echo "local-engine: the wheel index did not answer on $INDEX_URL" >&2; return 1; }
        sleep 0.5
    done
    step "wheels: $(ls "$wheels" | wc -l) files, $(du -sh "$wheels" | cut -f1), served on $INDEX_URL"
}

build_image() {  # dockerfile tag context [docker build options]
    step "docker build $2 ($1)"
    local t0=$SECONDS
    if ! timeout 1200 $DOCKER build --network host "${@:4}" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --build-arg "TORCH_INDEX_URL=$INDEX_URL" \
        --build-arg "PIP_INDEX_URL=$INDEX_URL" \
        -f "$1" -t "$2" "$3" >"$STATE/build-${2%%:*}.log" 2>&1; then
        tail -n 40 "$STATE/build-${2%%:*}.log" >&2
        echo "local-engine: docker build $2 failed (log above)" >&2
        return 1
    fi
    step "docker build $2: done in $((SECONDS - t0)) s"
}

cmd_up() {
    $sudo mkdir -p "$STATE" "$CACHE"
    rm -f "$STATE/engine.env"
    apt_install docker.io docker-compose iptables prometheus
    start_dockerd
    build_base_image
    serve_wheels
    build_image "$REPO/deploy/docker/server.Dockerfile" grpc-ps-server:0.1.0 "$REPO"
    build_image "$REPO/deploy/docker/worker.Dockerfile" grpc-ps-worker:0.1.0 "$REPO"
    # Prometheus: its official image cannot be pulled here; this one carries Debian's binary.
    local ctx="$STATE/prometheus-context"
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp "$(command -v prometheus)" "$ctx/prometheus"
    build_image "$REPO/.ci/prometheus.Dockerfile" "$PROMETHEUS_IMAGE" "$ctx"
    rm -rf "$ctx"
    # The build stage (the same in both images) gets a tag: untagged, it would be dangling, and the
    # prune below would take the layer cache of the next build with it.
    build_image "$REPO/deploy/docker/server.Dockerfile" grpc-ps-build:cache "$REPO" --target build
    # What rebuilt tags left behind, on an engine of our own only.
    [[ -s $STATE/dockerd.started ]] && timeout 120 $DOCKER image prune -f >/dev/null
    # The images are built; the index is not needed by `up --no-build`.
    stop_pidfile "$STATE/index.pid"
    cat >"$STATE/engine.env" <<EOF
GRPC_PS_ENGINE=1
DOCKER_HOST=$DOCKER_HOST
GRPC_PS_DOCKER=$DOCKER
GRPC_PS_COMPOSE=$(command -v docker-compose)
GRPC_PS_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE
EOF
    step "ready: $STATE/engine.env"
    timeout 30 $DOCKER image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^grpc-ps' || true
}

stop_pidfile() {  # pidfile [grace seconds]
    local pid
    [[ -s $1 ]] || return 0
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + ${2:-10}))
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

remove_network_rules() {
    # The iptables rules and chains, and the bridges, that this dockerd added (not there before).
    local table line chain br
    for table in filter nat; do
        iptables -t "$table" -S 2>/dev/null | grep -E '^-A .*(DOCKER|docker0|br-[0-9a-f]{12})' |
            while read -r line; do
                grep -qxF -- "$line" "$STATE/iptables.before" 2>/dev/null && continue
                eval "iptables -t $table ${line/#-A/-D}" 2>/dev/null || true
            done
        for chain in $(iptables -t "$table" -S 2>/dev/null | awk '/^-N DOCKER/{print $2}'); do
            grep -qxF -- "-N $chain" "$STATE/iptables.before" 2>/dev/null && continue
            iptables -t "$table" -F "$chain" 2>/dev/null || true
        done
        for chain in $(iptables -t "$table" -S 2>/dev/null | awk '/^-N DOCKER/{print $2}'); do
            grep -qxF -- "-N $chain" "$STATE/iptables.before" 2>/dev/null && continue
            iptables -t "$table" -X "$chain" 2>/dev/null || true
        done
    done
    local policy
    policy=$(awk '$1 == "-P" && $2 == "FORWARD" {print $3; exit}' "$STATE/iptables.before" 2>/dev/null)
    [[ -n $policy ]] && iptables -P FORWARD "$policy" 2>/dev/null
    [[ -s $STATE/ip_forward.before ]] && cat "$STATE/ip_forward.before" >/proc/sys/net/ipv4/ip_forward 2>/dev/null
    for br in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^(docker0|br-[0-9a-f]{12})$'); do
        grep -qxF "$br" "$STATE/bridges.before" 2>/dev/null && continue
        ip link delete "$br" 2>/dev/null || true
    done
}

cmd_down() {
    set +e
    [[ -d $STATE ]] || return 0
    stop_pidfile "$STATE/index.pid"
    if docker_ok; then
        local projects project
        projects=$({
            timeout 30 $DOCKER ps -a --format '{{.Label "com.docker.compose.project"}}'
            timeout 30 $DOCKER network ls --format '{{.Label "com.docker.compose.project"}}'
            timeout 30 $DOCKER volume ls --format '{{.Label "com.docker.compose.project"}}'
        } | grep -E '^grpc-ps-ci-' | sort -u)
        for project in $projects; do
            step "removing compose project $project"
            timeout 60 $DOCKER ps -aq --filter "label=com.docker.compose.project=$project" | xargs -r timeout 120 $DOCKER rm -f >/dev/null
            timeout 60 $DOCKER network ls -q --filter "label=com.docker.compose.project=$project" | xargs -r timeout 60 $DOCKER network rm >/dev/null
            timeout 60 $DOCKER volume ls -q --filter "label=com.docker.compose.project=$project" | xargs -r timeout 60 $DOCKER volume rm -f >/dev/null
        done
    fi
    if [[ -s $STATE/dockerd.started ]]; then
        local pid containerd
        pid=$(cat "$STATE/dockerd.started")
        # The containerd this dockerd started for itself (it stops it on SIGTERM; make sure).
        containerd=$(pgrep -P "$pid" -x containerd 2>/dev/null)
        step "dockerd: stopping pid $pid"
        echo "$pid" >"$STATE/dockerd.stop"
        stop_pidfile "$STATE/dockerd.stop" 30
        [[ -n $containerd ]] && echo "$containerd" >"$STATE/containerd.stop" && stop_pidfile "$STATE/containerd.stop" 10
        remove_network_rules
        rm -f "$STATE/dockerd.started" "$STATE/dockerd.pid"
    fi
    rm -f "$STATE/engine.env"
    step "down"
    return 0
}

cmd_run() {
    trap 'cmd_down' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    cmd_up
    set -a
    # shellcheck disable=SC1091
    . "$STATE/engine.env"
    set +a
    step "running: $*"
    local code=0
    "$@" || code=$?
    step "$1 exited $code"
    return "$code"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
run)
    shift
    (($#)) || { echo "usage: $0 run CMD..." >&2; exit 2; }
    cmd_run "$@"
    ;;
*)
    echo "usage: $0 up|down|run CMD..." >&2
    exit 2
    ;;
esac
