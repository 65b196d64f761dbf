# The group channel's benchmark, run by `cannabis testnet bench`: the same client and
# server measured through a group's channel (rank 1 to rank 0, each in its sandbox) and
# over a direct loopback TCP connection (both on the host), in the same run.
#
#   python3 bench_channel.py                        as a group rank (RANK, MASTER_ADDR, ...)
#   python3 bench_channel.py serve                  prints the port, serves one client
#   python3 bench_channel.py client HOST PORT BYTES ROUNDS OUT
import json, os, socket, sys, time

CHUNK = 1 << 18


def exactly(s, n):
    b = b""
    while len(b) < n:
        chunk = s.recv(n - len(b))
        if not chunk:
            raise ConnectionError("closed")
        b += chunk
    return b


def serve(srv):
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Round trips of one byte until the client sends 'B', then bytes until it closes.
    while True:
        b = exactly(c, 1)
        if b == b"B":
            break
        c.sendall(b)
    n = 0
    while True:
        b = c.recv(CHUNK)
        if not b:
            break
        n += len(b)
    c.sendall(n.to_bytes(8, "big"))
    c.close()


def connect(host, port, deadline):
    # Through the channel, a connection may be taken and closed at once while rank 0 is
    # not serving yet: the first round trip says whether it goes through.
    while True:
        try:
            s = socket.create_connection((host, port), timeout=30)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(b"x")
            exactly(s, 1)
            return s
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def client(host, port, nbytes, rounds):
    s = connect(host, port, time.time() + 120)
    rtts = []
    for _ in range(rounds):
        t = time.perf_counter()
        s.sendall(b"x")
        exactly(s, 1)
        rtts.append(int((time.perf_counter() - t) * 1e6))
    s.sendall(b"B")
    block = os.urandom(CHUNK)
    t = time.perf_counter()
    sent = 0
    while sent < nbytes:
        n = min(CHUNK, nbytes - sent)
        s.sendall(block[:n])
        sent += n
    s.shutdown(socket.SHUT_WR)
    got = int.from_bytes(exactly(s, 8), "big")
    seconds = time.perf_counter() - t
    if got != nbytes:
        raise SystemExit(f"the server counted {got} bytes of {nbytes}")
    return {"bytes": nbytes, "seconds": seconds, "rtt_us": rtts}


def listener(host, port):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(4)
    return srv


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "serve":
        srv = listener("127.0.0.1", 0)
        print(srv.getsockname()[1], flush=True)
        serve(srv)
    elif args and args[0] == "client":
        host, port, nbytes, rounds, out = args[1], int(args[2]), int(args[3]), int(args[4]), args[5]
        with open(out, "w") as f:
            json.dump(client(host, port, nbytes, rounds), f)
    else:
        rank = int(os.environ["RANK"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        out = os.path.join(os.environ["CANNABIS_WORK"], "channel.json")
        nbytes, rounds = int(args[0]), int(args[1])
        if rank == 0:
            serve(listener(host, port))
            with open(out, "w") as f:
                json.dump({"rank": 0}, f)
        else:
            with open(out, "w") as f:
                json.dump(client(host, port, nbytes, rounds), f)
