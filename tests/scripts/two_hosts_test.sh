#!/usr/bin/env bash
# Two hosts for real, on one machine: two network namespaces joined by a veth pair, each with its
# own address, and train_gpt at 2 ranks across them (one per namespace), launched by zero-launch
# with a hostfile naming the two addresses and OpenMPI's TCP transports only. No sshd: OpenMPI
# starts its daemon on the other "host" through a plm_rsh_agent that runs the command inside
# that namespace (`ip netns exec`). The run must equal the same training at 2 ranks on one host
# (mpirun without namespaces), loss for loss, and the single-process LocalComm run's summary.
# Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2 and OpenMPI's mpirun; exits 77
# (skipped) without them. Usage: two_hosts_test.sh TRAIN_GPT ZERO_LAUNCH WORK_DIR
set -euo pipefail
train_gpt=$1 launch=$2 work=$3
skip() { echo "two_hosts_test: $*; skipped"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "needs iproute2 (ip)"
command -v mpirun >/dev/null || skip "needs OpenMPI's mpirun"
mpirun --version 2>/dev/null | grep -q "Open MPI" || skip "mpirun is not OpenMPI"

tag=$$
a=zero_a_$tag b=zero_b_$tag
ip netns add "$a" 2>/dev/null || skip "cannot create network namespaces here"
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$b"
# One veth pair: one end in each namespace, 10.77.x.1 and 10.77.x.2 on a /24 of their own.
net=10.77.$((tag % 250))
ip link add "va$tag" type veth peer name "vb$tag"
ip link set "va$tag" netns "$a"
ip link set "vb$tag" netns "$b"
ip -n "$a" addr add "$net.1/24" dev "va$tag"
ip -n "$b" addr add "$net.2/24" dev "vb$tag"
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
done
ip -n "$a" link set "va$tag" up
ip -n "$b" link set "vb$tag" up

mkdir -p "$work"
rm -f "$work"/*.jsonl "$work/agent.log"
printf '%s slots=1\n%s slots=1\n' "$net.1" "$net.2" >"$work/hostfile"
# The "remote shell": OpenMPI calls it as `agent HOST COMMAND...` to start its daemon on HOST.
cat >"$work/netns_agent.sh" <<AGENT
#!/bin/sh
host=\$1; shift
case "\$host" in
  $net.1) ns=$a ;;
  $net.2) ns=$b ;;
  *) echo "netns_agent: unknown host \$host" >&2; exit 1 ;;
esac
echo "\$host \$ns" >>"$work/agent.log"
exec ip netns exec "\$ns" sh -c "\$*"
AGENT
chmod +x "$work/netns_agent.sh"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=PASSIVE
args=(--steps 20 --print-every 5 --layers 2 --channels 64 --seq 32 --stage 3)
mca="--mca plm_rsh_agent $work/netns_agent.sh --mca btl tcp,self --mca btl_tcp_if_include $net.0/24 --mca oob_tcp_if_include $net.0/24"
echo "== zero-launch command (run inside namespace $a):"
python3 "$launch" -H "$work/hostfile" --launcher_args "$mca" -x OMPI_ALLOW_RUN_AS_ROOT \
  -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM --dry-run "$train_gpt" "${args[@]}" --metrics "$work/two_hosts.jsonl"
ip netns exec "$a" python3 "$launch" -H "$work/hostfile" --launcher_args "$mca" \
  -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
  "$train_gpt" "${args[@]}" --metrics "$work/two_hosts.jsonl" | tee "$work/two_hosts.log"
# The hosts really were two: OpenMPI started its daemon for the second address through the agent.
grep -q "^$net.2 $b\$" "$work/agent.log" || { echo "no daemon was started in namespace $b"; exit 1; }
mpirun_one_host=(mpirun -n 2 --oversubscribe "$train_gpt" "${args[@]}" --metrics "$work/one_host.jsonl")
"${mpirun_one_host[@]}" >"$work/one_host.log"
"$train_gpt" "${args[@]}" --ranks 2 >"$work/local.log"

losses() { python3 -c 'import json,sys; print([json.loads(l)["loss"] for l in open(sys.argv[1]) if "loss" in l])' "$1"; }
two=$(losses "$work/two_hosts.jsonl") one=$(losses "$work/one_host.jsonl")
echo "losses across two hosts: $two"
echo "losses on one host:      $one"
[ "$two" = "$one" ] || { echo "the two-host run differs from the one-host run"; exit 1; }
summary() { grep -E '^loss .* validation loss' "$1"; }
[ "$(summary "$work/two_hosts.log")" = "$(summary "$work/local.log")" ] ||
  { echo "the two-host run's summary differs from LocalComm's:"; summary "$work/two_hosts.log"; summary "$work/local.log"; exit 1; }
echo "two hosts ok: $(summary "$work/two_hosts.log")"
