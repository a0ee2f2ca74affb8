"""A job of several "nodes" on one host, for tests and benchmarks: one msrun
launch per node (`--node_rank`), each told its node by MS_LOADPATCH_NODE_ID
(mindspore numbers the local ranks of launches on one host as one node's).

    job = NodesJob(directory, script, args, nodes=2, ranks_per_node=1, env=...)
    job.wait(timeout)   # exit codes; job.failed_launches() those that failed

Node 0 starts first, and the others once its scheduler listens: msrun starts
a scheduler wherever the master address is local, so on one host every
launch does, and only the first may own the port. A later launch's
scheduler then fails to bind and its msrun exits 1 after its workers
succeeded; `failed_launches` does not count that.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

NODE_ENV_VAR = "MS_LOADPATCH_NODE_ID"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun() -> list[str]:
    """msrun of this interpreter's environment."""
    return [sys.executable, "-m", "mindspore.parallel.cluster.run"]


class NodesJob:
    """`script args` as one job of `nodes` launches of `ranks_per_node`
    workers; logs in directory/logs<node>, msrun's output in
    directory/msrun<node>.out. `node_env`: node -> extra variables. Without `node_ids` no launch is told
    its node (one node's launch, as msrun starts it)."""

    def __init__(self, directory, script, args, nodes, ranks_per_node=1, env=None, node_env=None, node_ids=True):
        self.directory = os.fspath(directory)
        self.nodes = nodes
        base = {k: v for k, v in (env if env is not None else os.environ).items()}
        base["PATH"] = os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", "")
        port = free_port()
        self.procs = []
        for node in range(nodes):
            command = [
                *msrun(),
                f"--worker_num={nodes * ranks_per_node}",
                f"--local_worker_num={ranks_per_node}",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "--join=True",
                "--cluster_time_out=120",
                f"--log_dir={os.path.join(self.directory, f'logs{node}')}",
                os.fspath(script),
                *map(str, args),
            ]
            node_vars = {
                **base,
                **({NODE_ENV_VAR: f"node{node}"} if node_ids else {}),
                **(node_env or {}).get(node, {}),
            }
            with open(os.path.join(self.directory, f"msrun{node}.out"), "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        command,
                        env=node_vars,
                        cwd=self.directory,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if node == 0:
                _wait_for_listener(port, self.procs[0])

    def wait(self, timeout: float) -> list[int]:
        """The launches' exit codes; every launch killed and TimeoutError raised past `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"a {self.nodes}-node job did not end within {timeout:.0f} s") from None
        return [proc.returncode for proc in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def failed_launches(self) -> list[int]:
        """The launches that failed, not counting a later launch's scheduler that could not bind the port."""
        return [node for node, proc in enumerate(self.procs) if proc.returncode != 0 and not self._duplicate(node)]

    def _duplicate(self, node: int) -> bool:
        scheduler = os.path.join(self.directory, f"logs{node}", "scheduler.log")
        with open(os.path.join(self.directory, f"msrun{node}.out"), errors="replace") as f:
            output = f.read()
        if node == 0 or not os.path.exists(scheduler) or "exit with exception. Error code" in output:
            return False  # a worker failed
        with open(scheduler, errors="replace") as f:
            return "Failed to init the tcp server" in f.read()

    def logs(self, tail: int = 3000) -> str:
        """The workers' logs and msrun's outputs, each its last `tail` characters."""
        parts = []
        for node in range(self.nodes):
            logs = os.path.join(self.directory, f"logs{node}")
            names = sorted(n for n in os.listdir(logs) if n.startswith("worker_")) if os.path.isdir(logs) else []
            for name in names + [f"../msrun{node}.out"]:
                path = os.path.normpath(os.path.join(logs, name))
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        parts.append(f"--- {path}\n{f.read()[-tail:]}")
        return "\n".join(parts)


def _wait_for_listener(port: int, proc, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


__all__ = ["NODE_ENV_VAR", "NodesJob", "free_port", "msrun"]
