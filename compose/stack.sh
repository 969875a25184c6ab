#!/usr/bin/env bash
# The local tolk stack without Docker: a single-node Apache Kafka 4.x broker (KRaft,
# broker+controller in one JVM, jars from Maven Central) and a redis-server, both on loopback.
#
#   bash compose/stack.sh up       start what is not running (idempotent), wait until it answers
#   bash compose/stack.sh down     stop both cleanly
#   bash compose/stack.sh status   say what runs; exit 0 only when both answer
#   bash compose/stack.sh clean    down, then delete the broker's and redis' data (keeps the jars)
#
# Environment (all optional):
#   TOLK_STATE_DIR               state dir (default ~/.local/state/tolk): jars, data, logs, pidfiles
#   TOLK_KAFKA_PORT              broker listener on 127.0.0.1 (default 9092)
#   TOLK_KAFKA_CONTROLLER_PORT   KRaft controller listener on 127.0.0.1 (default 9093)
#   TOLK_REDIS_PORT              redis on 127.0.0.1 (default 6379)
#   TOLK_KAFKA_HEAP              JVM heap options (default "-Xmx512m -Xms256m")
#   TOLK_START_TIMEOUT           seconds to wait for each service to answer (default 120)
#   TOLK_PYTHON                  a python with confluent_kafka for the broker readiness check
set -euo pipefail

COMPOSE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$COMPOSE_DIR")"
STATE_DIR="${TOLK_STATE_DIR:-$HOME/.local/state/tolk}"
KAFKA_PORT="${TOLK_KAFKA_PORT:-9092}"
CONTROLLER_PORT="${TOLK_KAFKA_CONTROLLER_PORT:-9093}"
REDIS_PORT="${TOLK_REDIS_PORT:-6379}"
KAFKA_HEAP="${TOLK_KAFKA_HEAP:--Xmx512m -Xms256m}"
START_TIMEOUT="${TOLK_START_TIMEOUT:-120}"

LOG_DIR="$STATE_DIR/logs"
LIBS_DIR="$STATE_DIR/kafka-libs"
KAFKA_DIR="$STATE_DIR/kafka"
KAFKA_DATA="$KAFKA_DIR/data"
KAFKA_PID="$KAFKA_DIR/kafka.pid"
REDIS_DIR="$STATE_DIR/redis"
REDIS_PID="$REDIS_DIR/redis.pid"
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

# ---------------------------------------------------------------- redis

redis_pid() { pid_of "$REDIS_PID" "redis-server"; }

redis_ping() {
    if command -v redis-cli >/dev/null; then
        [[ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" == PONG ]]
    else
        local reply
        reply="$(exec 3<>"/dev/tcp/127.0.0.1/$REDIS_PORT" && printf 'PING\r\n' >&3 \
            && timeout 2 head -c 7 <&3)" 2>/dev/null || return 1
        [[ $reply == "+PONG"* ]]
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
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes \
        --pidfile "$REDIS_PID" --dir "$REDIS_DIR" --logfile "$LOG_DIR/redis.log" \
        --save "" --appendonly no --protected-mode yes 9>&-
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
kafka_answers() {
    port_open "$KAFKA_PORT" || return 1
    local py
    if py="$(find_python)"; then
        "$py" - "127.0.0.1:$KAFKA_PORT" 2>/dev/null <<'PY'
import sys
from confluent_kafka.admin import AdminClient
admin = AdminClient({"bootstrap.servers": sys.argv[1], "socket.timeout.ms": 3000, "log_level": 0})
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

write_config() {
    mkdir -p "$KAFKA_DIR" "$KAFKA_DATA" "$LOG_DIR"
    cat >"$KAFKA_DIR/server.properties" <<EOF
# Written by compose/stack.sh; edits are overwritten on the next 'up'.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
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
    java_cmd kafka.tools.StorageTool format -t "$cluster_id" \
        -c "$KAFKA_DIR/server.properties" --standalone --ignore-formatted \
        >"$LOG_DIR/kafka-format.log" 2>&1 \
        || { cat "$LOG_DIR/kafka-format.log" >&2; die "formatting the Kafka storage failed"; }
}

kafka_up() {
    local pid
    if pid="$(kafka_pid)"; then
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
    format_storage
    log "starting Kafka $KAFKA_VERSION on 127.0.0.1:$KAFKA_PORT (controller 127.0.0.1:$CONTROLLER_PORT)"
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

# ---------------------------------------------------------------- commands

status() {
    local rc=0 pid
    if pid="$(kafka_pid)"; then
        if kafka_answers; then
            echo "kafka: running (pid $pid) on 127.0.0.1:$KAFKA_PORT, Apache Kafka $KAFKA_VERSION"
        else
            echo "kafka: starting or unhealthy (pid $pid), not answering on 127.0.0.1:$KAFKA_PORT"
            rc=3
        fi
    elif kafka_answers; then
        echo "kafka: running (not started by this script) on 127.0.0.1:$KAFKA_PORT"
    else
        echo "kafka: stopped"
        rc=3
    fi
    if pid="$(redis_pid)"; then
        if redis_ping; then
            echo "redis: running (pid $pid) on 127.0.0.1:$REDIS_PORT"
        else
            echo "redis: unhealthy (pid $pid), not answering on 127.0.0.1:$REDIS_PORT"
            rc=3
        fi
    elif redis_ping; then
        echo "redis: running (not started by this script) on 127.0.0.1:$REDIS_PORT"
    else
        echo "redis: stopped"
        rc=3
    fi
    echo "state: $STATE_DIR"
    return "$rc"
}

with_lock() {
    mkdir -p "$STATE_DIR"
    # Daemons started under the lock get '9>&-', or they would hold it for their lifetime.
    exec 9>"$STATE_DIR/stack.lock"
    flock -w 300 9 || die "another compose/stack.sh holds $STATE_DIR/stack.lock"
    "$@"
}

case "${1:-}" in
    up) with_lock redis_up && with_lock kafka_up ;;
    down) with_lock kafka_down && with_lock redis_down ;;
    status) status ;;
    __exec-java)
        shift
        exec_java=1
        java_cmd "$@"
        ;;
    clean)
        with_lock kafka_down
        with_lock redis_down
        rm -rf "$KAFKA_DIR" "$REDIS_DIR"
        log "removed $KAFKA_DIR and $REDIS_DIR"
        ;;
    *)
        echo "usage: $0 up|down|status|clean" >&2
        exit 2
        ;;
esac
