"""What the run's log tells the user about the shares and about where the time goes (rank 0 prints it).

Each piece of advice is said at most once per parallel model: the devices together are slower than the
fastest alone, the input holds the run back, the link holds the run back.  The share search's decisions
are said as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from multigpu.balancing.windows import Event, Window

__all__ = ["INPUT_BOUND", "LINK_BOUND", "Advice", "describe_shares"]

INPUT_BOUND = 0.2  # a device that waits this share of its time for input is held back by it
LINK_BOUND = 0.3  # a run whose gradient sums take this share of every device's time is held back by the link


def describe_shares(ratios: Sequence[float]) -> str:
    """Shares as percentages, e.g. ``"67%/33%"``."""
    total = sum(ratios)
    return "/".join(f"{r / total:.0%}" for r in ratios)


class Advice:
    """The log's lines about one parallel model's run.

    Args:
        devices: every rank's device (``label`` is used).
        log: prints one line (rank 0 only).
        compression: how gradients travel (``None``: exact), for the advice on slow links.
    """

    def __init__(self, devices: Sequence, log: Callable[[str], None], compression: str | None) -> None:
        self.devices = list(devices)
        self._log = log
        self.compression = compression
        self._said: set[str] = set()
        self._settled_windows = 0

    def event(self, e: Event) -> None:
        """One decision of the share search."""
        if e.kind == "keep":
            self._log(f"shares {describe_shares(e.before)} -> {describe_shares(e.after)}: "
                      f"{e.throughput_after:.0f} samples/s against {e.throughput_before:.0f} ({e.reason}), kept")
        elif e.kind in ("undo", "scanned"):
            end = "): undone" if e.kind == "undo" else ", scanning)"
            self._log(f"shares {describe_shares(e.before)} ran {e.throughput_after:.0f} samples/s against "
                      f"{e.throughput_before:.0f} at {describe_shares(e.after)} ({e.reason}{end}")
        elif e.kind == "recheck":
            self._log(f"shares {describe_shares(e.before)} ran {e.throughput_after:.0f} samples/s against "
                      f"{e.throughput_before:.0f} at {describe_shares(e.after)} ({e.reason}): measuring "
                      f"{describe_shares(e.after)} again before keeping it")
        elif e.kind == "settle":
            rate = f" ({e.throughput_before:.0f} samples/s)" if e.throughput_before else ""
            self._log(f"shares settled at {describe_shares(e.after)}{rate}: {e.reason}")
        elif e.kind == "restart":
            self._log(f"searching shares again: {e.reason} ({e.throughput_after:.0f} samples/s, "
                      f"{e.throughput_before:.0f} before)")

    def gain(self, window: Window, settled: bool, solo_speeds: Sequence[float] | None, batch: int) -> None:
        """Says once when the devices together are slower than the fastest one alone.

        Judged on windows at the shares the search settled on (``settled``): a
        window at shares the search only tries (a scan point far from the best,
        a move it undoes) says nothing about what the devices can do together.
        """
        self._settled_windows += 1
        if "gain" in self._said or not solo_speeds or self._settled_windows < 3 or not settled:
            return
        best = max(solo_speeds)
        if window.throughput >= 0.9 * best:  # clearly slower, not a noisy window
            return
        self._said.add("gain")
        fastest = self.devices[list(solo_speeds).index(best)].label
        step = window.seconds * batch / max(window.samples, 1)
        # A step costs about c + B / (sum of solo speeds) on all devices and B / best on the fastest alone:
        # c (communication and per-step work) is what the devices must earn back.
        c = max(0.0, step - batch / sum(solo_speeds))
        gain = 1.0 / best - 1.0 / sum(solo_speeds)
        pays = f"; from a global batch of about {int(c / gain) + 1} they would pay" if gain > 0 else ""
        self._log(f"at a global batch of {batch} the {len(self.devices)} devices together run "
                  f"{window.throughput:.0f} samples/s, less than {fastest} alone ({best:.0f} samples/s in "
                  f"calibration): communication and per-step work cost more than they save{pays}.")

    def epoch(self, epoch: int, e: dict) -> None:
        """What an epoch's totals (``wall``, ``input``, ``sum`` per device, ``steps``) call for."""
        if not e["steps"]:
            return
        waited = [i / w if w else 0.0 for i, w in zip(e["input"], e["wall"])]
        if "input" not in self._said and max(waited) >= INPUT_BOUND:
            self._said.add("input")
            detail = ", ".join(f"{d.label} {f:.0%}" for d, f in zip(self.devices, waited))
            self._log(f"the input holds the run back: in epoch {epoch + 1} the devices waited for their batches "
                      f"({detail} of their time). More loader workers (PyDataset(workers=...), "
                      "DataLoader(num_workers=...)) or a faster source would speed training; more devices would "
                      "not.")
        summing = [e["sum"] / w if w else 0.0 for w in e["wall"]]
        if "link" not in self._said and self.compression is None and min(summing) >= LINK_BOUND:
            self._said.add("link")
            self._log(f"the link holds the run back: in epoch {epoch + 1} summing gradients took "
                      f"{min(summing):.0%} or more of every device's time, waiting for the link rather than for a "
                      "slower device. parallelize(..., compression='bf16') sends half the bytes (sums rounded to "
                      "16 bits, so no longer exact); a larger batch sends the same bytes for more samples.")
