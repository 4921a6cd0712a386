"""How ranks meet without a port chosen in advance: rank 0 starts a TCPStore on port 0 (the OS picks a
free port at bind time, so nothing can take it between choosing and binding) and publishes the store's
``host:port`` as a file in a name-resolve folder on the shared filesystem; the other ranks poll for
the file and connect. The launcher gives every launch its own folder
(``<run>/name_resolve/job/<incarnation>/trainer``), so no rank ever reads an address of an earlier launch.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch.distributed as dist

from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_text
from areal_hpc.runtime.bootstrap import node_address

ADDRESS_FILE = "store"  # in the rendezvous folder: "host:port" of rank 0's store
RENDEZVOUS_TIMEOUT_S = 900.0  # how long ranks > 0 wait for rank 0 (it may still be loading its model)


def rendezvous_store(
    folder: Path, rank: int, world: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S, interface: str = ""
) -> dist.TCPStore:
    """Rank 0: start the store and publish its address; the others: wait for it and connect.

    ``interface`` picks the address rank 0 publishes (see ``bootstrap.node_address``); the store itself
    listens on every interface. Store operations keep ``timeout_s`` until the caller sets another.
    """
    folder, timeout = Path(folder), datetime.timedelta(seconds=timeout_s)
    path = folder / ADDRESS_FILE
    if rank == 0:
        host = node_address(interface)
        store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, f"{host}:{store.port}")
        except OSError as exc:
            raise UserError(
                f"cannot publish the rendezvous address in {folder}: {exc.strerror} "
                "(the folder must be writable and shared by every node)"
            ) from None
        return store
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise UserError(
                f"rank {rank} of {world} waited {timeout_s:g} s for rank 0's address in {folder}: "
                "rank 0 did not start, failed before publishing, or the folder is not shared"
            )
        time.sleep(0.05)
    address = path.read_text()
    host, port = address.rsplit(":", 1)
    try:
        return dist.TCPStore(
            host,
            int(port),
            world,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
        )
    except dist.DistNetworkError:
        raise UserError(
            f"rank {rank} of {world} cannot reach rank 0's store at {address} (published in {folder}); "
            "set cluster.interface to a network every node shares"
        ) from None
