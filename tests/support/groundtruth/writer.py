"""One rank's training process, as the ground-truth harness drives it (run under
`ckptwatch run`, so the hook is the bootstrap's, as a user gets it).

    python writer.py TRUTH_LOG

Reads one JSON command per stdin line -- {"save": id, "path": ..., "numel": n, "delay": s,
"meet": dir or null, "count": k, "exit": how} -- waits `delay`, then torch.save()s a state
dict of `numel` floats to `path`, logging its true interval: the host's one clock
(time.time_ns) read right before and right after the real torch.save, each line handed to the
kernel (one write() on an O_APPEND descriptor) before the save begins and as soon as it ends,
so a writer killed mid-write still has its start on record. (No fsync: the process's death
cannot lose what write() has handed over, and an fsync inside the interval would widen it.)

`meet`: the state dict holds a Meet, which the pickler reaches inside torch.save (after the
hook's start, with the file open, before its tensors are written): it marks this writer as
inside its save, then waits until `count` writers of the round are, so their saves overlap.
`exit`: how the process leaves once the save returned (schedule.EXITS), or "stay".
`fork`: the save is made by a child forked for it (as multiprocessing's fork start method
does), which then leaves as `exit` says ("exit": atexit handlers, then os._exit, as a normal
end of the interpreter would run them); this process goes on, reaping nothing (SIGCHLD
ignored: the kernel reaps its children).
Prints "ready STATE" once torch is imported and, in a job spanning nodes, job scope has reached
the store (as a rank's first save comes after init_process_group; STATE is job scope's state, or
"none" without it), then "done <id>" per save kept.
"""
import json
import os
import signal
import sys
import time

import torch


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class Meet:
    def __init__(self, folder: str, name: str, count: int):
        self.folder, self.name, self.count = folder, name, count

    def __reduce__(self):
        open(os.path.join(self.folder, self.name), "w").close()
        # A peer that died before it got here must not hang the round: go on after 30 s.
        wait_until(lambda: len(os.listdir(self.folder)) >= self.count, 30.0)
        return (int, ())


def job_scope_settled() -> bool:
    """Job scope connected (or given up): the hook's instance, if any, is past connecting."""
    scope = sys.modules.get("ckptwatch.jobscope")
    instance = scope.instance() if scope is not None else None
    return instance is None or instance.state != "connecting"


def log(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())


def leave(how: str, forked: bool = False) -> None:
    if how == "exit":
        if forked:
            import atexit
            atexit._run_exitfuncs()
            os._exit(0)
        sys.exit(0)
    if how == "os_exit":
        os._exit(0)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    raise SystemExit(f"still alive after {how}")


def main() -> None:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    node, rank = os.environ.get("CKPTWATCH_NODE"), int(os.environ["RANK"])
    wait_until(job_scope_settled, 60.0)
    scope = sys.modules.get("ckptwatch.jobscope")
    instance = scope.instance() if scope is not None else None
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", instance.state if instance is not None else "none", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("fork") and os.fork() != 0:
            continue                      # the child makes this save
        forked = bool(cmd.get("fork"))
        save(fd, cmd, node, rank, os.getpid())
        if cmd["exit"] != "stay" or forked:
            leave(cmd["exit"] if cmd["exit"] != "stay" else "os_exit", forked)
        print(f"done {cmd['save']}", flush=True)


def save(fd: int, cmd: dict, node: str, rank: int, pid: int) -> None:
    if cmd["delay"] > 0:
        time.sleep(cmd["delay"])
    state = {"rank": rank, "w": torch.full((cmd["numel"],), float(rank))}
    if cmd.get("meet"):
        state["meet"] = Meet(cmd["meet"], f"{cmd['save']}", cmd["count"])
    base = {"save": cmd["save"], "node": node, "pid": pid, "rank": rank, "path": cmd["path"]}
    log(fd, {**base, "ev": "start", "t": time.time_ns()})
    outcome = "ok"
    try:
        torch.save(state, cmd["path"])
    except Exception as exc:          # the truth says so; the hook must report it too
        outcome = type(exc).__name__
    log(fd, {**base, "ev": "end", "t": time.time_ns(), "outcome": outcome})


if __name__ == "__main__":
    main()
