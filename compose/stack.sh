#!/usr/bin/env bash
# The local tolk stack without Docker: a single-node Apache Kafka 4.x broker (KRaft,
# broker+controller in one JVM, jars from Maven Central) and a redis-server, both on loopback.
#
#   bash compose/stack.sh up       start what is not running (idempotent), wait until it answers
#   bash compose/stack.sh down     stop both cleanly
#   bash compose/stack.sh status   say what runs; exit 0 only when both answer
#   bash compose/stack.sh clean    down, then delete the broker's and redis' data (keeps the jars)
#   bash compose/stack.sh observability-up | observability-down
#                                  only Prometheus (Debian's package, apt-get installs it if
#                                  missing), scraping the workers and `tolk load` on loopback;
#                                  'up' starts it too with TOLK_OBSERVABILITY=1, 'down' stops it
#   bash compose/stack.sh registry-up | registry-down
#                                  only the Schema Registry (Apicurio, compose/registry/pom.xml,
#                                  built with mvn once): http://127.0.0.1:8085/apis/ccompat/v7;
#                                  'up' starts it too with TOLK_REGISTRY=1, 'down' stops it
#
# Environment (all optional):
#   TOLK_STATE_DIR               state dir (default ~/.local/state/tolk): jars, data, logs, pidfiles
#   TOLK_KAFKA_PORT              broker listener on 127.0.0.1 (default 9092)
#   TOLK_KAFKA_CONTROLLER_PORT   KRaft controller listener on 127.0.0.1 (default 9093)
#   TOLK_REDIS_PORT              redis on 127.0.0.1 (default 6379)
#   TOLK_REDIS_MAXMEMORY         redis 'maxmemory' (default 256mb); past it redis evicts the least
#                                recently used keys (allkeys-lru): translation-cache entries and
#                                stored replies, both optimisations, never refused writes
#   TOLK_KAFKA_HEAP              JVM heap options (default "-Xmx512m -Xms256m")
#   TOLK_OBSERVABILITY           1: 'up' also starts Prometheus (as 'observability-up' does)
#   TOLK_PROMETHEUS_PORT         Prometheus on 127.0.0.1 (default 9090)
#   TOLK_PROMETHEUS_TARGETS      worker metrics ports it scrapes (default 127.0.0.1:9400; comma list)
#   TOLK_PROMETHEUS_LOAD_TARGETS `tolk load` metrics ports it scrapes (default 127.0.0.1:9402)
#   TOLK_PROMETHEUS_SCRAPE_INTERVAL  scrape interval (default 5s)
#   TOLK_REGISTRY                1: 'up' also starts the Schema Registry (as 'registry-up' does)
#   TOLK_REGISTRY_PORT           the registry on 127.0.0.1 (default 8085)
#   TOLK_START_TIMEOUT           seconds to wait for each service to answer (default 120)
#   TOLK_PYTHON                  a python with confluent_kafka for the broker readiness check
#   TOLK_KAFKA_SECURITY          plaintext (default) or sasl_ssl: the broker port becomes a
#                                SASL_SSL listener (SCRAM-SHA-512, TLS with a CA made here by
#                                openssl), the controller listener SSL with client certificates
#   TOLK_KAFKA_USER              the SCRAM user of the clients (default tolk)
#   TOLK_KAFKA_PASSWORD          its password (default: generated into <state>/secrets, 0600)
#   TOLK_REDIS_PASSWORD          redis 'requirepass' (default: none; generated in sasl_ssl mode)
#   TOLK_REGISTRY_PASSWORD       sasl_ssl mode: the Schema Registry's password for the client user
#                                (default: generated into <state>/secrets); the registry then
#                                serves HTTPS only, with basic auth
#
# In sasl_ssl mode 'up' prints where the CA certificate and the client credentials file are;
# `set -a; . <state>/secrets/client.env; set +a` points `tolk worker` / `tolk translate` at the
# stack. The mode is recorded in the state dir, so status/down/clean need no variables; a
# storage formatted in one mode (or with one password) is not started in another: 'clean' first.
# docs/SECURITY.md says what a multi-host setup has to change.
set -euo pipefail

COMPOSE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$COMPOSE_DIR")"
STATE_DIR="${TOLK_STATE_DIR:-$HOME/.local/state/tolk}"
KAFKA_PORT="${TOLK_KAFKA_PORT:-9092}"
CONTROLLER_PORT="${TOLK_KAFKA_CONTROLLER_PORT:-9093}"
REDIS_PORT="${TOLK_REDIS_PORT:-6379}"
REDIS_MAXMEMORY="${TOLK_REDIS_MAXMEMORY:-256mb}"
KAFKA_HEAP="${TOLK_KAFKA_HEAP:--Xmx512m -Xms256m}"
START_TIMEOUT="${TOLK_START_TIMEOUT:-120}"
PROM_PORT="${TOLK_PROMETHEUS_PORT:-9090}"
PROM_TARGETS="${TOLK_PROMETHEUS_TARGETS:-127.0.0.1:9400}"
PROM_LOAD_TARGETS="${TOLK_PROMETHEUS_LOAD_TARGETS:-127.0.0.1:9402}"
PROM_INTERVAL="${TOLK_PROMETHEUS_SCRAPE_INTERVAL:-5s}"
REGISTRY_PORT="${TOLK_REGISTRY_PORT:-8085}"

LOG_DIR="$STATE_DIR/logs"
LIBS_DIR="$STATE_DIR/kafka-libs"
KAFKA_DIR="$STATE_DIR/kafka"
KAFKA_DATA="$KAFKA_DIR/data"
KAFKA_PID="$KAFKA_DIR/kafka.pid"
REDIS_DIR="$STATE_DIR/redis"
REDIS_PID="$REDIS_DIR/redis.pid"
REDIS_CONF="$REDIS_DIR/redis.conf"
SECRETS_DIR="$STATE_DIR/secrets"
TLS_DIR="$STATE_DIR/tls"
MODE_FILE="$STATE_DIR/security.mode"
CLIENT_ENV="$SECRETS_DIR/client.env"
KAFKA_USER="${TOLK_KAFKA_USER:-tolk}"
BROKER_USER="broker"  # the inter-broker SCRAM user
SCRAM_MECHANISM="SCRAM-SHA-512"
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$COMPOSE_DIR/pom.xml")"

log() { printf '[stack] %s\n' "$*" >&2; }
die() { printf '[stack] error: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A pid from a pidfile counts only when that process is alive and is what we started
# (a stale pidfile after a reboot may name an unrelated process).
pid_of() {  # pidfile pattern
    local pidfile=$1 pattern=$2 pid
    [[ -s $pidfile ]] || return 1
    pid="$(<"$pidfile")"
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$pattern" || return 1
    echo "$pid"
}

stop_pid() {  # pid name seconds
    local pid=$1 name=$2 wait_s=$3 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < wait_s * 5; i++)); do
        kill -0 "$pid" 2>/dev/null || { log "$name stopped (pid $pid)"; return 0; }
        sleep 0.2
    done
    log "$name did not stop within ${wait_s}s; sending SIGKILL to pid $pid"
    kill -KILL "$pid" 2>/dev/null || true
}

# ---------------------------------------------------------------- security mode and secrets

# The mode: the variables when given, else what the last 'up' recorded, else plaintext (the
# default stack is exactly the plaintext one the test suite uses).
recorded() {  # key
    [[ -s $MODE_FILE ]] && sed -n "s/^$1=//p" "$MODE_FILE" | tail -n1
}

resolve_mode() {
    local mode="${TOLK_KAFKA_SECURITY:-}"
    [[ -n $mode ]] || mode="$(recorded kafka || true)"
    mode="${mode:-plaintext}"
    mode="${mode,,}"
    case $mode in
        plaintext | sasl_ssl) ;;
        *) die "TOLK_KAFKA_SECURITY must be 'plaintext' or 'sasl_ssl', not '$mode'" ;;
    esac
    KAFKA_SECURITY=$mode
    if [[ -z ${TOLK_KAFKA_USER:-} ]]; then
        KAFKA_USER="$(recorded kafka_user || true)"
        KAFKA_USER="${KAFKA_USER:-tolk}"
    fi
    # redis asks for a password when one is given, in sasl_ssl mode, or when 'up' said so.
    if [[ -n ${TOLK_REDIS_PASSWORD:-} || $KAFKA_SECURITY == sasl_ssl ]]; then
        REDIS_AUTH=1
    elif [[ -z ${TOLK_KAFKA_SECURITY:-} && "$(recorded redis_auth || true)" == 1 ]]; then
        REDIS_AUTH=1
    else
        REDIS_AUTH=0
    fi
}

check_secret() {  # what value: a secret goes into a JAAS line, --add-scram and a redis URL
    [[ $2 =~ ^[A-Za-z0-9._~+=-]{8,}$ ]] \
        || die "$1 must be at least 8 characters of letters, digits and ._~+=- (it is written \
into the broker's JAAS line, --add-scram and redis URLs)"
}

# secrets/<name> (0600, in a 0700 dir): the given value, or one generated when the file is
# missing. Prints nothing; the files are read where needed (never put on a command line but
# the one-off --add-scram of the format step).
ensure_secret() {  # name [value]
    local file="$SECRETS_DIR/$1" value="${2:-}"
    (umask 077 && mkdir -p "$SECRETS_DIR")
    chmod 700 "$SECRETS_DIR"
    if [[ -n $value ]]; then
        check_secret "the value for $1" "$value"
        (umask 077 && printf '%s' "$value" >"$file")
    elif [[ ! -s $file ]]; then
        command -v openssl >/dev/null || die "openssl is needed to generate passwords"
        (umask 077 && openssl rand -hex 24 | tr -d '\n' >"$file")
    fi
    chmod 600 "$file"
}

secret() { cat "$SECRETS_DIR/$1"; }  # name

# A CA and the broker's certificate (CN=localhost, SAN DNS:localhost and IP:127.0.0.1, so
# clients verify the host name) as a PKCS12 keystore; the CA certificate is the truststore of
# the broker (controller client certificates) and of the clients. Made once per state dir.
make_tls() {
    [[ -s $TLS_DIR/ca.crt && -s $TLS_DIR/broker.p12 ]] && return 0
    command -v openssl >/dev/null \
        || die "openssl is needed for the TLS certificates (apt-get install -y openssl)"
    ensure_secret keystore.password
    log "making a CA and the broker certificate (localhost, 127.0.0.1) in $TLS_DIR"
    rm -rf "$TLS_DIR"
    (umask 077 && mkdir -p "$TLS_DIR")
    local ssl_log="$LOG_DIR/openssl.log"
    mkdir -p "$LOG_DIR"
    {
        (umask 077 && cd "$TLS_DIR" \
            && openssl req -x509 -newkey rsa:2048 -nodes -days 825 -sha256 \
                -subj "/CN=tolk local CA" -keyout ca.key -out ca.crt \
                -addext "basicConstraints=critical,CA:TRUE" \
                -addext "keyUsage=critical,keyCertSign,cRLSign" \
            && openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=localhost" \
                -keyout broker.key -out broker.csr \
            && printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" \
                "extendedKeyUsage=serverAuth,clientAuth" "basicConstraints=CA:FALSE" \
                "keyUsage=critical,digitalSignature,keyEncipherment" >broker.ext \
            && openssl x509 -req -in broker.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
                -days 825 -sha256 -extfile broker.ext -out broker.crt \
            && openssl pkcs12 -export -in broker.crt -inkey broker.key -certfile ca.crt \
                -name broker -out broker.p12 -passout "file:$SECRETS_DIR/keystore.password" \
            && rm -f broker.csr broker.ext ca.srl)
    } >"$ssl_log" 2>&1 || { cat "$ssl_log" >&2; die "making the certificates failed"; }
    chmod 644 "$TLS_DIR/ca.crt"
    chmod 600 "$TLS_DIR"/*.key "$TLS_DIR/broker.p12"
}

prepare_secrets() {  # before 'up': passwords and certificates of the chosen mode
    if [[ $KAFKA_SECURITY == sasl_ssl ]]; then
        ensure_secret kafka.password "${TOLK_KAFKA_PASSWORD:-}"
        ensure_secret broker.password
        [[ $KAFKA_USER =~ ^[A-Za-z0-9._-]+$ && $KAFKA_USER != "$BROKER_USER" ]] \
            || die "TOLK_KAFKA_USER must be letters, digits and ._- (and not '$BROKER_USER')"
        make_tls
    fi
    if [[ $REDIS_AUTH -eq 1 ]]; then
        ensure_secret redis.password "${TOLK_REDIS_PASSWORD:-}"
    fi
}

# After 'up': record the mode (status/down need no variables) and, when something asks for a
# password, write the client settings file (0600) and say where it and the CA are.
record_mode() {
    mkdir -p "$STATE_DIR"
    printf 'kafka=%s\nkafka_user=%s\nredis_auth=%s\n' \
        "$KAFKA_SECURITY" "$KAFKA_USER" "$REDIS_AUTH" >"$MODE_FILE"
    [[ $KAFKA_SECURITY == sasl_ssl || $REDIS_AUTH -eq 1 ]] || return 0
    (
        umask 077
        {
            echo "# tolk client settings for the local stack under $STATE_DIR (secret: 0600)"
            echo "TOLK_BOOTSTRAP=127.0.0.1:$KAFKA_PORT"
            if [[ $KAFKA_SECURITY == sasl_ssl ]]; then
                echo "TOLK_SECURITY_PROTOCOL=SASL_SSL"
                echo "TOLK_SASL_MECHANISM=$SCRAM_MECHANISM"
                echo "TOLK_SASL_USERNAME=$KAFKA_USER"
                echo "TOLK_SASL_PASSWORD=$(secret kafka.password)"
                echo "TOLK_SSL_CA_LOCATION=$TLS_DIR/ca.crt"
            fi
            echo "TOLK_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0"
            [[ $REDIS_AUTH -eq 0 ]] || echo "TOLK_REDIS_PASSWORD=$(secret redis.password)"
        } >"$CLIENT_ENV"
    )
    chmod 600 "$CLIENT_ENV"
    [[ $KAFKA_SECURITY == plaintext ]] \
        || log "kafka: SASL_SSL ($SCRAM_MECHANISM, user '$KAFKA_USER'); CA certificate: $TLS_DIR/ca.crt"
    [[ $REDIS_AUTH -eq 0 ]] || log "redis: password required (requirepass)"
    log "client credentials (0600): $CLIENT_ENV  (load: set -a; . $CLIENT_ENV; set +a)"
}

# ---------------------------------------------------------------- redis

redis_pid() { pid_of "$REDIS_PID" "redis-server"; }

# PONG from redis; with a password (REDIS_AUTH=1) after AUTH, the password passed through
# REDISCLI_AUTH or the socket, never on a command line.
redis_ping() {  # [noauth]
    local password=""
    [[ $REDIS_AUTH -eq 0 || ${1:-} == noauth ]] || password="$(secret redis.password 2>/dev/null)"
    if command -v redis-cli >/dev/null; then
        local env=()
        [[ -z $password ]] || env=("REDISCLI_AUTH=$password")
        [[ "$(env "${env[@]}" redis-cli --no-auth-warning -h 127.0.0.1 -p "$REDIS_PORT" \
            ping 2>/dev/null)" == PONG ]]
    else
        local reply auth=""
        [[ -z $password ]] || auth="AUTH $password"$'\r\n'
        reply="$(exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT" && printf '%sPING\r\n' "$auth" >&3 \
            && timeout 2 head -c 12 <&3)" 2>/dev/null || return 1
        [[ $reply == *"+PONG"* ]]
    fi
}

install_redis() {
    command -v redis-server >/dev/null && return 0
    command -v apt-get >/dev/null || die "redis-server is missing and apt-get is not available"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    log "installing redis-server with apt-get"
    # Keep the package's init script from starting a system-wide redis on 6379.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
        "${sudo[@]}" chmod +x "$policy"
        made_policy=1
    fi
    local rc=0
    {
        "${sudo[@]}" apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq redis-server >/dev/null
    } || rc=$?
    [[ $made_policy -eq 0 ]] || "${sudo[@]}" rm -f "$policy"
    [[ $rc -eq 0 ]] || die "apt-get install redis-server failed (exit $rc)"
}

redis_up() {
    local pid
    if pid="$(redis_pid)"; then
        if [[ $REDIS_AUTH -eq 1 ]] && redis_ping noauth; then
            die "redis (pid $pid) runs without a password; 'bash compose/stack.sh down' first"
        fi
        log "redis already running (pid $pid) on 127.0.0.1:$REDIS_PORT"
        return 0
    fi
    if port_open "$REDIS_PORT"; then
        redis_ping || die "port $REDIS_PORT is taken by something that is not redis"
        log "a redis not started by this script already answers on 127.0.0.1:$REDIS_PORT; using it"
        return 0
    fi
    install_redis
    mkdir -p "$REDIS_DIR" "$LOG_DIR"
    rm -f "$REDIS_PID"
    if [[ $REDIS_AUTH -eq 0 ]]; then
        redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes \
            --pidfile "$REDIS_PID" --dir "$REDIS_DIR" --logfile "$LOG_DIR/redis.log" \
            --save "" --appendonly no --protected-mode yes \
            --maxmemory "$REDIS_MAXMEMORY" --maxmemory-policy allkeys-lru 9>&-
    else
        # The same options from a 0600 file, so the password is not on the command line.
        (
            umask 077
            printf '%s\n' "bind 127.0.0.1" "port $REDIS_PORT" "daemonize yes" \
                "pidfile $REDIS_PID" "dir $REDIS_DIR" "logfile $LOG_DIR/redis.log" \
                'save ""' "appendonly no" "protected-mode yes" \
                "maxmemory $REDIS_MAXMEMORY" "maxmemory-policy allkeys-lru" \
                "requirepass $(secret redis.password)" >"$REDIS_CONF"
        )
        redis-server "$REDIS_CONF" 9>&-
    fi
    local i
    for ((i = 0; i < START_TIMEOUT * 5; i++)); do
        if redis_ping; then
            log "redis up (pid $(cat "$REDIS_PID" 2>/dev/null || echo '?')) on 127.0.0.1:$REDIS_PORT"
            return 0
        fi
        sleep 0.2
    done
    tail -n 30 "$LOG_DIR/redis.log" >&2 || true
    die "redis did not answer on 127.0.0.1:$REDIS_PORT within ${START_TIMEOUT}s (log: $LOG_DIR/redis.log)"
}

redis_down() {
    local pid
    if pid="$(redis_pid)"; then
        stop_pid "$pid" redis 20
    else
        log "redis not running (under $STATE_DIR)"
    fi
    rm -f "$REDIS_PID"
}

# ---------------------------------------------------------------- kafka

kafka_pid() { pid_of "$KAFKA_PID" "kafka.Kafka"; }

find_python() {
    local cand
    for cand in "${TOLK_PYTHON:-}" "$REPO_DIR/.venv/bin/python" python3; do
        [[ -n $cand ]] || continue
        if command -v "$cand" >/dev/null && "$cand" -c 'import confluent_kafka' 2>/dev/null; then
            echo "$cand"
            return 0
        fi
    done
    return 1
}

# The broker answers when a metadata request lists it. Without a python that has
# confluent_kafka, fall back to "port open and the server logged that it started".
# In sasl_ssl mode the check logs in as the client user (the password read from its file).
kafka_answers() {
    port_open "$KAFKA_PORT" || return 1
    local py
    if py="$(find_python)"; then
        "$py" - "127.0.0.1:$KAFKA_PORT" "$KAFKA_SECURITY" "$TLS_DIR/ca.crt" "$KAFKA_USER" \
            "$SECRETS_DIR/kafka.password" "$SCRAM_MECHANISM" 2>/dev/null <<'PY'
import sys
from confluent_kafka.admin import AdminClient
bootstrap, mode, ca, user, password_file, mechanism = sys.argv[1:7]
conf = {"bootstrap.servers": bootstrap, "socket.timeout.ms": 3000, "log_level": 0}
if mode == "sasl_ssl":
    with open(password_file) as f:
        password = f.read().strip()
    conf |= {"security.protocol": "SASL_SSL", "sasl.mechanism": mechanism,
             "sasl.username": user, "sasl.password": password, "ssl.ca.location": ca}
admin = AdminClient(conf)
sys.exit(0 if admin.list_topics(timeout=5).brokers else 1)
PY
    else
        grep -q "Kafka Server started" "$LOG_DIR/kafka-server.log" 2>/dev/null
    fi
}

require_java() {
    command -v java >/dev/null \
        || die "Java 17+ is needed for the Kafka broker but 'java' is not on PATH
        (Debian/Ubuntu: apt-get install -y openjdk-17-jre-headless)"
    local major
    major="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)"
    [[ -n $major && $major -ge 17 ]] || die "Kafka $KAFKA_VERSION needs Java 17+, found: $(java -version 2>&1 | head -n1)"
}

gather_jars() {
    local stamp="$LIBS_DIR/.gathered" want
    want="$(sha256sum "$COMPOSE_DIR/pom.xml" | cut -d' ' -f1)"
    if [[ -f $stamp && "$(<"$stamp")" == "$want" ]]; then
        return 0
    fi
    command -v mvn >/dev/null \
        || die "the Kafka jars are not gathered yet and 'mvn' is missing (apt-get install -y maven)"
    log "gathering Kafka $KAFKA_VERSION jars from Maven Central into $LIBS_DIR (cached in ~/.m2)"
    rm -rf "$LIBS_DIR"
    mkdir -p "$LIBS_DIR"
    mkdir -p "$LOG_DIR"
    mvn -B -Dstyle.color=never -f "$COMPOSE_DIR/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$LIBS_DIR" -DincludeScope=runtime >"$LOG_DIR/mvn.log" 2>&1 \
        || { tail -n 40 "$LOG_DIR/mvn.log" >&2; die "mvn dependency:copy-dependencies failed (log: $LOG_DIR/mvn.log)"; }
    ls "$LIBS_DIR"/kafka_2.13-*.jar >/dev/null 2>&1 || die "no kafka_2.13 jar in $LIBS_DIR after mvn"
    echo "$want" >"$stamp"
}

# The listeners. plaintext: PLAINTEXT on the broker port, a PLAINTEXT controller.
# sasl_ssl: SASL_SSL (SCRAM) on the broker port, also the inter-broker listener (user
# '$BROKER_USER'), and the controller listener on SSL with client certificates required (SCRAM
# cannot serve a KRaft controller: its credentials live in the metadata the controller serves).
listener_config() {
    if [[ $KAFKA_SECURITY == plaintext ]]; then
        cat <<EOF
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
EOF
        return 0
    fi
    local store_pw
    store_pw="$(secret keystore.password)"
    cat <<EOF
listeners=SASL_SSL://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=SASL_SSL://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_SSL
listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL
sasl.enabled.mechanisms=$SCRAM_MECHANISM
sasl.mechanism.inter.broker.protocol=$SCRAM_MECHANISM
listener.name.sasl_ssl.${SCRAM_MECHANISM,,}.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="$BROKER_USER" password="$(secret broker.password)";
listener.name.controller.ssl.client.auth=required
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS_DIR/broker.p12
ssl.keystore.password=$store_pw
ssl.key.password=$store_pw
ssl.truststore.type=PEM
ssl.truststore.location=$TLS_DIR/ca.crt
ssl.endpoint.identification.algorithm=https
EOF
}

write_config() {
    mkdir -p "$KAFKA_DIR" "$KAFKA_DATA" "$LOG_DIR"
    # 0600: in sasl_ssl mode it holds the keystore and the inter-broker passwords.
    (umask 077 && : >"$KAFKA_DIR/server.properties")
    chmod 600 "$KAFKA_DIR/server.properties"
    cat >"$KAFKA_DIR/server.properties" <<EOF
# Written by compose/stack.sh; edits are overwritten on the next 'up'.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$CONTROLLER_PORT
$(listener_config)
log.dirs=$KAFKA_DATA

# One node: every internal topic has one replica.
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1

# Fast tests: no wait before the first rebalance; topics are created on purpose only.
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
num.partitions=3
log.retention.hours=168

# A small machine.
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
EOF
    cat >"$KAFKA_DIR/log4j2.properties" <<EOF
status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = $LOG_DIR/kafka-server.log
appender.file.filePattern = $LOG_DIR/kafka-server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = WARN
EOF
}

java_cmd() {  # main class, args...
    local runner=()
    [[ ${exec_java:-0} -eq 0 ]] || runner=(exec)
    # shellcheck disable=SC2086  # KAFKA_HEAP is a list of JVM options
    "${runner[@]}" java $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.properties" \
        -Dkafka.logs.dir="$LOG_DIR" -cp "$LIBS_DIR/*" "$@"
}

format_storage() {
    [[ -f $KAFKA_DATA/meta.properties ]] && return 0
    local cluster_id
    if [[ -s $KAFKA_DIR/cluster.id ]]; then
        cluster_id="$(<"$KAFKA_DIR/cluster.id")"
    else
        cluster_id="$(java_cmd kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n1)"
        [[ -n $cluster_id ]] || die "kafka.tools.StorageTool random-uuid printed nothing"
        echo "$cluster_id" >"$KAFKA_DIR/cluster.id"
    fi
    log "formatting the KRaft storage (cluster id $cluster_id, controller 127.0.0.1:$CONTROLLER_PORT)"
    # The controller's endpoint is written into the metadata log here; a different
    # TOLK_KAFKA_CONTROLLER_PORT later needs 'clean' first.
    echo "$CONTROLLER_PORT" >"$KAFKA_DIR/controller.port"
    local scram=()
    if [[ $KAFKA_SECURITY == sasl_ssl ]]; then
        # The SCRAM users go into the metadata log at format time (there is no broker to ask
        # yet). The one command line that carries the passwords, for the seconds it runs.
        scram=(--add-scram "$SCRAM_MECHANISM=[name=$KAFKA_USER,password=$(secret kafka.password)]"
            --add-scram "$SCRAM_MECHANISM=[name=$BROKER_USER,password=$(secret broker.password)]")
    fi
    java_cmd kafka.tools.StorageTool format -t "$cluster_id" \
        -c "$KAFKA_DIR/server.properties" --standalone --ignore-formatted "${scram[@]}" \
        >"$LOG_DIR/kafka-format.log" 2>&1 \
        || { cat "$LOG_DIR/kafka-format.log" >&2; die "formatting the Kafka storage failed"; }
    printf '%s\n' "$(formatted_as)" >"$KAFKA_DIR/security.formatted"
}

# What a storage was formatted for: the mode and, in sasl_ssl mode, a hash of the user and the
# password (the SCRAM credentials in its metadata).
formatted_as() {
    if [[ $KAFKA_SECURITY == plaintext ]]; then
        echo plaintext
    else
        echo "sasl_ssl $(printf '%s:%s' "$KAFKA_USER" "$(secret kafka.password)" | sha256sum | cut -c1-16)"
    fi
}

check_formatted_mode() {
    [[ -f $KAFKA_DATA/meta.properties ]] || return 0
    local was="plaintext"
    [[ ! -s $KAFKA_DIR/security.formatted ]] || was="$(<"$KAFKA_DIR/security.formatted")"
    [[ $was == "$(formatted_as)" ]] && return 0
    local what="'${was%% *}'"
    [[ ${was%% *} != "$KAFKA_SECURITY" ]] || what="other SCRAM credentials (user or password)"
    die "the Kafka storage under $KAFKA_DIR was formatted for $what; run \
'bash compose/stack.sh clean' to start over as '$KAFKA_SECURITY'"
}

kafka_up() {
    local pid
    if pid="$(kafka_pid)"; then
        check_formatted_mode  # a broker of another mode would never answer this one's check
        log "kafka already running (pid $pid) on 127.0.0.1:$KAFKA_PORT"
        wait_for_kafka "$pid"
        return 0
    fi
    if port_open "$KAFKA_PORT"; then
        kafka_answers || die "port $KAFKA_PORT is taken by something that does not answer as Kafka"
        log "a Kafka broker not started by this script already answers on 127.0.0.1:$KAFKA_PORT; using it"
        return 0
    fi
    port_open "$CONTROLLER_PORT" && die "the controller port $CONTROLLER_PORT is already taken"
    require_java
    gather_jars
    write_config
    if [[ -s $KAFKA_DIR/controller.port && "$(<"$KAFKA_DIR/controller.port")" != "$CONTROLLER_PORT" ]]; then
        die "the storage was formatted for controller port $(<"$KAFKA_DIR/controller.port"); \
run 'bash compose/stack.sh clean' to start over with $CONTROLLER_PORT"
    fi
    check_formatted_mode
    format_storage
    log "starting Kafka $KAFKA_VERSION on 127.0.0.1:$KAFKA_PORT ($KAFKA_SECURITY, controller 127.0.0.1:$CONTROLLER_PORT)"
    rm -f "$KAFKA_PID"
    [[ ! -f $LOG_DIR/kafka.out ]] || mv -f "$LOG_DIR/kafka.out" "$LOG_DIR/kafka.out.prev"
    # Where this start's lines begin in the server log, for the tail on failure.
    server_log_start=$(stat -c %s "$LOG_DIR/kafka-server.log" 2>/dev/null || echo 0)
    # setsid: the broker outlives the shell (or the python subprocess) that started it.
    # It re-enters this script ('__exec-java'), which execs the JVM, so $! is the JVM's pid.
    setsid bash "$COMPOSE_DIR/stack.sh" __exec-java kafka.Kafka "$KAFKA_DIR/server.properties" \
        >"$LOG_DIR/kafka.out" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$KAFKA_PID"
    wait_for_kafka "$pid"
}

server_log_tail() {  # this start's part of the server log (the file survives restarts)
    [[ -f $LOG_DIR/kafka-server.log ]] || return 0
    local size
    size=$(stat -c %s "$LOG_DIR/kafka-server.log")
    ((size >= ${server_log_start:-0})) || server_log_start=0  # rolled over meanwhile
    tail -c +"$((${server_log_start:-0} + 1))" "$LOG_DIR/kafka-server.log" | tail -n 40 || true
}

wait_for_kafka() {
    local pid=$1 i
    for ((i = 0; i < START_TIMEOUT; i++)); do
        if kafka_answers; then
            log "kafka up (pid $pid) on 127.0.0.1:$KAFKA_PORT"
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            log "kafka exited during start-up; last lines of its logs:"
            tail -n 40 "$LOG_DIR/kafka.out" >&2 || true
            server_log_tail >&2
            rm -f "$KAFKA_PID"
            die "kafka failed to start (logs: $LOG_DIR/kafka.out, $LOG_DIR/kafka-server.log)"
        fi
        sleep 1
    done
    log "kafka did not answer within ${START_TIMEOUT}s; last lines of its log:"
    server_log_tail >&2
    die "kafka (pid $pid) did not answer on 127.0.0.1:$KAFKA_PORT within ${START_TIMEOUT}s"
}

kafka_down() {
    local pid
    if pid="$(kafka_pid)"; then
        # SIGTERM runs the broker's controlled shutdown; give it time to close its logs.
        stop_pid "$pid" kafka 60
    else
        log "kafka not running (under $STATE_DIR)"
    fi
    rm -f "$KAFKA_PID"
}

# ---------------------------------------------------------------- prometheus (observability)

PROM_DIR="$STATE_DIR/prometheus"
PROM_PID="$PROM_DIR/prometheus.pid"
PROM_CONF="$PROM_DIR/prometheus.yml"

prometheus_pid() { pid_of "$PROM_PID" "$PROM_CONF"; }

prometheus_ready() {  # HTTP 200 from /-/ready
    local reply
    reply="$(exec 2>/dev/null 3<>"/dev/tcp/127.0.0.1/$PROM_PORT" \
        && printf 'GET /-/ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3 \
        && timeout 2 head -c 12 <&3)" 2>/dev/null || return 1
    [[ $reply == "HTTP/1."?" 200" ]]
}

install_prometheus() {
    command -v prometheus >/dev/null && return 0
    command -v apt-get >/dev/null || die "prometheus is missing and apt-get is not available"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    log "installing prometheus with apt-get"
    local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
    if [[ ! -e $policy ]]; then  # keep the package from starting a system-wide one on 9090
        printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
        "${sudo[@]}" chmod +x "$policy"
        made_policy=1
    fi
    {
        "${sudo[@]}" apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq prometheus >/dev/null
    } || rc=$?
    [[ $made_policy -eq 0 ]] || "${sudo[@]}" rm -f "$policy"
    [[ $rc -eq 0 ]] || die "apt-get install prometheus failed (exit $rc)"
}

yaml_targets() {  # "a:1,b:2" -> "a:1", "b:2"
    local out="" t list
    IFS=',' read -ra list <<<"$1"
    for t in "${list[@]}"; do
        [[ -z $t ]] || out+="${out:+, }\"$t\""
    done
    echo "$out"
}

prometheus_up() {
    local pid
    if pid="$(prometheus_pid)"; then
        log "prometheus already running (pid $pid) on 127.0.0.1:$PROM_PORT"
        return 0
    fi
    port_open "$PROM_PORT" && die "port $PROM_PORT is taken (TOLK_PROMETHEUS_PORT picks another)"
    install_prometheus
    mkdir -p "$PROM_DIR/data" "$LOG_DIR"
    cat >"$PROM_CONF" <<EOF
# Written by compose/stack.sh; edits are overwritten on the next start.
global:
  scrape_interval: $PROM_INTERVAL
  evaluation_interval: $PROM_INTERVAL
scrape_configs:
  - job_name: tolk-worker
    static_configs:
      - targets: [$(yaml_targets "$PROM_TARGETS")]
  - job_name: tolk-load
    static_configs:
      - targets: [$(yaml_targets "$PROM_LOAD_TARGETS")]
EOF
    rm -f "$PROM_PID"
    setsid prometheus --config.file="$PROM_CONF" --storage.tsdb.path="$PROM_DIR/data" \
        --web.listen-address="127.0.0.1:$PROM_PORT" --storage.tsdb.retention.time=7d \
        >"$LOG_DIR/prometheus.log" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$PROM_PID"
    local i
    for ((i = 0; i < START_TIMEOUT * 5; i++)); do
        if prometheus_ready; then
            log "prometheus up (pid $pid) on 127.0.0.1:$PROM_PORT, scraping $PROM_TARGETS and $PROM_LOAD_TARGETS"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    tail -n 30 "$LOG_DIR/prometheus.log" >&2 || true
    die "prometheus did not answer on 127.0.0.1:$PROM_PORT (log: $LOG_DIR/prometheus.log)"
}

prometheus_down() {
    local pid
    if pid="$(prometheus_pid)"; then
        stop_pid "$pid" prometheus 20
    fi
    rm -f "$PROM_PID"
}

# ---------------------------------------------------------------- schema registry (issue #45)
# Apicurio Registry (compose/registry/pom.xml: its application jar from Maven Central, built
# into a runnable Quarkus application once, kept in the state dir), on loopback, storage in
# memory; the Confluent-compatible API at /apis/ccompat/v7.

REGISTRY_DIR="$STATE_DIR/registry"
REGISTRY_PID="$REGISTRY_DIR/registry.pid"
REGISTRY_API="/apis/ccompat/v7"

registry_pid() { pid_of "$REGISTRY_PID" "$REGISTRY_DIR/quarkus-app"; }  # either build

registry_tls() { [[ $KAFKA_SECURITY == sasl_ssl ]]; }  # the registry follows the stack's mode

registry_url() {  # what clients are given (credentials apart)
    if registry_tls; then
        echo "https://127.0.0.1:$REGISTRY_PORT$REGISTRY_API"
    else
        echo "http://127.0.0.1:$REGISTRY_PORT$REGISTRY_API"
    fi
}

registry_ready() {  # HTTP 200 from the ccompat API's subject list
    local reply
    if registry_tls; then  # TLS and a login: curl (its config on stdin: no password in ps)
        command -v curl >/dev/null || die "curl is needed to check the registry over TLS"
        printf 'user = "%s:%s"\n' "$KAFKA_USER" "$(secret registry.password)" \
            | curl -K - -fsS -o /dev/null --max-time 3 --cacert "$TLS_DIR/ca.crt" \
                "$(registry_url)/subjects" 2>/dev/null
        return
    fi
    reply="$(exec 2>/dev/null 3<>"/dev/tcp/127.0.0.1/$REGISTRY_PORT" \
        && printf 'GET %s/subjects HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$REGISTRY_API" >&3 \
        && timeout 2 head -c 12 <&3)" 2>/dev/null || return 1
    [[ $reply == "HTTP/1."?" 200" ]]
}

# sasl_ssl mode: the registry serves HTTPS only, with the broker's certificate (localhost,
# 127.0.0.1; the stack's CA), and asks every request for HTTP basic credentials: the client
# user (TOLK_KAFKA_USER) with a password of its own (secrets/registry.password). Quarkus reads
# them at start from config/application.properties in its working directory (0600; never on
# a command line); the build enabled basic auth and the embedded user store
# (compose/registry/src/main/resources/META-INF/microprofile-config.properties) and, for this
# mode only, the policy (build_registry).
registry_tls_config() {
    ensure_secret registry.password "${TOLK_REGISTRY_PASSWORD:-}"
    [[ -s $TLS_DIR/broker.crt && -s $TLS_DIR/broker.key ]] \
        || die "no certificates in $TLS_DIR: run 'up' in sasl_ssl mode first"
    (umask 077 && mkdir -p "$REGISTRY_DIR/config" && {
        echo "# written by compose/stack.sh registry-up (sasl_ssl mode): secret, 0600"
        echo "quarkus.http.ssl-port=$REGISTRY_PORT"
        echo "quarkus.http.insecure-requests=disabled"
        echo "quarkus.http.ssl.certificate.files=$TLS_DIR/broker.crt"
        echo "quarkus.http.ssl.certificate.key-files=$TLS_DIR/broker.key"
        echo "quarkus.security.users.embedded.users.$KAFKA_USER=$(secret registry.password)"
        echo "quarkus.security.users.embedded.roles.$KAFKA_USER=sr-developer"
    } >"$REGISTRY_DIR/config/application.properties")
    chmod 600 "$REGISTRY_DIR/config/application.properties"
}

# The client settings file gets the registry's URL with the credentials in it (the form
# TOLK_SCHEMA_REGISTRY_URL takes); a bot's library takes them apart (docs/OPERATIONS.md).
registry_client_env() {
    [[ -s $CLIENT_ENV ]] || return 0
    local kept
    kept="$(grep -v '^TOLK_SCHEMA_REGISTRY_URL=' "$CLIENT_ENV" || true)"
    (umask 077 && printf '%s\nTOLK_SCHEMA_REGISTRY_URL=https://%s:%s@127.0.0.1:%s%s\n' "$kept" \
        "$KAFKA_USER" "$(secret registry.password)" "$REGISTRY_PORT" "$REGISTRY_API" >"$CLIENT_ENV")
    chmod 600 "$CLIENT_ENV"
}

# Two builds: the plain one, and in sasl_ssl mode one whose every path asks for a login.
# Quarkus 2.16 (Apicurio 2.4's) fixes HTTP permission policies at build time, so the policy is
# given to the build (`quarkus-app-auth`); the users, the certificates and the HTTPS port are
# given at start (registry_tls_config).
registry_app() {
    if registry_tls; then echo "$REGISTRY_DIR/quarkus-app-auth"; else echo "$REGISTRY_DIR/quarkus-app"; fi
}

build_registry() {
    local app want build="$REGISTRY_DIR/build" stamp
    local -a policy=()
    app="$(registry_app)"
    stamp="$app.built"
    ! registry_tls || policy=(-Dquarkus.http.auth.permission.registry.paths='/*'
        -Dquarkus.http.auth.permission.registry.policy=authenticated)
    want="$(find "$COMPOSE_DIR/registry" -type f -not -path '*/target/*' | sort | xargs cat \
        | sha256sum | cut -d' ' -f1)"
    if [[ -f $stamp && "$(<"$stamp")" == "$want" && -f $app/quarkus-run.jar ]]; then
        return 0
    fi
    command -v mvn >/dev/null || die "the registry is not built yet and 'mvn' is missing"
    log "building the Schema Registry (Apicurio, compose/registry/pom.xml) into $app"
    rm -rf "$build" "$app"
    mkdir -p "$REGISTRY_DIR" "$LOG_DIR"
    cp -r "$COMPOSE_DIR/registry" "$build"
    MAVEN_OPTS="${MAVEN_OPTS:--Xmx768m}" mvn -B -Dstyle.color=never -f "$build/pom.xml" \
        -DskipTests -Dquarkus.package.type=fast-jar "${policy[@]}" package \
        >"$LOG_DIR/registry-mvn.log" 2>&1 \
        || { tail -n 40 "$LOG_DIR/registry-mvn.log" >&2; die "the registry build failed (log: $LOG_DIR/registry-mvn.log)"; }
    mv "$build/target/quarkus-app" "$app"
    rm -rf "$build"
    echo "$want" >"$stamp"
}

registry_up() {
    local pid i
    if pid="$(registry_pid)" && registry_ready; then
        log "schema registry already running (pid $pid) on 127.0.0.1:$REGISTRY_PORT"
        return 0
    fi
    if port_open "$REGISTRY_PORT"; then
        registry_ready || die "port $REGISTRY_PORT is taken by something that does not answer as a registry"
        log "a Schema Registry not started by this script already answers on 127.0.0.1:$REGISTRY_PORT; using it"
        return 0
    fi
    require_java
    build_registry
    rm -rf "$REGISTRY_DIR/config"  # a mode's settings never outlive it
    ! registry_tls || registry_tls_config
    log "starting the Schema Registry on 127.0.0.1:$REGISTRY_PORT ($REGISTRY_API$(registry_tls \
        && echo ", HTTPS with basic auth, user '$KAFKA_USER'"))"
    # a small heap and the serial collector: in memory it holds a few schemas (~300 MB resident)
    (cd "$REGISTRY_DIR" && exec setsid java -Xmx192m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
        -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$REGISTRY_PORT" \
        -jar "$(registry_app)/quarkus-run.jar" >"$LOG_DIR/registry.out" 2>&1 </dev/null 9>&-) &
    pid=$!
    echo "$pid" >"$REGISTRY_PID"
    for ((i = 0; i < START_TIMEOUT; i++)); do
        if registry_ready; then
            log "schema registry up (pid $pid): $(registry_url)"
            ! registry_tls || registry_client_env
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || { tail -n 40 "$LOG_DIR/registry.out" >&2; die "the registry exited during start-up (log: $LOG_DIR/registry.out)"; }
        sleep 1
    done
    die "the registry (pid $pid) did not answer on 127.0.0.1:$REGISTRY_PORT within ${START_TIMEOUT}s"
}

registry_down() {
    local pid
    if pid="$(registry_pid)"; then
        stop_pid "$pid" registry 30
    fi
    rm -f "$REGISTRY_PID"
}

# ---------------------------------------------------------------- commands

status() {
    local rc=0 pid
    if pid="$(kafka_pid)"; then
        if kafka_answers; then
            echo "kafka: running (pid $pid) on 127.0.0.1:$KAFKA_PORT, Apache Kafka $KAFKA_VERSION$(security_note)"
        else
            echo "kafka: starting or unhealthy (pid $pid), not answering on 127.0.0.1:$KAFKA_PORT"
            rc=3
        fi
    elif kafka_answers; then
        echo "kafka: running (not started by this script) on 127.0.0.1:$KAFKA_PORT$(security_note)"
    else
        echo "kafka: stopped"
        rc=3
    fi
    if pid="$(redis_pid)"; then
        if redis_ping; then
            echo "redis: running (pid $pid) on 127.0.0.1:$REDIS_PORT$(redis_note)"
        else
            echo "redis: unhealthy (pid $pid), not answering on 127.0.0.1:$REDIS_PORT"
            rc=3
        fi
    elif redis_ping; then
        echo "redis: running (not started by this script) on 127.0.0.1:$REDIS_PORT$(redis_note)"
    else
        echo "redis: stopped"
        rc=3
    fi
    if pid="$(prometheus_pid)"; then  # optional: never changes the exit code
        echo "prometheus: running (pid $pid) on 127.0.0.1:$PROM_PORT"
    fi
    if pid="$(registry_pid)"; then  # optional for now (TOLK_REGISTRY=1)
        echo "schema registry: running (pid $pid): $(registry_url)"
    fi
    echo "state: $STATE_DIR"
    [[ ! -s $CLIENT_ENV ]] || echo "client credentials: $CLIENT_ENV"
    return "$rc"
}

security_note() {
    [[ $KAFKA_SECURITY == plaintext ]] \
        || echo " (SASL_SSL $SCRAM_MECHANISM, CA $TLS_DIR/ca.crt)"
}

redis_note() {
    [[ $REDIS_AUTH -eq 0 ]] || echo " (password required)"
}

with_lock() {
    mkdir -p "$STATE_DIR"
    # Daemons started under the lock get '9>&-', or they would hold it for their lifetime.
    exec 9>"$STATE_DIR/stack.lock"
    flock -w 300 9 || die "another compose/stack.sh holds $STATE_DIR/stack.lock"
    "$@"
}

[[ ${1:-} == __exec-java ]] || resolve_mode

case "${1:-}" in
    up)
        with_lock prepare_secrets && with_lock redis_up && with_lock kafka_up && record_mode
        [[ ${TOLK_OBSERVABILITY:-0} != 1 ]] || with_lock prometheus_up
        [[ ${TOLK_REGISTRY:-0} != 1 ]] || with_lock registry_up
        ;;
    down)
        with_lock registry_down && with_lock prometheus_down && with_lock kafka_down \
            && with_lock redis_down
        ;;
    observability-up) with_lock prometheus_up ;;
    observability-down) with_lock prometheus_down ;;
    registry-up) with_lock registry_up ;;
    registry-down) with_lock registry_down ;;
    status) status ;;
    __exec-java)
        shift
        exec_java=1
        java_cmd "$@"
        ;;
    clean)
        with_lock registry_down
        with_lock prometheus_down
        with_lock kafka_down
        with_lock redis_down
        rm -rf "$PROM_DIR" "$KAFKA_DIR" "$REDIS_DIR" "$SECRETS_DIR" "$TLS_DIR" "$MODE_FILE"
        log "removed $KAFKA_DIR, $REDIS_DIR and the certificates and secrets"
        ;;
    *)
        echo "usage: $0 up|down|status|clean|observability-up|observability-down|registry-up|registry-down" >&2
        exit 2
        ;;
esac
