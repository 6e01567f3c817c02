"""Delay and loss on one link, where the kernel has no `netem` qdisc.

`tc qdisc … netem delay 100ms 50ms loss 5%` is the usual tool; kernels built without
`sch_netem` (this project's CI machines) refuse it. The same effect comes from netfilter:
an iptables rule hands the link's packets to an NFQUEUE, and this process holds each one
for its delay before it accepts it (or drops it, at the loss rate). Like netem, delays
are uniform in [delay - jitter, delay + jitter], independent per packet (so packets may
be reordered), and only the egress direction of the host it runs in is affected: an
emulated link runs one on each side.

    ip netns exec HOST python -m services.cluster.linkem --queue 7 \\
        --delay-ms 100 --jitter-ms 50 --loss 0.05 --seed 1

The rule uses `--queue-bypass`, so when this process is not running the packets pass:
stopping the emulation can never turn into a partition. The netfilter queue is spoken
directly over netlink (the protocol of `nfnetlink_queue`: bind, copy mode, verdicts),
which needs no C library on the machine.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_CFG_MASK, NFQA_CFG_FLAGS = 4, 5
NFQA_CFG_F_FAIL_OPEN = 1
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, 0,
                       0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The packet ids of the NFQNL_MSG_PACKET messages in one netlink read."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at = offset + 20  # netlink header + nfgenmsg
            while at + 4 <= offset + length:
                attr_len, attr_kind = struct.unpack_from("=HH", data, at)
                if attr_len < 4:
                    break
                if attr_kind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + 4)[0])
                at += (attr_len + 3) & ~3
        elif kind == NLMSG_ERROR:
            code = struct.unpack_from("=i", data, offset + 16)[0]
            if code != 0:
                raise OSError(-code, "netfilter queue refused a message")
        offset += (length + 3) & ~3
    return ids


class LinkEmulator:
    def __init__(self, queue: int, delay_s: float, jitter_s: float, loss: float,
                 seed: int) -> None:
        self.queue = queue
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.loss = loss
        self.random = random.Random(seed)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))
        self.held: list[tuple[float, int, int]] = []
        self.counts = {"accepted": 0, "dropped": 0}

    def bind(self) -> None:
        cmd = struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, socket.htons(socket.AF_INET))
        self._send(_message(NFQNL_MSG_CONFIG, self.queue, _attr(NFQA_CFG_CMD, cmd),
                            NLM_F_REQUEST | NLM_F_ACK))
        params = struct.pack("!IB", 0, NFQNL_COPY_META) + b"\0\0\0"
        flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)
        self._send(_message(NFQNL_MSG_CONFIG, self.queue,
                            _attr(NFQA_CFG_PARAMS, params[:5])
                            + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 8192))
                            + _attr(NFQA_CFG_FLAGS, flags) + _attr(NFQA_CFG_MASK, flags),
                            NLM_F_REQUEST | NLM_F_ACK))

    def _send(self, message: bytes) -> None:
        self.sock.send(message)

    def _verdict(self, packet_id: int, verdict: int) -> None:
        self._send(_message(NFQNL_MSG_VERDICT, self.queue,
                            _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id))))

    def run(self, stop_at: float | None = None) -> None:
        while stop_at is None or time.monotonic() < stop_at:
            now = time.monotonic()
            while self.held and self.held[0][0] <= now:
                _, _, packet_id = heapq.heappop(self.held)
                self._verdict(packet_id, NF_ACCEPT)
                self.counts["accepted"] += 1
            wait = (self.held[0][0] - now) if self.held else 0.5
            readable, _, _ = select.select([self.sock], [], [], max(0.0, wait))
            if not readable:
                continue
            data = self.sock.recv(1 << 16)
            for packet_id in _packet_ids(data):
                if self.random.random() < self.loss:
                    self._verdict(packet_id, NF_DROP)
                    self.counts["dropped"] += 1
                    continue
                delay = max(0.0, self.delay_s + self.random.uniform(-self.jitter_s,
                                                                    self.jitter_s))
                heapq.heappush(self.held, (time.monotonic() + delay, packet_id, packet_id))

    def flush(self) -> None:
        """Let every held packet go (on stop: nothing is lost by stopping)."""
        for _, _, packet_id in self.held:
            self._verdict(packet_id, NF_ACCEPT)
        self.held.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=100.0)
    parser.add_argument("--jitter-ms", type=float, default=50.0)
    parser.add_argument("--loss", type=float, default=0.0, help="fraction dropped, 0-1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    emulator = LinkEmulator(args.queue, args.delay_ms / 1000, args.jitter_ms / 1000,
                            args.loss, args.seed)
    emulator.bind()
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"linkem: queue {args.queue}, delay {args.delay_ms:g} ms +- {args.jitter_ms:g} ms, "
          f"loss {args.loss:.1%}", flush=True)
    try:
        emulator.run()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.flush()
        print(f"linkem: {emulator.counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
