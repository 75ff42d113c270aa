#!/usr/bin/env bash
# Move a stopped compose job's checkpoints from S shards onto N shards
# (docs/operations.md#reshard-restore-a-job-onto-another-shard-count):
#
#   docker compose down                              # no -v: the checkpoint volumes stay
#   deploy/compose/reshard.sh [-p PROJECT] --from 2 --to 3
#   docker compose -f docker-compose.yml -f deploy/compose/three-shards.yml up
#
# Each shard keeps its checkpoints on its own volume, PROJECT_ps-K-checkpoints. In one container of
# the server image (no network) this copies shard K's files from volume K (K < S) into one scratch
# directory, runs `ps-admin reshard --from SCRATCH --to N --out OUT`, moves the top-level checkpoint
# files of every volume into its folder before-reshard-vV-S-shards/ (a shard loads the newest file
# of its index, so they must not stay beside the new ones; move them back to roll back), and copies
# OUT/shard-K-vV.pt into volume K (K < N), creating the volumes of new shards as compose would.
# Refuses, changing nothing, while a container of the project runs or when a volume K < S is
# missing; a refusal of ps-admin reshard (its reason on stderr) also changes nothing.
#
# Options: -p/--project-name NAME (default: $COMPOSE_PROJECT_NAME, else this checkout's folder
# name, as compose names it), --image IMAGE (default grpc-ps-server:0.1.0). $DOCKER: the docker CLI.
# Exit status: 0 done (the last line names the version), 1 refused or failed, 2 bad arguments.
set -euo pipefail

DOCKER=${DOCKER:-docker}
project=${COMPOSE_PROJECT_NAME:-}
image=grpc-ps-server:0.1.0
from="" to=""
usage() { echo "usage: $0 [-p PROJECT] --from S --to N [--image IMAGE]" >&2; exit 2; }
while (($#)); do
    case $1 in
    -p | --project-name) project=${2:-}; shift 2 || usage ;;
    --from) from=${2:-}; shift 2 || usage ;;
    --to) to=${2:-}; shift 2 || usage ;;
    --image) image=${2:-}; shift 2 || usage ;;
    *) usage ;;
    esac
done
[[ $from =~ ^[1-9][0-9]*$ && $to =~ ^[1-9][0-9]*$ ]] || usage
if [[ -z $project ]]; then
    project=$(basename "$(cd "$(dirname "$0")/../.." && pwd)" | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9_-')
fi
[[ -n $project ]] || usage

running=$(timeout 60 "$DOCKER" ps -q --filter "label=com.docker.compose.project=$project")
if [[ -n $running ]]; then
    echo "$0: containers of project $project are running; stop the job first (docker compose down, no -v)" >&2
    exit 1
fi
mounts=()
for ((k = 0; k < (from > to ? from : to); k++)); do
    volume="${project}_ps-$k-checkpoints"
    if ! timeout 60 "$DOCKER" volume inspect "$volume" >/dev/null 2>&1; then
        if ((k < from)); then
            echo "$0: no volume $volume: is $project the project of the $from-shard job (-p)?" >&2
            exit 1
        fi
        # Labelled as compose labels the volumes it creates, so that `up` adopts it without a warning.
        timeout 60 "$DOCKER" volume create --label "com.docker.compose.project=$project" \
            --label "com.docker.compose.volume=ps-$k-checkpoints" "$volume" >/dev/null
    fi
    mounts+=(-v "$volume:/volumes/$k")
done

# Root in the container: a volume created above is root's; every file is given back to the image's
# user (the shards' uid) at the end.
# shellcheck disable=SC2016  # expanded by the container's shell
timeout 900 "$DOCKER" run --rm --network none --user 0:0 "${mounts[@]}" --entrypoint sh "$image" -c '
set -eu
from=$1 to=$2 count=$(( $1 > $2 ? $1 : $2 ))
scratch=$(mktemp -d) out=$(mktemp -d)/out
k=0
while [ "$k" -lt "$from" ]; do
    for f in /volumes/$k/shard-$k-v*.pt; do if [ -f "$f" ]; then cp "$f" "$scratch/"; fi; done
    k=$((k + 1))
done
ps-admin reshard --from "$scratch" --to "$to" --out "$out"
version=$(ls "$out" | sed -n "s/^shard-0-v0*\([0-9][0-9]*\)\.pt$/\1/p")
[ -n "$version" ] || { echo "reshard.sh: no shard-0 file in $out" >&2; exit 1; }
k=0
while [ "$k" -lt "$count" ]; do
    old=/volumes/$k/before-reshard-v$version-$from-shards
    for f in /volumes/$k/shard-*-v*.pt; do
        [ -f "$f" ] || continue
        mkdir -p "$old"
        mv "$f" "$old/"
    done
    if [ "$k" -lt "$to" ]; then
        for f in "$out"/shard-$k-v*.pt; do
            cp "$f" "/volumes/$k/.shard-$k-reshard.tmp"
            mv "/volumes/$k/.shard-$k-reshard.tmp" "/volumes/$k/$(basename "$f")"
        done
    fi
    chown -R grpc-ps:grpc-ps "/volumes/$k"
    k=$((k + 1))
done
echo "reshard.sh: version $version of $from shards is now on $to shards (volumes ps-0..ps-$((to - 1))-checkpoints)"
' reshard "$from" "$to"
