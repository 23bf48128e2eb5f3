#!/usr/bin/env bash
# Installs and starts what cellgate's sandboxes need on a fresh Debian machine:
# the Docker engine (Debian's docker.io), gVisor (runsc, registered as the
# "runsc" runtime with network off), debootstrap for local base images and
# docker-compose for compose.yaml.
# Idempotent: a second run only checks. Needs root for the install steps.
set -euo pipefail

log() { printf '[setup-engine] %s\n' "$*" >&2; }

# gVisor releases older than this break `ls` and `stat` inside a sandbox on
# current kernels (statx fails with EINVAL); bookworm ships 0.0~20221219.
RUNSC_MIN_RELEASE=20240729
# The Debian suite whose runsc (a static binary, no dependencies) is new enough.
RUNSC_SUITE="${CELLGATE_RUNSC_SUITE:-trixie}"

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
# compose.yaml (O1): Debian's docker-compose (bookworm has no compose plugin)
command -v docker-compose >/dev/null 2>&1 || need_pkgs+=(docker-compose)
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing ${need_pkgs[*]}; run this script as root (it uses apt-get)"; exit 1
  fi
  log "installing ${need_pkgs[*]} with apt-get"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_pkgs[@]}" >&2
fi

# The release date of the installed runsc ("runsc version 0.0~20240729.0"), or 0.
runsc_release() {
  command -v runsc >/dev/null 2>&1 || { echo 0; return; }
  runsc --version 2>/dev/null | sed -n 's/^runsc version [^~]*~\{0,1\}\([0-9]\{8\}\).*/\1/p' \
    | head -n1 | grep . || echo 0
}

# The machine's own Debian archive (the entry serving its codename's "main"),
# read from its apt configuration in either format: "URI KEYRING" on stdout.
debian_archive() {
  python3 - "$1" <<'PY'
import glob, sys

codename = sys.argv[1]


def one_line():
    files = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]
    for path in files:
        try:
            lines = open(path).read().splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split("#", 1)[0].split()
            if not words or words[0] != "deb":
                continue
            words, opts = words[1:], {}
            if words and words[0].startswith("["):
                raw = []
                while words:
                    raw.append(words.pop(0))
                    if raw[-1].endswith("]"):
                        break
                for kv in " ".join(raw).strip("[]").split():
                    k, _, v = kv.partition("=")
                    opts[k.lower()] = v
            if len(words) >= 3:
                yield words[0], [words[1]], words[2:], opts.get("signed-by", "")


def deb822():
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        try:
            text = open(path).read()
        except OSError:
            continue
        for stanza in text.split("\n\n"):
            fields, last = {}, ""
            for line in stanza.splitlines():
                if not line.strip() or line.startswith("#"):
                    continue
                if line[0] in " \t" and last:
                    fields[last] += " " + line.strip()
                    continue
                k, _, v = line.partition(":")
                last = k.strip().lower()
                fields[last] = v.strip()
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            for uri in fields.get("uris", "").split():
                suites = fields.get("suites", "").split()
                comps = fields.get("components", "").split()
                yield uri, suites, comps, fields.get("signed-by", "")


for uri, suites, comps, keyring in [*one_line(), *deb822()]:
    if codename in suites and "main" in comps:
        print(uri, keyring if keyring.startswith("/") else "")
        sys.exit(0)
sys.exit(1)
PY
}

# Fetch runsc alone from the newer suite of the machine's own mirror, with a
# throwaway apt configuration (the machine's sources, pins and lists stay as
# they are: nothing else can come from that suite), then install it with dpkg.
install_newer_runsc() {
  local codename uri keyring tmp opts deb
  codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
  if ! read -r uri keyring < <(debian_archive "$codename"); then
    log "no apt source serves '$codename main'; cannot find a Debian mirror for runsc"
    return 1
  fi
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  mkdir -p "$tmp/lists/partial" "$tmp/parts" "$tmp/debs"
  chmod 755 "$tmp" "$tmp/debs"
  printf 'deb %s %s %s main\n' "${keyring:+[signed-by=$keyring]}" "$uri" "$RUNSC_SUITE" \
    >"$tmp/sources.list"
  opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=$tmp/parts"
    -o "Dir::Etc::Preferences=$tmp/none" -o "Dir::Etc::PreferencesParts=$tmp/parts"
    -o "Dir::State::Lists=$tmp/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
    -o APT::Sandbox::User=root)
  log "fetching runsc from $RUNSC_SUITE (the machine's own Debian mirror)"
  apt-get "${opts[@]}" update -q >&2
  (cd "$tmp/debs" && apt-get "${opts[@]}" download -q runsc >&2)
  deb="$(ls "$tmp"/debs/runsc_*.deb)"
  dpkg -i "$deb" >&2
}

ensure_runsc() {
  local have
  have="$(runsc_release)"
  if [ "$have" -ge "$RUNSC_MIN_RELEASE" ]; then
    log "runsc $have is new enough (>= $RUNSC_MIN_RELEASE)"; return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    log "runsc ${have/#0/missing} is older than $RUNSC_MIN_RELEASE (ls and stat fail under it);" \
      "run this script as root to replace it"
    return 1
  fi
  log "runsc ${have/#0/missing}: installing a release >= $RUNSC_MIN_RELEASE"
  install_newer_runsc
  have="$(runsc_release)"
  if [ "$have" -lt "$RUNSC_MIN_RELEASE" ]; then
    log "runsc is still $have after the install; see the output above"; return 1
  fi
  log "installed runsc $have"
}

ensure_runsc

# gVisor runs here only with its network off; --host-uds=open lets a sandbox
# connect to the one host socket it has mounted (its bridge) and nothing else.
ensure_daemon_json() {
  [ "$(id -u)" = 0 ] || return 1
  command -v runsc >/dev/null 2>&1 || return 1
  mkdir -p /etc/docker
  python3 - "$(command -v runsc)" <<'PY'
import json, os, sys
path = "/etc/docker/daemon.json"
try:
    with open(path) as f:
        doc = json.load(f)
except FileNotFoundError:
    doc = {"storage-driver": "overlay2"}
want = {"path": sys.argv[1], "runtimeArgs": ["--network=none", "--host-uds=open"]}
if doc.get("runtimes", {}).get("runsc") == want:
    sys.exit(1)
doc.setdefault("runtimes", {})["runsc"] = want
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
os.replace(tmp, path)
PY
}

if ensure_daemon_json; then
  log "registered the runsc runtime in /etc/docker/daemon.json"
  if pgrep -x dockerd >/dev/null 2>&1; then
    pkill -HUP -x dockerd && log "asked dockerd to reload its runtimes"
    sleep 1
  fi
fi

if docker info >/dev/null 2>&1; then
  log "a Docker engine answers"; exit 0
fi

if [ "$(id -u)" != 0 ]; then
  log "no Docker engine answers and starting one needs root"; exit 1
fi

if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  systemctl start docker || true
fi
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd in the background (log: /var/log/cellgate-dockerd.log)"
  nohup dockerd >/var/log/cellgate-dockerd.log 2>&1 &
fi
for _ in $(seq 1 60); do
  docker info >/dev/null 2>&1 && { log "Docker engine is up"; exit 0; }
  sleep 1
done
log "dockerd did not answer within 60 s; see /var/log/cellgate-dockerd.log"
exit 1
