"""Hosts on one switch, on one machine: network namespaces joined by a Linux bridge, their links shaped.

`switched_hosts(count, rate, delay_ms)` makes `count` network namespaces ("hosts") and one more holding
a bridge (the "switch"); each host has one veth (`eth0`, address 10.250.91.<i+1>/24) whose other end is a
port of the bridge. Everything is created inside those namespaces (`ip link add ... netns`): the root
namespace's links are never touched. Needs root and iproute2 (`ip`, `tc`) and util-linux (`nsenter`, `setpriv`).

Shaping ([Note: link shaping]). A real node's NIC limits what it sends and what it receives, so every
host's `eth0` (what it sends) and every bridge port (what the bridge delivers to that host: what it
receives) gets a root qdisc:
* `netem rate <rate> delay <delay_ms>ms limit 100000` on `eth0` (`netem rate <rate>` on the port) where the
  kernel has netem: one qdisc paces packets at the rate and delays them; GSO packets (veth sends up to
  64 KiB at once) are paced by their length, not split;
* otherwise `tbf rate <rate> burst <max(128 KiB, 1 ms at rate)> limit 64 MiB`, and no delay (tbf cannot
  delay): the burst holds a whole GSO packet (a smaller one makes tbf split every GSO packet in software)
  and the limit (bytes) is larger than what TCP Small Queues lets gloo's sockets queue (a few MiB per
  socket), so nothing is dropped: TCP is limited by the rate, not by losses. `Shaping` says which was
  applied, `qdisc_stats()` reports drops so a run can show there were none.
`rate=None`: no qdisc (the veth's own speed: CPU-bound memory copies).

Processes. `SwitchedHosts.start(i, cmd, env)` runs a command in host i's network namespace and in host i's
mount namespace, where a private tmpfs is mounted over /dev/shm. shardwise's collectives use shared memory
between ranks that can map each other's /dev/shm files (`distributed/shm.py`); with the machine's /dev/shm
two ranks on different "hosts" would talk through it and bypass the network. Ranks started in the same
host share its /dev/shm (as GPUs of one node share NVLink). The mount namespace is held open by one
`sleep` per host started with `ip netns exec` (which also mounts that namespace's own sysfs, so
/sys/class/net shows the host's interfaces); commands enter it with `nsenter --target <sleep's pid>`.

Everything made here is removed when the `with` block ends, also on an error, KeyboardInterrupt or SIGTERM
(turned into SystemExit while the block runs): the processes are stopped, and with the last process of a
host's mount namespace its /dev/shm goes too; deleting a namespace deletes its veth end and so the pair.
If this process is SIGKILLed, what it started dies with it (parent-death signal); the namespaces, named
`swsl<pid>...`, stay until `remove_stale()` deletes those whose process is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.250.91"  # only ever assigned inside the namespaces made here (tests use 10.250.77)
PREFIX = "swsl"
INTERFACE = "eth0"
TBF_LIMIT_BYTES = 64 * 2**20
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"]
"""Prefix of every command started here: killed if this process dies without cleaning up (SIGKILL), as
`setpriv`, `nsenter`, `ip netns exec` and `sh` all exec the next one and the signal survives exec."""
NETEM_LIMIT_PACKETS = 100_000


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return result


def why_unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces, bridges and tc need root (run with sudo)"
    for tool in ("ip", "tc", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 util-linux)"
    return None


@dataclass(frozen=True)
class Shaping:
    """What was applied to every link: the qdisc, the rate, the one-way delay, and why it differs from the ask."""

    qdisc: str | None
    rate: str | None
    delay_ms: float
    note: str = ""


@dataclass
class Host:
    index: int
    namespace: str
    address: str
    interface: str = INTERFACE
    holder: subprocess.Popen | None = None
    """The `sleep` that holds the host's mount namespace (private /dev/shm, the namespace's sysfs)."""


@dataclass
class SwitchedHosts:
    hosts: list[Host]
    switch: str
    shaping: Shaping
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, index: int, cmd: list[str], cwd: str | Path | None = None) -> list[str]:
        """`cmd` as run in host `index`: its network namespace, its mount namespace (private /dev/shm)."""
        holder = self.hosts[index].holder
        if holder is None:
            raise RuntimeError(f"host {index} has no mount namespace (it was removed)")
        return [*_DIE_WITH_PARENT, "nsenter", f"--target={holder.pid}", "--mount", "--net",
                f"--wd={cwd or os.getcwd()}", "--", *cmd]

    def start(self, index: int, cmd: list[str], env: Mapping[str, str], cwd: str | Path | None = None,
              log: Path | None = None) -> subprocess.Popen:
        """Start `cmd` in host `index` with exactly `env`; stdout and stderr go to `log` (or are dropped).
        The process is killed when the hosts are removed, if it is still running."""
        out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(self.command(index, cmd, cwd), env=dict(env), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                out.close()  # the child has its own copy
        self.processes.append(proc)
        return proc

    def counters(self, index: int) -> dict[str, int]:
        """Host `index`'s eth0 byte and packet counters, read from outside (`ip -s` in its namespace)."""
        host = self.hosts[index]
        link = json.loads(_run("ip", "-n", host.namespace, "-j", "-s", "link", "show", "dev", host.interface).stdout)[0]
        stats = link["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def qdisc_stats(self) -> list[dict[str, int]]:
        """Per host: packets the shaping qdiscs dropped and sent, its eth0 (`tx_*`) and its bridge port (`rx_*`)."""
        out = []
        for host in self.hosts:
            row: dict[str, int] = {}
            for side, ns, dev in (("tx", host.namespace, host.interface), ("rx", self.switch, f"port{host.index}")):
                for q in json.loads(_run("tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev", dev).stdout or "[]"):
                    if q.get("root"):
                        row[f"{side}_dropped"] = q.get("drops", 0)
                        row[f"{side}_overlimits"] = q.get("overlimits", 0)
            out.append(row)
        return out


def read_counters(interface: str = INTERFACE) -> dict[str, int]:
    """This process's view of `interface`'s counters (sysfs of the namespace it runs in: for the ranks)."""
    base = Path("/sys/class/net") / interface / "statistics"
    return {name: int((base / name).read_text()) for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}


def _has_netem(namespace: str) -> bool:
    made = _run("tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms", check=False)
    _run("tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root", check=False)
    return made.returncode == 0


def _rate_bits(rate: str) -> float:
    match = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not match:
        raise ValueError(f"rate: a tc rate such as '1gbit' or '500mbit'; got {rate!r}.")
    value = float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]
    return value * (8 if match[3] == "bps" else 1)


def _qdisc_args(rate: str, delay_ms: float, netem: bool, sender: bool) -> list[str]:
    """The root qdisc of one direction of a link ([Note: link shaping]); the delay goes on the sender's side."""
    if netem:
        delay = ["delay", f"{delay_ms}ms"] if sender and delay_ms > 0 else []
        return ["netem", "rate", rate, *delay, "limit", str(NETEM_LIMIT_PACKETS)]
    burst = max(128 * 1024, int(_rate_bits(rate) / 8 / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(TBF_LIMIT_BYTES)]


def _shape(made: SwitchedHosts, rate: str | None, delay_ms: float) -> Shaping:
    if rate is None:
        return Shaping(None, None, 0.0, "unshaped" + (f"; delay {delay_ms} ms needs a rate" if delay_ms else ""))
    _rate_bits(rate)  # a clear error before tc's own
    netem = _has_netem(made.switch)
    for host in made.hosts:
        _run("tc", "-n", host.namespace, "qdisc", "add", "dev", host.interface, "root",
             *_qdisc_args(rate, delay_ms, netem, sender=True))
        _run("tc", "-n", made.switch, "qdisc", "add", "dev", f"port{host.index}", "root",
             *_qdisc_args(rate, delay_ms, netem, sender=False))
    if netem:
        return Shaping("netem", rate, delay_ms)
    note = f"this kernel has no netem: the {delay_ms} ms delay was not applied" if delay_ms else ""
    return Shaping("tbf", rate, 0.0, note)


def _build(made: SwitchedHosts, tag: str) -> None:
    _run("ip", "netns", "add", made.switch)
    _run("ip", "-n", made.switch, "link", "set", "lo", "up")
    _run("ip", "-n", made.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
    _run("ip", "-n", made.switch, "link", "set", "br0", "up")
    for host in made.hosts:
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        # both ends are born in their namespaces: nothing appears in the root namespace
        _run("ip", "link", "add", host.interface, "netns", host.namespace, "type", "veth",
             "peer", "name", f"port{host.index}", "netns", made.switch)
        _run("ip", "-n", made.switch, "link", "set", f"port{host.index}", "master", "br0", "up")
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _run("ip", "-n", host.namespace, "link", "set", host.interface, "up")
        host.holder = _hold_mount_namespace(host.namespace)


def _hold_mount_namespace(namespace: str) -> subprocess.Popen:
    """A process whose mount namespace has a private /dev/shm; `ip netns exec`, `sh` and `sleep` exec one
    another, so its pid is the sleep's. Returns once the tmpfs is mounted."""
    script = "mount -t tmpfs -o mode=1777 swsl-shm /dev/shm && echo ready && exec sleep infinity"
    holder = subprocess.Popen([*_DIE_WITH_PARENT, "ip", "netns", "exec", namespace, "sh", "-c", script],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if holder.stdout is None or holder.stdout.readline().strip() != "ready":
        error = holder.stderr.read() if holder.stderr else ""
        holder.kill()
        holder.wait()
        raise RuntimeError(f"could not mount a private /dev/shm in {namespace}: {error.strip()}")
    return holder


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def remove(made: SwitchedHosts) -> None:
    """Stop every process started in the hosts, then delete the namespaces (their veths and the bridge go too)."""
    for proc in made.processes:
        _stop(proc)
    for host in made.hosts:
        if host.holder is not None:
            _stop(host.holder, grace_s=1.0)
            host.holder = None
    for name in [h.namespace for h in made.hosts] + [made.switch]:
        _run("ip", "netns", "del", name, check=False)  # absent when building failed before it


def remove_stale() -> list[str]:
    """Delete namespaces left by runs of this module whose process no longer exists; returns their names."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    stale = []
    for name in names:
        match = re.fullmatch(rf"{PREFIX}(\d+)(?:h\d+|sw)", name)
        if match and not Path(f"/proc/{match[1]}").exists():
            _run("ip", "netns", "del", name, check=False)
            stale.append(name)
    return stale


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit while the hosts exist, so that `finally` removes them."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def switched_hosts(count: int, rate: str | None, delay_ms: float = 0.0) -> Iterator[SwitchedHosts]:
    """`count` hosts on one bridge, every link shaped to `rate` (None: unshaped) and `delay_ms` one way."""
    reason = why_unavailable()
    if reason:
        raise RuntimeError(f"switched_hosts: {reason}")
    if not 1 <= count <= 250:
        raise ValueError(f"count: between 1 and 250 hosts; got {count}.")
    tag = f"{PREFIX}{os.getpid()}"
    hosts = [Host(i, f"{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
    made = SwitchedHosts(hosts, f"{tag}sw", Shaping(None, None, 0.0))
    with _sigterm_as_exit():
        try:
            _build(made, tag)
            made.shaping = _shape(made, rate, delay_ms)
            yield made
        finally:
            remove(made)
