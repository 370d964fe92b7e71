"""`qwen-vit-jax encode` on several processes (hosts): start-up, the split of the inputs, the end.

Every process runs the same command on the same inputs. `initialize` starts JAX's multi-controller
runtime (`jax.distributed`); `share` gives each process a consecutive slice of the input list with
nearly equal patch counts (read from the image headers, so every process computes the same split
without decoding anything); each process encodes its slice on its own devices and writes its own
shard; `barrier` waits for all of them, after which process 0 writes the index
(embeddings.write_index). Nothing else crosses processes: no data, no scheduler of ours.
"""

from __future__ import annotations

import dataclasses

from qwen_vit_jax.runtime.batching import split_even

INIT_TIMEOUT_S = 300  # how long a process waits for the others to join (JAX's default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """This process's place: index in 0 .. count - 1 (count 1: running alone)."""

    index: int = 0
    count: int = 1


def initialize(
    coordinator: str | None, num_processes: int | None, process_id: int | None, auto: bool = False
) -> Cluster:
    """Start jax.distributed from the CLI's flags, or not at all.

    Either all three of coordinator ("HOST:PORT" of process 0), num_processes and process_id, or
    `auto` (jax.distributed.initialize() without arguments: SLURM, Open MPI, Cloud TPU or
    Kubernetes detection), or none (alone). Raises ValueError for a partial or inconsistent set.
    """
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if auto and any(v is not None for v in given.values()):
        raise ValueError(
            "--distributed detects the cluster itself: drop --coordinator, --num-processes "
            "and --process-id, or drop --distributed"
        )
    if not auto and all(v is None for v in given.values()):
        return Cluster()
    if not auto:
        if missing := [k for k, v in given.items() if v is None]:
            raise ValueError(
                f"several processes need --coordinator, --num-processes and --process-id "
                f"together; missing {', '.join(missing)}"
            )
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT (process 0's address), got {coordinator!r}")
        if num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id must be in 0 .. {num_processes - 1}, got {process_id}")
    import jax

    if auto:
        try:
            jax.distributed.initialize(initialization_timeout=INIT_TIMEOUT_S)
        except ValueError as e:  # no cluster environment found
            raise ValueError(
                f"--distributed: jax.distributed.initialize() found no cluster (SLURM, Open MPI, "
                f"Cloud TPU, Kubernetes) here ({e}); pass --coordinator, --num-processes and "
                "--process-id instead"
            ) from None
    else:  # a coordinator that never answers makes JAX abort the process after INIT_TIMEOUT_S
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=INIT_TIMEOUT_S)
    return Cluster(index=jax.process_index(), count=jax.process_count())


def share(items: list, cluster: Cluster, patches) -> list:
    """This process's consecutive slice of `items`, the slices balanced by patch count (every
    process computes the same split: same inputs, same headers). `patches(item)` counts an input's
    patches."""
    if cluster.count == 1:
        return items
    a, b = split_even([patches(p) for p in items], cluster.count)[cluster.index]
    return items[a:b]


def barrier(name: str) -> None:
    """Wait until every process got here (a tiny collective over all devices of all processes)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
