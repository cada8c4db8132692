"""A real Slurm on one host for tests: Debian's slurmctld, two slurmd "nodes" and munge.

What works on a machine like CI's (Debian 12, root, no systemd, no cgroups): install with
`apt-get install --no-install-recommends`, start the daemons directly, run fake nodes
`-N name` on one host (Debian's slurmd is built with MULTIPLE_SLURMD).
Everything this cluster writes (config, state, spool, logs, sockets, pid files) lives in one
temporary folder; its munged has a socket of its own, so a munged already running is never
touched. The only change outside that folder is one /etc/hosts line naming the fake nodes,
removed again by `stop()`.

    with SlurmCluster.start() as cluster:          # raises SlurmUnavailable with a reason
        job = cluster.sbatch("launch/slurm/one_node.sbatch", "sampling.max_tokens=8")
        info = cluster.wait(job, timeout_s=120)     # scontrol's fields; JobState=COMPLETED
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "srun", "munged")
NODES = ("psn1", "psn2")
_HOSTS_TAG = "# pipeserve test slurm nodes"
_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why (tests skip with it)."""


def ensure_installed(timeout_s: float = 150.0) -> None:
    """Finds Debian's Slurm and munge, or installs them (root + apt only)."""
    if all(_bin(d) for d in DAEMONS):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    deadline = time.monotonic() + timeout_s
    for attempt in ("install", "update", "install"):
        cmd = ["apt-get", "update", "-q"] if attempt == "update" else install
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` ran past {timeout_s:.0f} s") from None
        if attempt == "install" and done.returncode == 0:
            return
    raise SlurmUnavailable(f"apt-get could not install {' '.join(APT_PACKAGES)}: "
                           f"{(done.stderr or done.stdout)[-600:]}")


def _bin(name: str) -> str | None:
    """Where a Slurm/munge program is (the daemons live in /usr/sbin, not always on PATH)."""
    found = shutil.which(name) or Path("/usr/sbin", name)
    return str(found) if Path(found).exists() else None


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a job binds it minutes later, and a port the
    kernel hands out for port 0 in between (any process's) could take it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def slurm_conf(root: Path, *, hostname: str, ctld_port: int, node_ports: dict[str, int],
               cpus_per_node: int, memory_mb: int, munge_socket: Path) -> str:
    """slurm.conf without cgroups or accounting (what NOTES.md found to work)."""
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={cpus_per_node} RealMemory={memory_mb} State=UNKNOWN"
        for name, port in node_ports.items())
    return f"""\
ClusterName=pipeserve-test
SlurmctldHost={hostname}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MailProg=/bin/true
SlurmctldPort={ctld_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """A controller and len(NODES) node daemons on this host, all children of this process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self._hosts_line: str | None = None

    # ---- start / stop

    @classmethod
    def start(cls, *, cpus_per_node: int = 4, timeout_s: float = 60.0) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable("running Slurm daemons on this host needs root")
        ensure_installed()
        # Not a pytest tmp_path: those are 0700 and the munge user must reach its socket.
        cluster = cls(Path(tempfile.mkdtemp(prefix="pipeserve-slurm-")))
        try:
            cluster._start(cpus_per_node, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, cpus_per_node: int, timeout_s: float) -> None:
        self.root.chmod(0o755)
        for sub in ("state", "spool", "run", "log"):
            (self.root / sub).mkdir()
        munge_socket = self._start_munge()
        hostname = socket.gethostname().split(".")[0]
        self.conf.write_text(slurm_conf(
            self.root, hostname=hostname, ctld_port=free_port(),
            node_ports={n: free_port() for n in NODES}, cpus_per_node=cpus_per_node,
            memory_mb=_memory_mb() // 2, munge_socket=munge_socket))
        self._add_hosts_line()
        self._spawn("slurmctld", [_bin("slurmctld"), "-D", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_bin("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait_idle(timeout_s)

    def _start_munge(self) -> Path:
        """A munged of our own (own socket, pid and seed files), reading the system's key."""
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            raise SlurmUnavailable(f"{key} is missing (munge's postinst creates it)")
        folder = self.root / "munge"
        folder.mkdir()
        folder.chmod(0o755)  # munged wants the socket folder searchable by all
        shutil.chown(folder, "munge", "munge")
        sock = folder / "munge.socket"
        self._spawn("munged", [_bin("munged"), "-F", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed",
                               f"--log-file={folder}/munged.log"], user="munge")
        _until(lambda: sock.exists(), 10.0, lambda: f"munged did not start: {self._log('munged')}")
        return sock

    def _spawn(self, name: str, cmd: list[str], user: str | None = None) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, user=user,
                                            group=user, start_new_session=True)
        out.close()

    def _wait_idle(self, timeout_s: float) -> None:
        def idle() -> bool:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with code {proc.returncode}: {self._log(name)}")
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            return all(state == "idle" for state in out[1::2]) and len(out) == 2 * len(NODES)

        _until(idle, timeout_s, lambda: f"nodes not idle: {self.run('sinfo', check=False).stdout}"
                                        f"{self._log('slurmctld')}")

    def stop(self) -> None:
        """Cancels every job, stops the daemons (SIGTERM, then SIGKILL), removes the hosts line."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                self._cancel_all()
            for name in reversed(list(self.procs)):  # slurmds, then slurmctld, then munged
                _terminate(self.procs[name])
        finally:
            self._remove_hosts_line()
            shutil.rmtree(self.root, ignore_errors=True)

    def _cancel_all(self, timeout_s: float = 20.0) -> None:
        """Cancels every job and waits (bounded) until none is left, so that the node daemons
        are still there to kill the jobs' processes."""
        self.run("scancel", "--partition=debug", check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
                return
            time.sleep(0.25)

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- /etc/hosts: the fake node names resolve to this host

    def _add_hosts_line(self) -> None:
        line = f"127.0.0.1 {' '.join(NODES)} {_HOSTS_TAG} {os.getpid()}\n"
        try:
            with open("/etc/hosts", "a") as f:
                f.write(line)
        except OSError as e:
            raise SlurmUnavailable(f"cannot name the fake nodes in /etc/hosts: {e}") from None
        self._hosts_line = line

    def _remove_hosts_line(self) -> None:
        if self._hosts_line is None:
            return
        hosts = Path("/etc/hosts")
        lines = hosts.read_text().splitlines(keepends=True)
        hosts.write_text("".join(line for line in lines if line != self._hosts_line))
        self._hosts_line = None

    # ---- using it

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's clients (sbatch passes it on to the job)."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd: str, check: bool = True, env: dict | None = None, cwd: Path | None = None,
            timeout_s: float = 30.0):
        done = subprocess.run(cmd, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}")
        return done

    def sbatch(self, script: str | Path, *args: str, options: tuple[str, ...] = (),
               env: dict | None = None, cwd: Path | None = None) -> str:
        """Submits `script args...` from `cwd` (the job's SLURM_SUBMIT_DIR and working
        directory); returns the job id."""
        out = self.run("sbatch", "--parsable", *options, str(script), *args, env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (the first line when it is an array)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()[0]
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def wait(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Polls scontrol until the job ends (faster than `sbatch --wait`); bounded."""
        info: dict[str, str] = {}

        def ended() -> bool:
            nonlocal info
            info = self.job(job_id)
            return info.get("JobState") in _FINAL_STATES

        _until(ended, timeout_s, lambda: f"job {job_id} still {info.get('JobState')} after {timeout_s:.0f} s "
                                         f"({info.get('Reason')})", TimeoutError)
        return info

    def _log(self, name: str) -> str:
        paths = [self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"]
        return "".join(p.read_text(errors="replace")[-1500:] for p in paths if p.exists())


def _until(ready, timeout_s: float, why, error: type[Exception] = SlurmUnavailable) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise error(why())
        time.sleep(0.25)


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4096
