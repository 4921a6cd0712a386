#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one machine, from nothing: munged, MariaDB, slurmdbd, slurmctld
# and two slurmd (nodes train1 and rollout1, 2 fake GPUs each), partitions train, rollout and all.
#
#   bash slurm/dev/up.sh           bring it up (installs the Debian packages if missing); idempotent:
#                                  a healthy cluster is left alone, a half-up one is repaired
#   bash slurm/dev/up.sh --check   exit 0 if the cluster is up and healthy, 1 if not; changes nothing
#   bash slurm/dev/down.sh         stop it
#
# State (pids, spool, logs, database) lives under $AREAL_SLURM_STATE (default /tmp/areal-slurm).
# Needs root (it installs packages and runs the daemons as root; munged runs as user munge).
set -euo pipefail
cd "$(dirname "$0")"
source ./lib.sh
T0=$(now)

say() { echo "up.sh [+$(since "$T0") s]: $*"; }

# ---------------------------------------------------------------------------------------------
# The configuration, generated from this machine (same input, same text: a rerun compares it).

HOST=$(hostname -s)
CPUS=$(nproc --all)
MEM_TOTAL_MB=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
MEM_MB=$((MEM_TOTAL_MB * 9 / 10 < 8000 ? MEM_TOTAL_MB * 9 / 10 : 8000))

slurm_conf() {
    cat <<CONF
$MARK
# (state under $STATE; stop it with slurm/dev/down.sh). Do not edit: up.sh rewrites it.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/spool/slurmctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
TmpFS=$STATE/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=1000
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
GresTypes=gpu
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1,bf_resolution=1,bf_hetjob_immediate
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
SlurmctldParameters=preempt_send_user_signal
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
# Het jobs start only from backfill, which runs only after a state change; with nothing else
# happening, a requeued one waits for the next node ping (SlurmdTimeout/3, default 100 s).
SlurmdTimeout=30
MailProg=/bin/true
InactiveLimit=0
Waittime=0
NodeName=train1 NodeAddr=127.0.0.1 NodeHostname=$HOST Port=${NODE_PORT[train1]} CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:2 State=UNKNOWN
NodeName=rollout1 NodeAddr=127.0.0.1 NodeHostname=$HOST Port=${NODE_PORT[rollout1]} CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:2 State=UNKNOWN
PartitionName=train Nodes=train1 MaxTime=INFINITE State=UP
PartitionName=rollout Nodes=rollout1 MaxTime=INFINITE State=UP
PartitionName=all Nodes=train1,rollout1 Default=YES MaxTime=INFINITE State=UP
CONF
}

# Fake GPUs: count-only GRES is dropped and regular files are rejected, symlinks to /dev/null work.
gres_conf() {
    echo "$MARK"
    local node
    for node in "${NODES[@]}"; do echo "NodeName=$node Name=gpu File=$STATE/dev/$node/nvidia[0-1]"; done
}

slurmdbd_conf() {
    cat <<CONF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$DB/slurm.pass" 2>/dev/null || echo unset)
StorageLoc=slurm_acct_db
CONF
}

# same FILE GENERATOR: the file already holds what GENERATOR prints.
same() { [[ -f $1 ]] && cmp -s "$1" <("$2"); }

configs_current() {
    same "$CONF_DIR/slurm.conf" slurm_conf && same "$CONF_DIR/gres.conf" gres_conf &&
        same "$CONF_DIR/slurmdbd.conf" slurmdbd_conf
}

# ---------------------------------------------------------------------------------------------
# Health: every daemon alive under its recorded pid, the configs current, both nodes responding
# and usable (idle, or running jobs), and the accounting database answering.

nodes_usable() {  # both nodes respond and take jobs (not drained, draining or down)
    local usable
    usable=$(sinfo -h -N -r -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc|comp)$/ {print $1}' | sort -u | tr '\n' ' ')
    [[ $usable == "$(printf '%s\n' "${NODES[@]}" | sort | tr '\n' ' ')" ]]
}

munge_answers() { command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

healthy() {
    local name
    for name in $(daemons | awk '{print $1}'); do
        pid_of "$name" >/dev/null || { [[ $name == munged ]] && munge_answers; } || return 1
    done
    configs_current || return 1
    command -v sinfo >/dev/null || return 1
    nodes_usable || return 1
    sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"
}

summary() {
    local states
    states=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ')
    echo "dev Slurm cluster $CLUSTER up ($1, $(since "$T0") s): nodes ${states% }; partitions train, rollout, all (default);" \
        "SLURM_CONF=$SLURM_CONF; state $STATE"
    if [[ $CONF_DIR != /etc/slurm ]]; then
        echo "NOTE: /etc/slurm/slurm.conf belongs to something else; run: export SLURM_CONF=$SLURM_CONF"
    fi
}

if [[ ${1:-} == --check ]]; then
    healthy
    exit
fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--check]" >&2; exit 2; }

if healthy; then
    summary "already running, nothing to do"
    exit 0
fi
[[ $(id -u) == 0 ]] || { echo "up.sh: must run as root (it installs packages and starts the daemons)" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# Packages. libpmix2 must be there before slurmd starts (srun --mpi=pmix loads it). A
# policy-rc.d that refuses service starts keeps the packages from starting daemons of their own.

PACKAGES=(slurm-wlm slurmdbd munge libpmix2 openmpi-bin libopenmpi-dev mariadb-server)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        trap 'rm -f "$policy"' EXIT
    fi
    mkdir -p "$LOG"
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$LOG/apt.log" 2>&1
    }
    if ! apt_install; then
        say "apt-get install failed; updating the package lists and retrying"
        apt-get update -qq >>"$LOG/apt.log" 2>&1
        apt_install || { tail -20 "$LOG/apt.log" >&2; exit 1; }
    fi
    if [[ -n $policy ]]; then rm -f "$policy"; trap - EXIT; fi
    say "packages installed ($(since "$T0") s)"
fi

# ---------------------------------------------------------------------------------------------
# Folders and configuration.

mkdir -p "$RUN" "$LOG" "$DB" "$STATE/spool/slurmctld" "$CONF_DIR"
for node in "${NODES[@]}"; do
    mkdir -p "$STATE/spool/$node" "$STATE/tmp/$node" "$STATE/dev/$node"
    for i in 0 1; do ln -sfn /dev/null "$STATE/dev/$node/nvidia$i"; done
done
[[ -s $DB/slurm.pass ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DB/slurm.pass")

slurm_changed=0 dbd_changed=0
write_conf() {  # write_conf FILE GENERATOR MODE: (re)write FILE when it differs; status 0 when it changed
    same "$1" "$2" && return 1
    (umask 077 && "$2" >"$1.new")
    chmod "$3" "$1.new"
    mv "$1.new" "$1"
    say "wrote $1"
}
write_conf "$CONF_DIR/slurm.conf" slurm_conf 644 && slurm_changed=1
write_conf "$CONF_DIR/gres.conf" gres_conf 644 && slurm_changed=1
write_conf "$CONF_DIR/slurmdbd.conf" slurmdbd_conf 600 && dbd_changed=1

# Started daemons get no terminal and no inherited pipes (a caller capturing our output must not
# wait on them) and a session of their own (killing the caller's process group leaves them up).
# `detach` is for daemons that fork into the background themselves (their exiting parent is reaped
# here); `detach -f` forks for one that stays in the foreground (mariadbd).
detach() { setsid "$@" </dev/null >>"$LOG/daemons.out" 2>&1; }

# ---------------------------------------------------------------------------------------------
# munged, as user munge, on the default socket (every Slurm client finds it there).

if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    (umask 077 && dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none)
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 700 /etc/munge
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge "$MUNGE_DIR"
chown munge:munge /run/munge /var/lib/munge /var/log/munge "$MUNGE_DIR"
chmod 755 /run/munge
chmod 700 "$MUNGE_DIR"
if pid_of munged >/dev/null; then
    :
elif munge_answers; then
    say "a munged that up.sh did not start answers on the default socket: using it (down.sh leaves it alone)"
else
    say "starting munged"
    rm -f "$MUNGE_DIR/munged.pid"
    detach runuser -u munge -- munged --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log"
    wait_for 20 munged pid_of munged
fi
wait_for 20 "munge to answer" munge_answers

# ---------------------------------------------------------------------------------------------
# MariaDB, by hand as root, on a private port and socket under the state folder.

DB_SOCK=$DB/mysqld.sock
db() { mariadb --no-defaults --socket="$DB_SOCK" -uroot "$@"; }
if ! pid_of mariadbd >/dev/null; then
    if [[ ! -d $DB/data/mysql ]]; then
        say "creating the database in $DB/data"
        rm -rf "$DB/data"
        mariadb-install-db --no-defaults --user=root --datadir="$DB/data" --auth-root-authentication-method=socket \
            --skip-test-db >"$LOG/mariadb-install-db.log" 2>&1 || { tail -20 "$LOG/mariadb-install-db.log" >&2; exit 1; }
    fi
    say "starting mariadbd (port $DB_PORT)"
    rm -f "$RUN/mariadbd.pid"
    detach -f mariadbd --no-defaults --user=root --datadir="$DB/data" --socket="$DB_SOCK" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadbd.log" \
        --innodb-buffer-pool-size=128M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900
    wait_for 60 mariadbd db -e 'SELECT 1'
    wait_for 10 "mariadbd's pid file" pid_of mariadbd
fi
pass=$(cat "$DB/slurm.pass")
db <<SQL
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL

# ---------------------------------------------------------------------------------------------
# slurmdbd, then the cluster, an account and the users in it (so sacct works).

((dbd_changed)) && stop_daemon slurmdbd
if ! pid_of slurmdbd >/dev/null; then
    say "starting slurmdbd (port $DBD_PORT)"
    rm -f "$RUN/slurmdbd.pid"
    detach slurmdbd
    wait_for 60 slurmdbd pid_of slurmdbd
fi
wait_for 60 "slurmdbd to answer" sacctmgr -n list cluster
added_cluster=0
if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null
    added_cluster=1
fi
sacctmgr -n -P list account format=account | grep -qx dev ||
    sacctmgr -i -Q add account dev cluster="$CLUSTER" description="areal-hpc dev cluster" organization=areal >/dev/null
users=(root)
[[ -n ${SUDO_USER:-} && $SUDO_USER != root ]] && users+=("$SUDO_USER")
for user in "${users[@]}"; do
    sacctmgr -n -P list user format=user | grep -qx "$user" ||
        sacctmgr -i -Q add user "$user" account=dev cluster="$CLUSTER" >/dev/null
done

# ---------------------------------------------------------------------------------------------
# slurmctld and the two slurmd. A changed slurm.conf or gres.conf restarts all of them (node
# definitions do not change on reconfigure); a cluster just added to the database restarts slurmctld.

if ((slurm_changed)); then
    for node in "${NODES[@]}"; do stop_daemon "slurmd-$node"; done
    stop_daemon slurmctld
elif ((added_cluster)); then
    stop_daemon slurmctld
fi
if ! pid_of slurmctld >/dev/null; then
    say "starting slurmctld (port $CTLD_PORT)"
    rm -f "$RUN/slurmctld.pid"
    detach slurmctld
    wait_for 30 slurmctld pid_of slurmctld
fi
wait_for 30 "slurmctld to answer" scontrol ping
for node in "${NODES[@]}"; do
    if ! pid_of "slurmd-$node" >/dev/null; then
        say "starting slurmd -N $node (port ${NODE_PORT[$node]})"
        rm -f "$RUN/slurmd-$node.pid"
        detach slurmd -N "$node"
        wait_for 30 "slurmd -N $node" pid_of "slurmd-$node"
    fi
done

# Nodes left drained or down by an earlier run (a killed slurmd, a failed kill) are resumed.
for node in "${NODES[@]}"; do
    state=$(sinfo -h -N -n "$node" -o %t 2>/dev/null | head -1)
    if [[ $state == drain* || $state == drng* || $state == down* || $state == fail* ]]; then
        say "resuming $node (was $state)"
        scontrol update nodename="$node" state=resume 2>/dev/null || true
    fi
done
wait_for 60 "both nodes to be idle" nodes_usable

# ---------------------------------------------------------------------------------------------
# Smoke test: one job step across both nodes. When other people's jobs hold the nodes (a repair
# of a busy cluster), it waits at most 30 s for room and is skipped if none comes.

busy=$(squeue -h -t running,completing -o %A 2>/dev/null | head -1)
smoke=$(timeout 60 srun ${busy:+--immediate=30} -p all -N2 -n2 -l --time=1 -J up.sh-smoke printenv SLURMD_NODENAME 2>"$LOG/smoke.err" |
    awk '{print $2}' | sort | tr '\n' ' ') || true
if [[ $smoke == "rollout1 train1 " ]]; then
    summary "smoke srun across train1 and rollout1 ok"
elif [[ -n $busy && -z $(squeue -h -t pending,running -n up.sh-smoke -o %A 2>/dev/null) ]] && nodes_usable; then
    summary "smoke srun skipped: the nodes are busy with other jobs"
else
    echo "up.sh: smoke job 'srun -p all -N2 printenv SLURMD_NODENAME' printed '$smoke' (logs in $LOG):" >&2
    cat "$LOG/smoke.err" >&2
    exit 1
fi
