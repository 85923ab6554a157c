#!/usr/bin/env bash
# Test-only PKI for tests/unit/core/test_grpc_auth.py (regenerate: bash make_certs.sh). Never use in a cluster.
set -euo pipefail
cd "$(dirname "$0")"
days=36500
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.pem \
    -days $days -subj "/CN=tandem-test-ca" 2>/dev/null
for name in server client other; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout $name.key -out $name.csr \
      -subj "/CN=tandem-internal" 2>/dev/null
  printf "subjectAltName=DNS:tandem-internal\nextendedKeyUsage=serverAuth,clientAuth\n" > $name.ext
  signer=(-CA ca.pem -CAkey ca.key -CAcreateserial)
  [ $name = other ] && signer=(-signkey other.key)   # self-signed: not trusted by ca.pem
  openssl x509 -req -in $name.csr "${signer[@]}" -out $name.pem -days $days -extfile $name.ext 2>/dev/null
  rm $name.csr $name.ext
done
rm -f ca.srl ca.key
