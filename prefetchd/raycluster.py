"""The Ray cluster as the bridge sees it: connecting, the nodes that can run the tasks, and the
check that each decodes as this node does. Ray is imported by the caller (the bridge process).
"""

from __future__ import annotations

import logging
import threading

from . import raytask

CALL_TIMEOUT_S = 60.0  # a Ray call that does not return by then: the cluster is not answering
CONNECT_TIMEOUT_S = 45.0  # ray.init retries a refused GCS port forever: the start must fail before its deadline


class RayBootError(Exception):
    """The cluster cannot be used for this job; the message says why and what to do."""


def usable_nodes(ray, demand: dict) -> list[dict]:
    """Alive nodes with the resources a task asks for."""
    return [
        n
        for n in call(ray.nodes)
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in demand.items())
    ]


def check_every_node(ray, fingerprint_task, demand: dict, address: str, expected: str, args: tuple) -> None:
    """Each node that can run the tasks decodes the job's first samples as this node does, or
    RayBootError names it: batches from it would differ from a local worker's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = usable_nodes(ray, demand)
    if not nodes:
        raise RayBootError(
            f"no alive node of the Ray cluster ({address}) has what a task asks for "
            f"({resources_text(demand)}); start nodes with those resources, or change --ray-resources"
        )
    refs = {
        f"{n['NodeManagerAddress']} (node id {n['NodeID'][:12]})": fingerprint_task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(*args)
        for n in nodes
    }
    here = raytask.decoder_facts()
    for node, ref in refs.items():
        got, facts = call(ray.get, ref)
        if got != expected:
            raise RayBootError(mismatch_text(node, here, facts))


def connect(ray, address: str, options: dict, on_timeout) -> None:
    """ray.init, for a private instance or a cluster's address; ``on_timeout(message)`` ends the
    process when it has not returned within CONNECT_TIMEOUT_S."""
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if address == "local":  # a private instance: its object store off the tmpfs, sized to what is in flight
            kwargs = dict(
                num_cpus=options["local_cpus"],
                include_dashboard=False,
                object_store_memory=options["store_bytes"],
                _plasma_directory=options["plasma_dir"],
                **quiet,
            )
        else:
            kwargs = dict(address=address, **quiet)
        # On this thread (ray.init installs signal handlers), and with a deadline: it retries a refused
        # GCS port forever, and the start must fail with this message, not the pool's boot deadline.
        timer = threading.Timer(
            CONNECT_TIMEOUT_S,
            on_timeout,
            args=(
                f"cannot connect to the Ray cluster at {address}: no answer within {CONNECT_TIMEOUT_S:.0f} s; start "
                "one (`ray start --head` on this node) or pass --ray-address HOST:PORT of a running cluster's head",
            ),
        )
        timer.daemon = True
        timer.start()
        try:
            ray.init(**kwargs)
        finally:
            timer.cancel()
    except Exception as exc:
        raise RayBootError(
            f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {first_line(exc)}; start one "
            "(`ray start --head` on this node) or pass --ray-address HOST:PORT"
        ) from None


def call(fn, *args, timeout_s: float | None = None):
    """A Ray call with a deadline (Ray's own may wait a minute or more for a lost head)."""
    timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
    result: list = []

    def run():
        try:
            result.append((True, fn(*args)))
        except Exception as exc:
            result.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        raise TimeoutError(f"no answer from Ray within {timeout_s:.0f} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def mismatch_text(node: str, here: dict, there: dict) -> str:
    differ = ", ".join(
        f"{k} {there.get(k)} there, {here[k]} here" for k in sorted(here) if k != "host" and here[k] != there.get(k)
    )
    return (
        f"Ray node {node} decodes and augments this job's samples into other bytes than this node "
        f"({differ or 'same versions: is the data at the same path there?'}); its batches would differ "
        "from a local worker's. Install the same Pillow / libjpeg-turbo / simplejpeg on every node and mount "
        "the data at the same path, or keep that node out of the cluster"
    )


def resources_text(demand: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in demand.items())


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
