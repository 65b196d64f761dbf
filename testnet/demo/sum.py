# A sum all-reduce over rank 0's rendezvous (MASTER_ADDR, this round's MASTER_PORT) with
# nothing but Python's standard library and the environment torchrun sets: each rank sends
# its value to rank 0, which sends back the sum. A rank whose connection ends early (rank 0
# not serving yet) tries again. Rank 0 then holds its service open for `hold` seconds.
import os, socket, time

def exactly(s, n):
    b = b""
    while len(b) < n:
        chunk = s.recv(n - len(b))
        if not chunk:
            raise ConnectionError("closed")
        b += chunk
    return b

def all_reduce_sum(value, hold=0):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(16)
        total, peers = value, []
        while len(peers) < world - 1:
            c, _ = srv.accept()
            c.settimeout(60)
            try:
                total += int.from_bytes(exactly(c, 8), "big")
                peers.append(c)
            except OSError:
                c.close()
        for c in peers:
            c.sendall(total.to_bytes(8, "big"))
            c.close()
        time.sleep(hold)
        return total
    deadline = time.time() + 120
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=10)
            s.sendall(value.to_bytes(8, "big"))
            return int.from_bytes(exactly(s, 8), "big")
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)
