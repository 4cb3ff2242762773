"""Two "hosts" on one machine for multi-node tests: Linux network namespaces joined by a veth pair, each
running Debian's sshd (key auth with keys made here). Traffic stays inside the two namespaces.

Needs root, ``ip`` (iproute2), ``sshd``/``ssh`` (openssh-server/-client); ``.ci/run`` installs them. Tests that
start every node's launcher themselves (``--no_ssh``) ask for hosts without sshd, and need only root and ``ip``.
``why_unavailable()`` says what is missing, for a clear skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.250.77"  # only ever assigned inside the namespaces made here


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def why_unavailable(sshd: bool = True) -> str | None:
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    for tool in ("ip", "/usr/sbin/sshd", "ssh", "ssh-keygen") if sshd else ("ip",):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 openssh-server openssh-client)"
    probe = f"swprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe)
    if made.returncode != 0:
        return f"this machine forbids network namespaces: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe)
    return None


@dataclass
class Hosts:
    namespaces: list[str]
    addrs: list[str]
    ssh_config: Path
    sshd: list[subprocess.Popen]
    tag: str

    def in_ns(self, index: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index], *cmd]

    def hostfile(self, path: Path, slots: int = 2) -> Path:
        path.write_text("# two namespace hosts\n" + "".join(f"{a} slots={slots}\n" for a in self.addrs))
        return path


def _sshd_config(tmp: Path, addr: str, name: str) -> Path:
    config = tmp / f"sshd_{name}.conf"
    config.write_text("\n".join([
        "Port 22", f"ListenAddress {addr}", f"HostKey {tmp / 'host_key'}", f"PidFile {tmp / f'sshd_{name}.pid'}",
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}", "StrictModes no", "UsePAM no",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes", "LogLevel ERROR", "MaxStartups 100", "MaxSessions 100", "",
    ]))
    return config


def _keys(tmp: Path) -> Path:
    for name in ("client_key", "host_key"):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name))
    (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
    ssh_config = tmp / "ssh_config"
    ssh_config.write_text("\n".join([
        "Host *", "  User root", f"  IdentityFile {tmp / 'client_key'}", "  IdentitiesOnly yes",
        "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR", "",
    ]))
    return ssh_config


def _check(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed: {result.stderr.strip()}")


def make_hosts(tmp: Path, count: int = 2, sshd: bool = True) -> Hosts:
    tag = f"{os.getpid() % 100000}"
    names = [f"sw{tag}h{i}" for i in range(count)]
    addrs = [f"{SUBNET}.{i + 1}" for i in range(count)]
    hosts = Hosts(names, addrs, _keys(tmp) if sshd else tmp / "no_ssh_config", [], tag)
    try:
        _build(hosts, tmp, sshd)
    except BaseException:
        remove_hosts(hosts)  # nothing half-made is left behind
        raise
    return hosts


def _build(hosts: Hosts, tmp: Path, sshd: bool) -> None:
    names, addrs, tag = hosts.namespaces, hosts.addrs, hosts.tag
    for name in names:
        _check(_run("ip", "netns", "add", name), f"ip netns add {name}")
        _check(_run("ip", "-n", name, "link", "set", "lo", "up"), "lo up")
    # a bridge-less pair: veth for two hosts (the only topology the tests need)
    _check(_run("ip", "link", "add", f"sw{tag}v0", "type", "veth", "peer", "name", f"sw{tag}v1"), "veth pair")
    for i, name in enumerate(names):
        dev = f"sw{tag}v{i}"
        _check(_run("ip", "link", "set", dev, "netns", name), "move veth")
        _check(_run("ip", "-n", name, "addr", "add", f"{addrs[i]}/24", "dev", dev), "address")
        _check(_run("ip", "-n", name, "link", "set", dev, "up"), "link up")
    if not sshd:
        return
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    for i, name in enumerate(names):
        config = _sshd_config(tmp, addrs[i], name)
        hosts.sshd.append(subprocess.Popen(hosts.in_ns(i, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_for_ssh(hosts)


def _wait_for_ssh(hosts: Hosts) -> None:
    deadline = time.monotonic() + 20
    for addr in hosts.addrs:
        while True:
            probe = _run(*hosts.in_ns(0, ["ssh", "-F", str(hosts.ssh_config), addr, "true"]))
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd at {addr} did not answer: {probe.stderr.strip()}")
            time.sleep(0.2)


def remove_hosts(hosts: Hosts) -> None:
    for proc in hosts.sshd:
        proc.kill()
        proc.wait(timeout=10)
    _run("ip", "link", "del", f"sw{hosts.tag}v0")  # only exists here if it never moved into a namespace
    for name in hosts.namespaces:
        _run("ip", "netns", "del", name)  # deleting a namespace deletes its veth end, and so the pair


@contextlib.contextmanager
def namespace_hosts(tmp_path_factory: pytest.TempPathFactory, needed_by: str, sshd: bool = True) -> Iterator[Hosts]:
    """Two hosts for a module's tests, removed afterwards; skips those tests, with the reason, where they
    cannot be made. ``sshd=False``: no sshd in them (for tests that start each node's launcher themselves)."""
    reason = why_unavailable(sshd)
    if reason:
        pytest.skip(f"{needed_by} need two network-namespace hosts: {reason}")
    made = make_hosts(tmp_path_factory.mktemp("hosts"), sshd=sshd)
    try:
        yield made
    finally:
        remove_hosts(made)
