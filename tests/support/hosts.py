"""Test hosts: separate Linux "hosts" on this one machine, on their own network, sharing a real
network filesystem (sshfs), each with its own agent. For tests/e2e/test_multihost.py and bench/.

    with Cluster(hosts=2) as cluster:           # "storage" + host0, host1
        a, b = cluster.hosts
        agent = a.start_agent(workdir)          # the real agent, inside host0
        a.run(["python", "-c", "..."])          # a process inside host0
        cluster.shared                          # the sshfs mount point, one path on every host

What a host is (docs/multihost.md tells why each part is there):
- its own network, mount, UTS (hostname) and pid namespaces, held by one long-lived init
  process (`unshare ... python INIT`, pid 1 of the host: it reaps orphans). The namespaces
  have no names: nothing is added to /run/netns, and when the init dies (the harness closes
  the cluster, or dies itself: the kernel's parent-death signal) the kernel kills every
  process of the host and frees its mounts and interfaces. Nothing outlives a failed test.
- a process "on" a host is a child of a small forwarder (ENTER) that joins the init's four
  namespaces and forks: the child is inside the host's pid namespace (pids as on another
  machine: they collide with other hosts'), the forwarder stays outside and passes signals
  on, so subprocess.Popen's send_signal/wait/returncode work as for a local process.
- its hostname is its node name (nobody sets CKPTWATCH_NODE); /etc/hosts (bind-mounted in
  each host) names every host, as a cluster's DNS would.
- network: a bridge in the storage host's namespace, one veth pair per compute host
  (eth0 inside the host, cw<run>h<i> on the bridge), created inside the namespaces so
  nothing touches this machine's own network namespace. The addresses (198.18.0.0/24, the
  RFC 2544 benchmarking range) exist only inside this cluster's namespaces, so clusters of
  several engineers or CI runs never meet, even with the same addresses; device names carry
  the run id anyway.
- shared storage: sshd (OpenSSH, per-run keys) in the storage host serves Cluster.export;
  every compute host mounts it with sshfs (FUSE, type fuse.sshfs) at Cluster.shared, a path
  that is an empty directory outside the hosts.
"""
from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import agentproc
from helpers import REPO_ROOT, subprocess_env, wait_for
from ckptwatch.sharedfs import parse_mountinfo

TOOLS = ("unshare", "setpriv", "nsenter", "ip", "sshfs", "ssh", "ssh-keygen")
SSHD = "/usr/sbin/sshd"
SUBNET = "198.18.0"
STORAGE_ADDR = f"{SUBNET}.1"
CLONE_NEWNET = 0x40000000
MASTER_PORT = 29500     # each cluster's network is its own: a fixed port never clashes

# pid 1 of a host: names the host, says it is ready, reaps every orphan until killed.
INIT = r'''
import os, socket, sys, time
socket.sethostname(sys.argv[1])
print("ready", flush=True)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.2)
'''

# The forwarder: joins the namespaces of the host whose init is argv[1], chdirs to argv[2],
# forks the command after "--" into the host's pid namespace, passes signals on, and exits
# as the command did (by the same signal, if it died of one).
ENTER = r'''
import ctypes, os, signal, sys
pid, cwd, argv = sys.argv[1], sys.argv[2], sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
for ns in ("uts", "net", "pid", "mnt"):
    fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
    if libc.setns(fd, 0) != 0:
        sys.stderr.write(f"hosts: joining {ns} of {pid}: {os.strerror(ctypes.get_errno())}\n")
        sys.exit(126)
    os.close(fd)
os.chdir(cwd)
child = os.fork()
if child == 0:
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"hosts: {argv[0]}: {exc}\n")
    os._exit(127)
def forward(sig, frame):
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2):
    signal.signal(sig, forward)
_, status = os.waitpid(child, 0)
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


class HostsUnavailable(Exception):
    """This machine cannot make test hosts (not root, a tool missing, the kernel refuses
    namespaces or FUSE). The message says which, for a skip reason."""


_problem: list = []


def problem() -> str | None:
    """Why test hosts cannot be made here, or None. Checked once per process."""
    if not _problem:
        _problem.append(_find_problem())
    return _problem[0]


def _find_problem() -> str | None:
    if os.geteuid() != 0:
        return "test hosts need root (network, mount and pid namespaces, FUSE mounts)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    if missing:
        return ("missing " + ", ".join(missing) +
                ": apt-get install iproute2 sshfs openssh-server util-linux")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--net", "--mount",
                            "--uts", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"the kernel refuses namespaces: {probe.stderr.strip()[:300]}"
    with open("/proc/filesystems") as f:
        if "fuse" not in f.read().split():
            return "the kernel has no FUSE (no 'fuse' in /proc/filesystems)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


class Host:
    """One test host: its init process, its address, ways to run things in it."""

    def __init__(self, cluster: "Cluster", name: str, addr: str):
        self.cluster = cluster
        self.name = name
        self.addr = addr
        self.dir = os.path.join(cluster.root, name)     # this host's files (logs, agent)
        self._unshare: subprocess.Popen | None = None
        self.init_pid: int | None = None

    # ---- life --------------------------------------------------------------------------

    def boot(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        # setpriv: the kernel kills unshare (and with --kill-child, the init: the whole host)
        # when the thread that booted the cluster dies, even by SIGKILL.
        with open(os.path.join(self.dir, "init.log"), "wb") as log:
            self._unshare = subprocess.Popen(
                ["setpriv", "--pdeathsig", "SIGKILL", "--",
                 "unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "--net",
                 "--mount", "--uts", "--propagation", "private",
                 sys.executable, "-I", "-S", "-c", INIT, self.name],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        line = self._unshare.stdout.readline()
        if line.strip() != b"ready":
            self._unshare.wait(10)
            with open(os.path.join(self.dir, "init.log"), errors="replace") as f:
                raise HostsUnavailable(f"host {self.name} did not start: {f.read()[-500:]}")
        self.init_pid = self._init_pid()

    def _init_pid(self) -> int:
        path = f"/proc/{self._unshare.pid}/task/{self._unshare.pid}/children"

        def children():
            with open(path) as f:
                return f.read().split()
        return int(wait_for(children, timeout=10, message=f"the init of {self.name}")[0])

    def halt(self) -> None:
        """Kill the host: the init dies, the kernel kills every process in its pid namespace,
        its mounts and interfaces go with the last of them."""
        if self._unshare is None:
            return
        if self._unshare.poll() is None:
            # Killing the init itself (not unshare): unshare, its parent, reaps it, and the
            # kernel lets the init finish dying only once every process of its pid namespace
            # has died, so once unshare has exited nothing of the host is left. (No init yet:
            # unshare's death kills whatever it started.)
            try:
                os.kill(self.init_pid or self._unshare.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self._unshare.wait(30)
        except subprocess.TimeoutExpired:
            self._unshare.kill()
            self._unshare.wait(30)
        self._unshare.stdout.close()
        self._unshare = None

    # ---- running things in it ----------------------------------------------------------

    def popen(self, argv, *, cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """subprocess.Popen of argv inside this host (env, stdout, ... as for Popen)."""
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", ENTER, str(self.init_pid), cwd or REPO_ROOT,
             "--", *argv], **kwargs)
        self.cluster._procs.append(proc)
        return proc

    def run(self, argv, *, timeout: float = 120, check: bool = True, input: str | None = None,
            env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside this host, output captured as text; fails unless it
        exits 0 (check) within timeout."""
        with self.popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                        cwd=cwd) as p:
            try:
                out, err = p.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                raise AssertionError(f"{argv} on {self.name} timed out after {timeout}s: "
                                     f"{out[-2000:]}{err[-2000:]}") from None
        if check and p.returncode != 0:
            raise AssertionError(f"{argv} on {self.name} exited {p.returncode}:\n"
                                 f"{out[-3000:]}\n{err[-3000:]}")
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def python(self, code: str, *args: str, **kwargs):
        """Run `python -c code args` inside this host with the test environment."""
        kwargs.setdefault("env", subprocess_env())
        return self.run([sys.executable, "-c", code, *args], **kwargs)

    def admin(self, *argv: str, input: str | None = None) -> str:
        """A set-up command in this host's network and mount namespaces (no fork, no pid
        namespace: ip, mount), through nsenter."""
        result = subprocess.run(["nsenter", "-t", str(self.init_pid), "-n", "-m", "--", *argv],
                                input=input, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {self.name}: {result.stderr.strip()}")
        return result.stdout

    def in_netns(self, fn):
        """fn() on a thread that joined this host's network namespace (sockets it makes stay
        there): how the harness reaches a port inside the host."""
        box: list = []

        def run():
            try:
                fd = os.open(f"/proc/{self.init_pid}/ns/net", os.O_RDONLY)
                try:
                    libc = _libc()
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        import ctypes
                        err = ctypes.get_errno()
                        raise OSError(err, os.strerror(err))
                finally:
                    os.close(fd)
                box.append((True, fn()))
            except BaseException as exc:    # handed to the caller
                box.append((False, exc))

        thread = threading.Thread(target=run, name=f"netns-{self.name}", daemon=True)
        thread.start()
        thread.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def http_get(self, port: int, route: str, timeout: float = 5.0) -> tuple[int, str]:
        """(status, body) of GET http://127.0.0.1:port/route inside this host."""
        sock = self.in_netns(lambda: socket.create_connection(("127.0.0.1", port), timeout))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.sock = sock
        try:
            conn.request("GET", route)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def mounts(self) -> list[tuple[str, str]]:
        """[(mount point, fstype)] as the host's processes see them."""
        with open(f"/proc/{self.init_pid}/mountinfo", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())

    def start_agent(self, workdir: str | None = None, *extra: str,
                    window: float | None = None, timeout: float = 60.0) -> "HostAgent":
        """The real agent inside this host (no --node.name: it takes the hostname)."""
        workdir = workdir or os.path.join(self.dir, "agent")
        os.makedirs(workdir, exist_ok=True)
        if window is not None:
            extra = (*extra, "--collision.window", str(window))
        agent = HostAgent(self, workdir, *extra, env=subprocess_env())
        self.cluster._agents.append(agent)
        try:
            return agent.start(timeout=timeout)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr}, init={self.init_pid})"


class HostAgent(agentproc.AgentProcess):
    """tests/support/agentproc's agent, run inside a Host: launched through it, its HTTP
    server reached in the host's network namespace, wait_judged()'s senders run in it."""

    def __init__(self, host: Host, workdir: str, *extra: str, **kwargs):
        super().__init__(workdir, *extra, **kwargs)
        self.host = host
        # Inside the host's network namespace: get() goes there, urllib from here would not.
        self.url = f"http://127.0.0.1:{self.port} (on {host.name})"

    def popen(self, argv, **kwargs) -> subprocess.Popen:
        return self.host.popen(argv, **kwargs)

    def launch(self) -> "HostAgent":
        from monitor.cli.launcher import agent_command
        with open(self.log_path, "wb") as log_file:
            self.proc = self.host.popen(agent_command(*self.args), stdin=subprocess.DEVNULL,
                                        stdout=log_file, stderr=log_file, env=self._env,
                                        cwd=self.workdir)
        return self

    def get(self, route: str, timeout: float = 5.0) -> tuple[int, str]:
        return self.host.http_get(self.port, route, timeout)


class Cluster:
    """A storage host serving a directory over sshfs and `hosts` compute hosts mounting it.
    A context manager: close() tears everything down, whatever state it is in."""

    def __init__(self, hosts: int = 2, root: str | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError("1 to 200 hosts")
        self.run_id = uuid.uuid4().hex[:6]
        self.root = root or f"/tmp/cwh-{self.run_id}"      # short: sockets live below it
        self.export = os.path.join(self.root, "export")    # the server's files
        self.shared = os.path.join(self.root, "shared")    # the mount point on every host
        self.storage = Host(self, "storage", STORAGE_ADDR)
        self.hosts = [Host(self, f"host{i}", f"{SUBNET}.{10 + i}") for i in range(hosts)]
        self._procs: list[subprocess.Popen] = []
        self._agents: list[HostAgent] = []
        self._sshfs: dict[str, subprocess.Popen] = {}

    # ---- set-up ------------------------------------------------------------------------

    def start(self) -> "Cluster":
        reason = problem()
        if reason:
            raise HostsUnavailable(reason)
        try:
            os.makedirs(self.export)
            os.makedirs(self.shared)
            for host in (self.storage, *self.hosts):
                host.boot()
            self._name_hosts()
            self._network()
            self._serve()
            for host in self.hosts:
                self._mount(host)
        except BaseException:
            self.close()
            raise
        return self

    def _name_hosts(self) -> None:
        hosts_file = os.path.join(self.root, "etc-hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for host in (self.storage, *self.hosts):
                f.write(f"{host.addr} {host.name}\n")
        for host in (self.storage, *self.hosts):
            host.admin("mount", "--bind", hosts_file, "/etc/hosts")

    def _network(self) -> None:
        bridge = f"cw{self.run_id}br"
        self.storage.admin("ip", "-b", "-", input="\n".join([
            "link set lo up", f"link add {bridge} type bridge",
            f"addr add {STORAGE_ADDR}/24 dev {bridge}", f"link set {bridge} up"]) + "\n")
        for i, host in enumerate(self.hosts):
            port = f"cw{self.run_id}h{i}"
            host.admin("ip", "-b", "-", input="\n".join([
                "link set lo up",
                f"link add eth0 type veth peer name {port} netns {self.storage.init_pid}",
                f"addr add {host.addr}/24 dev eth0", "link set eth0 up"]) + "\n")
            self.storage.admin("ip", "link", "set", port, "master", bridge, "up")

    def _serve(self) -> None:
        keys = os.path.join(self.root, "keys")
        os.makedirs(keys, mode=0o700)
        for name in ("host", "client"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name,
                            "-f", os.path.join(keys, name)], check=True, timeout=30)
        shutil.copy(os.path.join(keys, "client.pub"), os.path.join(keys, "authorized_keys"))
        config = os.path.join(keys, "sshd_config")
        with open(config, "w") as f:
            f.write(f"ListenAddress {STORAGE_ADDR}:22\n"
                    f"HostKey {keys}/host\n"
                    f"AuthorizedKeysFile {keys}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    "PidFile none\nSubsystem sftp internal-sftp\nLogLevel ERROR\n")
        # sshd wants /run/sshd: a private /run in the storage host, nothing on this machine's.
        self.storage.admin("sh", "-c", "mount -t tmpfs -o mode=755 tmpfs /run && "
                                       "mkdir -m 755 /run/sshd")
        log = open(os.path.join(self.storage.dir, "sshd.log"), "wb")
        self._sshd = self.storage.popen([SSHD, "-D", "-e", "-f", config],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()

        def listening():
            if self._sshd.poll() is not None:
                raise RuntimeError(f"sshd exited {self._sshd.returncode}: "
                                   f"{self._read(self.storage, 'sshd.log')}")
            try:
                self.hosts[0].in_netns(
                    lambda: socket.create_connection((STORAGE_ADDR, 22), 1)).close()
                return True
            except OSError:
                return False
        wait_for(listening, timeout=30, interval=0.05, message="sshd listening")

    def _mount(self, host: Host) -> None:
        key = os.path.join(self.root, "keys", "client")
        log = open(os.path.join(host.dir, "sshfs.log"), "wb")
        # sshfs' own defaults otherwise (attribute and directory caches: docs/multihost.md).
        proc = host.popen(["sshfs", "-f", "-o",
                           f"IdentityFile={key},StrictHostKeyChecking=no,BatchMode=yes,"
                           "UserKnownHostsFile=/dev/null,LogLevel=ERROR",
                           f"root@{STORAGE_ADDR}:{self.export}", self.shared],
                          stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self._sshfs[host.name] = proc

        def mounted():
            if proc.poll() is not None:
                text = self._read(host, "sshfs.log")
                if "fuse" in text.lower() and ("not permitted" in text or "device" in text):
                    raise HostsUnavailable(f"the kernel refuses the FUSE mount: {text[-300:]}")
                raise RuntimeError(f"sshfs on {host.name} exited {proc.returncode}: {text}")
            return (self.shared, "fuse.sshfs") in host.mounts()
        wait_for(mounted, timeout=30, interval=0.05, message=f"sshfs mounted on {host.name}")

    @staticmethod
    def _read(host: Host, name: str) -> str:
        try:
            with open(os.path.join(host.dir, name), errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    # ---- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the agents (SIGTERM: their journals flushed), kill every host, remove the
        files. Safe to call more than once, and on a half-started cluster."""
        for agent in self._agents:
            try:
                agent.close()
            except Exception:       # a host already gone: nothing left to flush
                pass
        self._agents.clear()
        for host in (*self.hosts, self.storage):
            try:
                host.halt()
            except Exception:
                pass
        for proc in self._procs:    # the forwarders: their children died with the hosts
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- a job across the hosts --------------------------------------------------------

    def torchrun(self, program: list[str], *, job: str, nproc: int = 1,
                 agents: list | None = None, env: dict | None = None,
                 hosts: list | None = None) -> list[subprocess.Popen]:
        """One torchrun per host (--nnodes len(hosts), --node-rank its index), rendezvous on
        the first host's address over the cluster network, static rendezvous named `job`
        (TORCHELASTIC_RUN_ID, as a real launcher sets it; no CKPTWATCH_* variable at all),
        each under `ckptwatch run --socket` of that host's agent when `agents` are given.
        Returns the running processes (stdout and stderr merged, text)."""
        hosts = hosts or self.hosts
        procs = []
        for node_rank, host in enumerate(hosts):
            full_env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
            full_env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                             "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"},
                            **(env or {}))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                   "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
                   "--master-addr", hosts[0].addr, "--master-port", str(MASTER_PORT),
                   "--rdzv-id", job, *program]
            if agents is not None:
                cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket",
                       agents[node_rank].socket, "--", *cmd]
            procs.append(host.popen(cmd, env=full_env, cwd=REPO_ROOT,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
        return procs


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for every process; their outputs. Fails (killing the rest) unless all exit 0."""
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out or "")
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"processes still running after {timeout}s")
    bad = [(p.args[-12:], p.returncode, out[-3000:]) for p, out in zip(procs, outputs)
           if p.returncode != 0]
    assert not bad, bad
    return outputs
