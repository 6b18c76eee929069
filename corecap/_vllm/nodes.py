"""One engine across nodes: vLLM's multiproc executor spanning machines, and corecap's control
channel between the driver (node 0, `corecap run --nnodes N --master-addr A ...`) and each
other node (`corecap worker --node-rank R --master-addr A`).

vLLM does the engine itself (nnodes, node_rank, master_addr, master_port): torch.distributed
meets at A:master_port, node 0's executor broadcasts its RPCs to every worker over TCP and
reads the output rank's replies, each other node only starts its own workers ("headless").
What corecap adds, on A:master_port+1, before any weights load:
- each node says who it is (corecap and vLLM versions); the driver answers with its engine
  options and model; the node checks that its model directory is the same model (config
  hash, weights fingerprint) and builds the identical vLLM config from the same options, so
  no flag can disagree; a mismatch is a one-line error on both nodes;
- for the run: a node reports a worker that died, the driver says when to exit, and a node
  whose driver is gone (connection closed) shuts its workers down (vLLM's remote workers wait
  forever otherwise).
The states come to the sink on node 0 (`states_address`): over IPC and shared memory when the
capturing rank (TP rank 0 of the last stage) is on node 0, over TCP when it is not.

Like vLLM's own multi-node RPC (pickled, over TCP), this trusts the network between the nodes.
"""

from __future__ import annotations

import multiprocessing
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgspec

from corecap.errors import CorecapError

CONTROL_PORT_OFFSET = 1  # corecap's control channel: master_port + 1
STATES_PORT_OFFSET = 2  # the sink's states from another node: master_port + 2
_LENGTH = struct.Struct("<I")


class Hello(msgspec.Struct, tag=1):
    node_rank: int
    corecap_version: str
    vllm_version: str


class Plan(msgspec.Struct, tag=2):
    options: dict  # the driver's EngineOptions, as builtins
    model: str
    config_hash: str
    weights_fingerprint: str
    layers: list  # the capture's layers: the preflight's and the compile cache's (build_vllm_config)


class Ready(msgspec.Struct, tag=3):
    pass


class Refused(msgspec.Struct, tag=4):
    message: str


class Exit(msgspec.Struct, tag=5):
    pass


class Died(msgspec.Struct, tag=6):
    message: str


Message = Hello | Plan | Ready | Refused | Exit | Died
_decoder = msgspec.msgpack.Decoder(Message)


def cluster(vllm_config) -> tuple[int, str, int] | None:
    """(nnodes, master_addr, master_port) of an engine across nodes, else None."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "nnodes", 1) <= 1:
        return None
    if parallel.node_rank != 0:
        raise CorecapError(
            f"--node-rank {parallel.node_rank}: `corecap run` is node 0 (the driver, with the store); "
            "start the other nodes with `corecap worker --node-rank R --master-addr ADDR`"
        )
    return parallel.nnodes, parallel.master_addr, parallel.master_port


def states_address(vllm_config, sender_rank: int) -> str:
    """Where the sink on node 0 must also listen for states: '' when the sending rank is on
    node 0 (IPC and shared memory), else tcp://master_addr:master_port+2."""
    parallel = vllm_config.parallel_config
    if sender_rank // parallel.local_world_size == 0:
        return ""
    return f"tcp://{parallel.master_addr}:{parallel.master_port + STATES_PORT_OFFSET}"


def _send(sock: socket.socket, msg) -> None:
    data = msgspec.msgpack.encode(msg)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv(sock: socket.socket, timeout: float | None):
    """The next message, or None when the peer closed the connection."""
    sock.settimeout(timeout)
    head = _exactly(sock, _LENGTH.size)
    if head is None:
        return None
    body = _exactly(sock, _LENGTH.unpack(head)[0])
    if body is None:
        return None
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise CorecapError(f"corecap's control channel: a bad message ({e}): another program on the port?") from None


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        try:
            part = sock.recv(n - got)
        except socket.timeout:
            raise CorecapError("corecap's control channel: no answer from the other node in time") from None
        except OSError:
            return None
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class Leader:
    """The driver's side: waits for every other node's handshake (before the engine starts),
    then watches the nodes during the run and tells them to exit at the end."""

    def __init__(self, nnodes: int, address: str, port: int, plan: Plan, versions: tuple[str, str], timeout: float,
                 log):
        self.nodes: dict[int, socket.socket] = {}
        self.problem_text: str | None = None
        self._on_death: Callable[[str], None] | None = None
        listener = socket.create_server((address, port + CONTROL_PORT_OFFSET))
        try:
            log(f"waiting for {nnodes - 1} other node(s) on {address}:{port + CONTROL_PORT_OFFSET} (`corecap worker`)")
            deadline = time.monotonic() + timeout
            while len(self.nodes) < nnodes - 1:
                listener.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, peer = listener.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, nnodes)) - set(self.nodes))
                    raise CorecapError(
                        f"--nnodes {nnodes}: node(s) {missing} did not join within {timeout:.0f}s"
                    ) from None
                self._welcome(conn, peer, nnodes, plan, versions)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        log(f"nodes ready: {sorted(self.nodes)} (and node 0, this one)")

    def _welcome(self, conn: socket.socket, peer, nnodes: int, plan: Plan, versions: tuple[str, str]) -> None:
        hello = _recv(conn, 30)
        if not isinstance(hello, Hello):
            conn.close()
            return  # not a corecap node: ignore it
        problem = None
        if hello.corecap_version != versions[0] or hello.vllm_version != versions[1]:
            problem = (
                f"node {hello.node_rank} ({peer[0]}) runs corecap {hello.corecap_version} "
                f"with vLLM {hello.vllm_version}, "
                f"node 0 corecap {versions[0]} with vLLM {versions[1]}: install the same on every node"
            )
        elif not 0 < hello.node_rank < nnodes or hello.node_rank in self.nodes:
            problem = (f"a node ({peer[0]}) says --node-rank {hello.node_rank}: "
                       f"expected one of 1..{nnodes - 1}, each once")
        if problem:
            _send(conn, Refused(problem))
            conn.close()
            raise CorecapError(problem)
        _send(conn, plan)
        answer = _recv(conn, None)
        if not isinstance(answer, Ready):
            conn.close()
            raise CorecapError(answer.message if isinstance(answer, Refused)
                               else f"node {hello.node_rank} left during its handshake")
        self.nodes[hello.node_rank] = conn

    def watch(self, on_death: Callable[[str], None]) -> None:
        """During the run: a node's dead worker, or a node gone, → `on_death(why)`."""
        self._on_death = on_death
        for rank, conn in self.nodes.items():
            threading.Thread(target=self._listen, args=(rank, conn), daemon=True, name=f"corecap-node-{rank}").start()

    def _listen(self, rank: int, conn: socket.socket) -> None:
        try:
            msg = _recv(conn, None)
        except CorecapError as e:
            msg = Died(f"node {rank}: {e}")
        if self.nodes.get(rank) is None:
            return  # closed by us
        why = (msg.message if isinstance(msg, Died)
               else f"node {rank}'s `corecap worker` is gone (its connection closed)")
        if self.problem_text is None:
            self.problem_text = why
            if self._on_death is not None:
                self._on_death(why)

    def problem(self) -> str | None:
        return self.problem_text

    def close(self) -> None:
        """Tell every node to shut its workers down and exit."""
        nodes, self.nodes = self.nodes, {}
        for conn in nodes.values():
            try:
                _send(conn, Exit())
            except OSError:
                pass
            conn.close()


def follow(address: str, port: int, node_rank: int, model: str | None, timeout: float, log) -> None:
    """`corecap worker`: join the engine whose driver listens on address:port+1, run this node's
    workers until the driver says exit (or is gone), then shut them down."""
    from corecap import __version__
    from corecap._vllm.options import build_vllm_config, environment
    from corecap._vllm.parallel import check_pipeline, placement
    from corecap.config import EngineOptions
    from corecap.model import model_identity, resolve_model_dir

    import vllm

    conn = _connect(address, port + CONTROL_PORT_OFFSET, timeout, log)
    with conn, environment():
        _send(conn, Hello(node_rank, __version__, vllm.__version__))
        plan = _recv(conn, timeout)
        if not isinstance(plan, Plan):
            raise CorecapError(plan.message if isinstance(plan, Refused) else "the driver closed the connection")
        try:
            fields = {k: tuple(map(tuple, v)) if k == "extra" else tuple(v) if k == "extra_args" else v
                      for k, v in plan.options.items()}
            options = EngineOptions(**{**fields, "extra": (*fields.get("extra", ()), ("node_rank", node_rank))})
            model_dir = resolve_model_dir(model or plan.model)
            identity = model_identity(model_dir, options.load_format)
            if (identity.config_hash, identity.weights_fingerprint) != (plan.config_hash, plan.weights_fingerprint):
                raise CorecapError(
                    f"node {node_rank}: the model at {model_dir} is not node 0's {plan.model} "
                    f"(config hash {identity.config_hash} vs {plan.config_hash}, "
                    f"weights fingerprint {identity.weights_fingerprint} vs {plan.weights_fingerprint})"
                )
            vllm_config = build_vllm_config(options, model_dir, tuple(plan.layers))
            (devices,) = placement(vllm_config, 1)
            check_pipeline(vllm_config, vllm.__version__)
        except CorecapError as e:
            _send(conn, Refused(str(e)))
            raise
        _send(conn, Ready())
        log(f"node {node_rank}: joined the engine of {address}:{port}; "
            f"starting {vllm_config.parallel_config.local_world_size} worker(s)")
        _run_workers(conn, vllm_config, devices, node_rank, log)


def _connect(address: str, port: int, timeout: float, log) -> socket.socket:
    deadline = time.monotonic() + timeout
    log(f"connecting to the driver at {address}:{port}")
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=5)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            return conn
        except OSError as e:
            if time.monotonic() > deadline:
                raise CorecapError(f"--master-addr {address}: no corecap driver on port {port} "
                                   f"within {timeout:.0f}s ({e.strerror or e})") from None
            time.sleep(1)


def _run_workers(conn: socket.socket, vllm_config, devices: dict, node_rank: int, log) -> None:
    """This node's workers, headless (as `vllm serve --headless` runs them), until told to exit,
    the driver is gone, or a worker dies (then the driver is told)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from corecap._vllm import worker_deaths
    from corecap._vllm.parallel import replica_environment

    built: dict = {}

    def build() -> None:
        try:
            with replica_environment(devices):
                built["executor"] = MultiprocExecutor(vllm_config, monitor_workers=False)
        except BaseException as e:
            built["error"] = e

    builder = threading.Thread(target=build, daemon=True, name="corecap-node-workers")
    builder.start()
    reason = None
    try:
        while reason is None:
            readable, _, _ = select.select([conn], [], [], 1.0)
            if readable:
                msg = _recv(conn, 5)
                reason = "the driver said exit" if isinstance(msg, Exit) else "the driver is gone"
            elif "error" in built:
                raise CorecapError(f"node {node_rank}: vLLM's workers failed to start: "
                                   f"{str(built['error']).splitlines()[0][:300]}")
            elif "executor" in built:
                dead = [w for w in built["executor"].workers if not w.proc.is_alive()]
                if dead:
                    w = dead[0]
                    reason = f"node {node_rank}: {worker_deaths.describe(w.rank, w.proc.pid, w.proc.exitcode)}"
                    _send(conn, Died(reason))
    finally:
        log(f"node {node_rank}: {reason or 'failed'}; shutting the workers down")
        executor = built.get("executor")
        if executor is not None:
            executor.shutdown()
        for child in multiprocessing.active_children():  # workers of an executor still starting
            child.kill()
