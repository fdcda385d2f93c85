"""Going on after a lost device, exactly: keep, take the step again, catch up, welcome back.

The protocol is the same on every backend whose sums can leave a broken group
(:attr:`~multigpu.backend.facts.Facts.elastic`); a backend's steps take part
only through the hooks :class:`RecoveryHooks` declares (every backend's steps have them):

* ``snapshot()`` before a step, ``restore_forward(kept)`` after a loss: what a
  forward pass writes (non-trainable variables such as BatchNorm's moving
  statistics; the metric states are the steps' own to keep);
* ``undo_updates()``: for a step of the model's own, whose logs are summed
  after its updates, what those updates changed before the sum failed;
* ``take_over_metrics()`` and ``metrics_from_zero()``: the lost ranks' metric
  counts, and a rank that finished its step with another rank's sum;
* ``_broadcast_variables(variables, what, src)``: the state one rank sends;
* ``finish_sum(summed, n_timing, adopt)``: a training step finished with
  another rank's sum;
* ``_welcome_state()``: a rank that came back takes the others' state.

When a rank is lost during a step (:mod:`multigpu.membership`), its sum raises
:class:`~multigpu.membership.PeerLostError` before any weight changed (the
engine formed the group of the survivors): the step puts back what its
forward pass changed, plans the same global batch over the ranks left, and
runs again on its new rows (:meth:`Recovery.after_loss`).  A sum that the
loss cut short on some ranks after others had it (a ring collective broken
midway) leaves the ones that had it a step ahead: the others take the state
of one of them and finish their step with its logs
(:meth:`Recovery._catch_up`).  When a lost rank's process, started again,
waits to come back, the ranks say so in the sum's last word
(:meth:`Recovery.waiting`); at the next step they form a group with it, send
it the run's position and state, and plan that step's batch over every
device in the run (:meth:`Recovery.welcome`).
"""

from __future__ import annotations

import time

import keras

from multigpu import env, failure, membership
from multigpu._keras.model_parts import build_optimizer, optimizers_of
from multigpu.log import logger as log

__all__ = ["Recovery", "RecoveryHooks", "counts_after_loss"]


class RecoveryHooks:
    """What a backend's steps give the protocol, where its facts say it is elastic (a part of
    :class:`~multigpu.backend.steps.StepsCore`; ``_broadcast_variables`` and ``_welcome_state`` are the core's)."""

    def snapshot(self):
        """What a step changes before its sum (non-trainable variables; the metric states kept aside)."""
        raise NotImplementedError(f"{type(self).__name__} does not go on after a lost device")

    def restore_forward(self, kept) -> None:
        """Puts back the non-trainable variables :meth:`snapshot` kept (a step taken again)."""
        raise NotImplementedError(f"{type(self).__name__} does not go on after a lost device")

    def undo_updates(self) -> None:
        """A step of the model's own, whose logs are summed after its updates: what its updates changed."""
        raise NotImplementedError(f"{type(self).__name__} does not go on after a lost device")

    def take_over_metrics(self) -> None:
        """The lost ranks' metric counts, taken over by the ranks left (the global sums stay right)."""
        raise NotImplementedError(f"{type(self).__name__} does not go on after a lost device")

    def metrics_from_zero(self) -> None:
        """This rank's metric states start again at 0 (it finished its step with another rank's sum)."""
        raise NotImplementedError(f"{type(self).__name__} does not go on after a lost device")

    def finish_sum(self, summed: list[float], n_timing: int, adopt: dict):
        """Finishes this rank's training step with another rank's sum and shares; returns the step's logs."""
        raise NotImplementedError(f"{type(self).__name__} does not go on after a lost device")


class Recovery:
    """The one owner of a parallel model's recovery from a lost device (see the module docstring).

    Args:
        steps: the model's steps (a :class:`~multigpu.backend.steps.StepsCore` with the recovery hooks).
    """

    def __init__(self, steps) -> None:
        self.steps = steps
        self.comm = steps.comm
        self.balancer = steps.balancer
        self.parallel = steps.parallel
        self.model = steps.model
        self.welcome_due = False  # the last sum said ranks coming back wait: take them in at this step
        self.last_sum: tuple[list[float], int] | None = None  # the last training sum read (a rank may be lost)

    # ------------------------------------------------------------- a step
    @property
    def elastic(self) -> bool:
        """Whether this run goes on without a lost device (``min_devices``)."""
        return getattr(self.comm, "min_devices", None) is not None  # JAX's group has none: it cannot go on

    def keep(self, also: bool = False):
        """Before a step that may have to be taken again (a run that may lose a rank, or ``also``): what it
        changes before its sum (``snapshot()``); None when nothing is kept."""
        if not self.elastic and not also:
            return None
        return self.steps.snapshot()

    def read(self, summed: list[float], n_timing: int, waiting: bool) -> None:
        """Notes a training step's sum as read (a rank that missed it may need it) and its last word."""
        if self.elastic:
            self.last_sum = (list(summed), n_timing)
        self.welcome_due = waiting

    def waiting(self) -> bool:
        """The word this rank adds to the step's sum: ranks coming back wait to be taken in (in a fit they can
        join, on a batch that can be cut again for them)."""
        return (self.elastic and self.comm.join_waiting() and self.parallel.position.get("rejoinable", False)
                and self.balancer.planner.can_cut_again)

    def cut_again(self, plan):
        """``(this rank's rows, plan)`` of the batch being stepped on, planned again by the shares now (a batch
        planned with rows for a rank lost since: a DataLoader draws a few batches ahead)."""
        again = self.balancer.planner.again(True)
        if again is None:
            failure.fail(f"a batch planned with rows for a lost rank ({list(plan.sizes)}) cannot be cut again: "
                         "going on after a lost device needs an input that can cut a batch again.")
        plan, data = again
        return data, plan

    # ------------------------------------------------------------- a loss
    def after_loss(self, lost: membership.PeerLostError, kept, for_step: bool):
        """After the group of the ranks left formed (the sum did that): ``(new rows, new plan, None)``, the
        step's changes undone, the lost ranks' metric counts taken over, and the same global batch planned
        again; or, on a rank that the loss left a step behind others (:meth:`_catch_up`), ``(None, None, logs)``:
        its step is done, with their state."""
        began = time.perf_counter()
        self.steps.undo_updates()
        position = self.parallel.position
        where = {"at": (position.get("epoch", 0), position.get("step", 0), for_step),
                 "done": [int(keras.ops.convert_to_numpy(o.iterations)) for o in optimizers_of(self.model)]}
        seen = self.comm.gather_objects(where, "comparing the steps done")
        ahead = self._ahead(seen)
        behind = ahead is not None and self.comm.rank not in ahead
        if not behind:
            self.steps.restore_forward(kept)
        logs = self._catch_up(ahead[0], behind) if ahead is not None else None
        self.steps.take_over_metrics()
        entry = lost.members.lost[-1]
        if ahead is not None and self.comm.rank == self.comm.leader:
            others = [r for r in self.comm.members if r not in ahead]
            log.info(f"the sum of step {seen[ahead[0]]['at'][1]} reached rank(s) {ahead} and not {others} "
                     f"before rank {entry['rank']} was lost: rank(s) {others} took rank {ahead[0]}'s weights, "
                     f"optimizer state and logs of that step ({time.perf_counter() - began:.2f} s).")
        if behind:
            return None, None, logs
        again = self.balancer.planner.again(for_step)
        if again is None:
            failure.fail(f"{lost}, but this batch cannot be cut again: a DataLoader over a map-style dataset draws "
                         "its validation batches ahead of the step, so the one being evaluated is not known. Going "
                         "on after a loss during validation needs validation data of arrays, tensors, a "
                         "keras.utils.PyDataset, a generator, a tf.data or grain dataset.")
        plan, data = again
        if self.comm.rank == self.comm.leader:
            shares = ", ".join(f"{self.comm.runtime.devices[r].label} {plan.sizes[r]}" for r in self.comm.members)
            done = where["done"]
            at = f"step {done[0] + 1}" if for_step and done else "a validation batch"
            n = len(self.comm.members)
            log.info(f"lost rank {entry['rank']} ({entry['device']}, {entry['why']}); {at} again on "
                     f"{n} device{'s' if n > 1 else ''}, "
                     f"rows {shares} of {plan.total}; {time.time() - entry['at']:.1f} s after the loss "
                     f"({time.perf_counter() - began:.2f} s to agree).")
        return data, plan, None

    def _ahead(self, seen: list) -> list[int] | None:
        """The ranks a step ahead of the others (in group order), or None when every rank left is where the
        others are; the run ends, saying why, when the ranks left cannot be brought to one state."""
        members = self.comm.members
        places = {r: (tuple(seen[r]["at"]), tuple(seen[r]["done"])) for r in members}
        if len(set(places.values())) == 1:
            return None
        first = max(places.values())
        ahead = [r for r in members if places[r] == first]
        rest = {places[r] for r in members if places[r] != first}
        (epoch, step, training), done = first
        if len(rest) == 1:
            (b_epoch, b_step, b_training), b_done = next(iter(rest))
            if (training and b_training and b_epoch == epoch and b_step + 1 == step
                    and all(a >= b for a, b in zip(done, b_done))):
                return ahead
        where = "; ".join(f"rank {r}: epoch {(at := places[r][0])[0] + 1}, "
                          f"{'step' if at[2] else 'validation after step'} {at[1] + 1}, updates {list(places[r][1])}"
                          for r in members)
        failure.fail(f"the ranks left are at different places after losing a rank ({where}): the lost rank's sum "
                     "reached some of them only. A rank one training step behind the others takes their state; "
                     "these are further apart (more than one step, past the end of an epoch, or in more than two "
                     "places), so the run ends.")

    def _catch_up(self, src: int, behind: bool):
        """When the lost rank's sum reached some ranks only, which applied that step and went on to the next:
        rank ``src`` (the first of them) sends its weights and optimizer state, the sum it read and the shares
        it planned with, and a rank that missed the sum (``behind``) finishes its step with them, as if its sum
        had arrived: the step's global logs (returned), the step's record, its metric states at 0 (the global
        sums stay right: the writer takes over the difference). Its non-trainable variables (BatchNorm's
        moving statistics, its random streams) stay its own, as they are after its forward pass."""
        leading = self.comm.rank == src
        message = self.comm.share({"summed": self.last_sum, **self.balancer.catch_up_state()} if leading
                                  else None, src, "sending the step some ranks missed")
        trainable = list(self.model.trainable_variables)
        state, ids = list(trainable), {id(v) for v in trainable}
        for optimizer in optimizers_of(self.model):
            build_optimizer(optimizer, trainable)
            state += [v for v in optimizer.variables if id(v) not in ids]
            ids.update(id(v) for v in optimizer.variables)
        self.steps._broadcast_variables(state, "sending the state of a step some ranks missed", src=src)
        if not behind:
            return None
        summed, n_timing = message["summed"]
        adopt = {"ratios": message["ratios"], "before_loss": message["before_loss"]}
        logs = self.steps.finish_sum(summed, n_timing, adopt)
        self.welcome_due = False  # the others read that word before the loss, at the step they take again
        self.steps.metrics_from_zero()
        return logs

    # ------------------------------------------------------------- a return
    def welcome(self):
        """Takes in the ranks coming back, before this step: a group with them, the run's position and the
        leader's shares for them, the leader's state everywhere (:meth:`StepsCore._initialize` on their
        side), and this step's global batch planned over every device: ``(new plan, this rank's rows)``."""
        self.welcome_due = False
        began = time.perf_counter()
        run_dir = env.get(env.RUN_DIR)
        found = membership.read(run_dir)
        newcomers = found.newcomers(self.comm.members)
        leader = self.comm.rank == self.comm.leader
        if leader:
            membership.open_welcome(run_dir, found.generation)
        self.comm.regroup(found)
        position = self.parallel.position
        message = self.comm.welcome({
            **position, "ratios": self.balancer.ratios_with(newcomers),
            "out": [r for r in range(self.comm.world_size) if r not in found.members]} if leader else None)
        self.balancer.rejoined(message["ratios"], message["out"])
        self.steps._welcome_state()
        plan, data = self.balancer.planner.again(True)
        if leader:
            came = ", ".join(f"rank {r} ({self.comm.runtime.devices[r].label})" for r in newcomers)
            losses = {e["rank"]: e["at"] for e in found.lost}
            since = "; ".join(f"{time.time() - losses[r]:.1f} s after its loss" for r in newcomers if r in losses)
            shares = ", ".join(f"{self.comm.runtime.devices[r].label} {plan.sizes[r]}" for r in self.comm.members)
            log.info(f"{came} rejoined at epoch {position['epoch'] + 1}, step {position['step'] + 1}: rows "
                     f"{shares} of {plan.total}; {since} ({time.perf_counter() - began:.2f} s to take it in).")
        return plan, data


def counts_after_loss(comm, kept: list[float], summed: list[float] | None) -> list[float]:
    """This rank's metric states after a rank was lost during a step: its states before the step (``kept``),
    and on the leader also what the lost ranks had counted (the last global sum less the survivors' part), so
    that the global results go on as if nothing was lost.  Every rank calls it (a sum over the ranks left)."""
    if summed is None:
        return list(kept)
    survivors = comm.sum_floats(list(kept), "summing the metrics of the ranks left")
    if comm.rank != comm.leader:
        return list(kept)
    return [k + (s - v) for k, s, v in zip(kept, summed, survivors)]
