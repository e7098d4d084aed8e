#!/bin/sh
# A mesh of two brokers with TLS on every link and users that sign in, made from
# nothing on one machine:
#
#   sh examples/secure_mesh/setup.sh /tmp/secure-mesh
#
# Development certificates (meshbus certs: NOT for production), a key pair per broker
# and one user, "game", allowed only what the example client does. Then it prints the
# commands that start the brokers and run the client.
set -eu
MESHBUS=${MESHBUS:-meshbus}
DIR=$(mkdir -p "${1:-secure-mesh}" && cd "${1:-secure-mesh}" && pwd)
cd "$DIR"

$MESHBUS certs --out tls 127.0.0.1 localhost >/dev/null
$MESHBUS keygen --broker --user a --out a.broker.key > brokers.toml 2>/dev/null
$MESHBUS keygen --broker --user b --out b.broker.key >> brokers.toml 2>/dev/null
$MESHBUS keygen --user game --out game.creds \
    --allow 'register=game*,send=multicast:scores,join=multicast:scores' > users.toml 2>/dev/null

# The config both brokers share: TLS, and who may link and sign in. Paths are absolute,
# so the brokers may start anywhere. The broker refuses a config others may change.
umask 077
cat > mesh.toml <<CONFIG
tls-cert = "$DIR/tls/broker.crt"
tls-key = "$DIR/tls/broker.key"
tls-ca = "$DIR/tls/ca.pem"

CONFIG
cat brokers.toml users.toml >> mesh.toml
$MESHBUS broker --check-config mesh.toml >/dev/null

cat <<USAGE
made $DIR: tls/ (ca.pem, broker.crt, broker.key), a.broker.key, b.broker.key, game.creds, mesh.toml
start the brokers:
  meshbus broker --config $DIR/mesh.toml --name a --broker-key $DIR/a.broker.key --listen 127.0.0.1:7401
  meshbus broker --config $DIR/mesh.toml --name b --broker-key $DIR/b.broker.key --listen 127.0.0.1:7402 --seed 127.0.0.1:7401
run the client:
  MESHBUS_BROKER=127.0.0.1:7401,127.0.0.1:7402 MESHBUS_TLS_CA=$DIR/tls/ca.pem MESHBUS_CREDS=$DIR/game.creds python examples/secure_mesh/client.py
USAGE
