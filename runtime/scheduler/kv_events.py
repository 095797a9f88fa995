"""KV events published over ZMQ (`--kv-events-endpoint`), as vLLM's `ZmqEventPublisher` sends them.

The radix tree records its changes as block events (kvcache/block_events.py); once per scheduler step
this publisher sends what was recorded as one batch on a PUB socket: three frames, the topic, the
batch's sequence number (8 bytes, big-endian, from 0) and the batch in MessagePack,
`{"ts": seconds, "events": [{"type": "BlockStored", ...}, ...]}` (`data_parallel_rank` as well behind
a data-parallel engine). A subscriber that sees a gap in the sequence numbers has missed a batch.

The scheduler owns the socket: events leave from the thread that changed the tree, in order, with no
queue between them and the wire (a send on a PUB socket never blocks: a slow subscriber loses
messages past its high-water mark, and sees the gap).
"""

from __future__ import annotations

import time
from typing import Optional

import zmq

from ..kvcache.block_events import BlockEvents


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (`tcp://*:5557`), ipc:// and inproc:// bind; any other address is a
    subscriber's (or a proxy's) that the publisher connects to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The PUB socket and the recorder the radix tree reports to (`recorder`, its listener)."""

    HIGH_WATER_MARK = 100_000

    def __init__(
        self,
        endpoint: str,
        block_size: int,
        medium: str = "GPU",
        topic: str = "",
        data_parallel_rank: Optional[int] = None,
    ) -> None:
        import msgpack  # type: ignore[import-untyped]  # (only a server that publishes needs it)

        self.recorder = BlockEvents(block_size, medium)
        self._packer = msgpack.Packer()
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._seq = 0
        self._ctx: zmq.Context = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.set_hwm(self.HIGH_WATER_MARK)
        if binds(endpoint):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint

    @classmethod
    def of(cls, server_args, device: str) -> Optional["KVEventPublisher"]:
        """The publisher the settings ask for (None without `kv_events_endpoint`)."""
        if server_args.kv_events_endpoint is None:
            return None
        medium = "GPU" if device == "cuda" else "CPU"
        return cls(server_args.kv_events_endpoint, server_args.kv_events_block_size, medium)

    def publish(self) -> int:
        """Send the events recorded since the last call as one batch; returns how many there were."""
        events = self.recorder.take()
        if not events:
            return 0
        batch: dict = {"ts": time.time(), "events": events}
        if self._dp_rank is not None:
            batch["data_parallel_rank"] = self._dp_rank
        seq = self._seq.to_bytes(8, "big")
        self._seq += 1
        self._socket.send_multipart((self._topic, seq, self._packer.pack(batch)))
        return len(events)

    def close(self) -> None:
        self._socket.close(linger=0)
