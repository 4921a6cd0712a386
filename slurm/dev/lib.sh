# Shared by up.sh and down.sh (sourced, not run): where the dev cluster keeps its state, which
# daemons it runs, and how a daemon is found and stopped (always by the pid it wrote, never by name).

STATE=${AREAL_SLURM_STATE:-/tmp/areal-slurm}
CLUSTER=areal-dev
NODES=(train1 rollout1)
declare -A NODE_PORT=([train1]=17001 [rollout1]=17002)
CTLD_PORT=17000
DBD_PORT=17003
DB_PORT=17004

RUN=$STATE/run          # pid files (munged writes its own under $STATE/munge: it runs as user munge)
LOG=$STATE/log
DB=$STATE/mysql
MUNGE_DIR=$STATE/munge
MARK="# areal-hpc dev cluster: written by slurm/dev/up.sh"

# Where slurm.conf lives: /etc/slurm (so a plain `sbatch` works for every process) unless a
# slurm.conf that up.sh did not write is already there; then $STATE/etc, and SLURM_CONF must point at it.
if [[ ! -e /etc/slurm/slurm.conf ]] || grep -qF "$MARK" /etc/slurm/slurm.conf 2>/dev/null; then
    CONF_DIR=/etc/slurm
else
    CONF_DIR=$STATE/etc
fi
export SLURM_CONF=$CONF_DIR/slurm.conf

# The daemons in start order, as "name pidfile comm [node]".
daemons() {
    echo "munged $MUNGE_DIR/munged.pid munged"
    echo "mariadbd $RUN/mariadbd.pid mariadbd"
    echo "slurmdbd $RUN/slurmdbd.pid slurmdbd"
    echo "slurmctld $RUN/slurmctld.pid slurmctld"
    local node
    for node in "${NODES[@]}"; do echo "slurmd-$node $RUN/slurmd-$node.pid slurmd $node"; done
}

# now / since T: a clock in microseconds, and the seconds since T with one decimal.
now() { echo "${EPOCHREALTIME/./}"; }
since() { local d=$(($(now) - $1)); printf '%d.%d' $((d / 1000000)) $((d / 100000 % 10)); }

# running PID: the process exists and has not exited (an exited child of pid 1 stays a zombie until reaped).
running() {
    local state
    state=$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null) && [[ -n $state && $state != [ZX] ]]
}

# pid_of NAME: the live pid recorded for daemon NAME, or nothing (and status 1) when it is not running.
# A pid is only taken as ours when the process's name matches (and, for slurmd, its -N node name).
pid_of() {
    local name pidfile comm node pid
    while read -r name pidfile comm node; do
        [[ $name == "$1" ]] || continue
        pid=$(cat "$pidfile" 2>/dev/null) || return 1
        [[ $pid =~ ^[0-9]+$ ]] && running "$pid" || return 1
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]] || return 1
        if [[ -n $node ]]; then
            tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE -- "-N $node( |$)" || return 1
        fi
        echo "$pid"
        return 0
    done < <(daemons)
    return 1
}

# stop_daemon NAME: SIGTERM the recorded pid, wait for it to exit (SIGKILL after 30 s), remove the pid file.
stop_daemon() {
    local name=$1 pid pidfile i
    pidfile=$(daemons | awk -v n="$name" '$1 == n {print $2}')
    if pid=$(pid_of "$name"); then
        local t0
        t0=$(now)
        echo -n "  stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 300; i++)); do
            running "$pid" || break
            sleep 0.1
        done
        if running "$pid"; then
            echo -n ": still running after 30 s, SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            while running "$pid"; do sleep 0.1; done
        fi
        echo ": $(since "$t0") s"
    fi
    rm -f "$pidfile"
}

# wait_for SECONDS WHAT COMMAND...: poll COMMAND (quietly) every 0.1 s until it succeeds; fail after SECONDS.
wait_for() {
    local timeout=$1 what=$2 deadline
    shift 2
    deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "up.sh: timed out after ${timeout}s waiting for $what (logs in $LOG)" >&2
            return 1
        fi
        sleep 0.1
    done
}
