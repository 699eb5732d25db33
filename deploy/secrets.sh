#!/usr/bin/env bash
# Makes every secret docker-compose.yml needs, once, in ./secrets (an existing file is kept):
#   api_keys        REST keys, one per line (hand them to your API users)
#   verifier_keys   gRPC verifier keys for edge devices, one per line
#   verifier_key    the gateway's own verifier key (exempt from the per-key limits)
#   metrics_keys    keys of the scrapers allowed to read the gateway's /metrics
#   salt_secret     the cache-salt secret: tenants' cached prompts are partitioned by it
#   ray_token       Ray's cluster token (RAY_AUTH_MODE=token)
#   ca.crt, ca.key  a private CA; tls.crt, tls.key: the services' certificate, signed by it, valid for every
#                   service name (verifier, gateway, cpu, localhost, 127.0.0.1) and for the names in $TANDEM_TLS_NAMES
# Usage: deploy/secrets.sh [DIR]   (default: ./secrets). Needs openssl.
set -euo pipefail
dir=${1:-secrets}
mkdir -p "$dir"
chmod 700 "$dir"
umask 077
token() { openssl rand -base64 32 | tr -d '/+=\n' | cut -c1-40; }
for f in api_keys verifier_keys metrics_keys; do
    [ -s "$dir/$f" ] || printf '%s\n' "$(token)" > "$dir/$f"
done
[ -s "$dir/verifier_key" ] || printf '%s\n' "$(token)" > "$dir/verifier_key"
[ -s "$dir/salt_secret" ] || printf '%s\n' "$(token)" > "$dir/salt_secret"
[ -s "$dir/ray_token" ] || printf '%s\n' "$(token)" > "$dir/ray_token"
if [ ! -s "$dir/tls.crt" ]; then
    names="DNS:verifier,DNS:gateway,DNS:cpu,DNS:localhost,IP:127.0.0.1"
    for n in ${TANDEM_TLS_NAMES:-}; do names="$names,DNS:$n"; done
    openssl req -x509 -newkey rsa:3072 -nodes -days 825 -subj "/CN=tandem private CA" \
        -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
    openssl req -newkey rsa:3072 -nodes -subj "/CN=tandem" -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$names" > "$dir/tls.ext"
    openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -days 825 \
        -extfile "$dir/tls.ext" -out "$dir/tls.crt" 2>/dev/null
    rm -f "$dir/tls.csr" "$dir/tls.ext" "$dir/ca.srl"
fi
# the folder stays private to you; containers (user 10001) read the files it bind-mounts; the CA's key is not mounted
chmod 644 "$dir"/*
chmod 600 "$dir/ca.key"
echo "secrets in $dir: REST key $(head -1 "$dir/api_keys"); edge devices use a line of $dir/verifier_keys and $dir/ca.crt"
