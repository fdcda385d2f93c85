"""A tiny parallel training script for behaviour tests.

    python tiny.py --devices cpu:0,cpu:1 [--bn] [--rows N] [--batch B]
                   [--fail-rank R] [--fail-where parallelize|fit|end] [--out F]
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

import multigpu


def listening_addresses() -> list[str]:
    """Local addresses of this process's TCP sockets in the LISTEN state."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    hexaddr, port = cols[1].split(":")
                    if width == 8:
                        addr = ".".join(str(int(hexaddr[i : i + 2], 16)) for i in (6, 4, 2, 0))
                    else:
                        addr = "::1" if hexaddr.endswith("01000000") and set(hexaddr[:24]) == {"0"} else hexaddr
                    out.append(f"{addr}:{int(port, 16)}")
    return out


class Announce(keras.callbacks.Callback):
    def __init__(self, rank, a):
        super().__init__()
        self.rank, self.a, self.done, self.epoch = rank, a, False, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.a.announce and not self.done:
            self.done = True
            print(f"rank {self.rank} pid {os.getpid()} training", flush=True)
        if self.rank == self.a.sleep_rank and batch == 1:
            print(f"rank {self.rank} sleeps", flush=True)
            time.sleep(self.a.sleep)
        marker = os.path.join(self.a.backup or ".", "died-once")
        if self.rank == self.a.die_rank and self.epoch == 1 and batch == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"rank {self.rank} dies in epoch 2", flush=True)
            os.kill(os.getpid(), 9)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", default="cpu:0,cpu:1")
    p.add_argument("--ratios", default=None)
    p.add_argument("--bn", action="store_true")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-where", default="end")
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--announce", action="store_true", help="print each rank's pid after its first step")
    p.add_argument("--print-listen", action="store_true", help="print the addresses this rank listens on")
    p.add_argument("--rows-per-rank", action="store_true", help="give each rank a different number of rows")
    p.add_argument("--backup", default=None, help="BackupAndRestore folder")
    p.add_argument("--die-rank", type=int, default=-1, help="this rank kills itself in epoch 2 once")
    p.add_argument("--unbuilt", action="store_true", help="a Sequential without an Input (built by fit)")
    p.add_argument("--sleep-rank", type=int, default=-1, help="this rank sleeps after its second step")
    p.add_argument("--sleep", type=float, default=0.0, help="for this many seconds")
    p.add_argument("--timeout", type=float, default=20.0, help="parallelize's collective timeout")
    a = p.parse_args()
    set_random_seed(0)
    layers = ([] if a.unbuilt else [keras.Input((4,))]) + [keras.layers.Dense(8, activation="relu")]
    if a.bn:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(2, activation="softmax"))
    model = keras.Sequential(layers)
    ratios = [float(r) for r in a.ratios.split(",")] if a.ratios else None
    model = multigpu.parallelize(model, devices=a.devices.split(","), ratios=ratios, timeout=a.timeout)
    rank = multigpu.rank()
    if a.print_listen:
        for address in listening_addresses():
            print(f"rank {rank} listens on {address}", flush=True)
    if rank == a.fail_rank and a.fail_where == "parallelize":
        raise RuntimeError(f"failing on purpose on rank {rank}")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    rows = a.rows + (rank if a.rows_per_rank else 0)
    x = rng.normal(size=(rows, 4)).astype("float32")
    y = rng.integers(0, 2, size=(rows,))
    callbacks = [Announce(rank, a)]
    if a.backup:
        callbacks.append(keras.callbacks.BackupAndRestore(a.backup))
    hist = model.fit(x, y, batch_size=a.batch, epochs=a.epochs, shuffle=False, verbose=0, callbacks=callbacks)
    if rank == a.fail_rank and a.fail_where == "fit":
        raise RuntimeError(f"failing on purpose on rank {rank}")
    if a.out:
        weights = model.get_weights()
        with open(f"{a.out}.rank{rank}.json", "w") as f:
            shares = multigpu.state(model).shares(a.batch) if multigpu.world_size() > 1 else [a.batch]
            json.dump({"history": hist.history, "epochs": hist.epoch, "weights": [w.tolist() for w in weights],
                       "world_size": multigpu.world_size(), "shares": shares}, f)
    print(f"rank {rank} done", flush=True)
    if rank == a.fail_rank and a.fail_where == "end":
        return a.exit_code or 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
