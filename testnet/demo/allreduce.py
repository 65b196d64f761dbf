# One rank of the demo's group job: its value is 10 times its rank plus one, and the sum
# over the group's ranks (10 + 20 + 30 = 60 for three) comes back to every rank from
# rank 0, through the group's private channel.
import os
from sum import all_reduce_sum

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
total = all_reduce_sum(10 * (rank + 1))
with open(os.path.join(os.environ["CANNABIS_WORK"], "sum.txt"), "w") as f:
    f.write(f"rank {rank} of {world}, rendezvous {os.environ['MASTER_ADDR']}: sum {total}\n")
