"""Global logs: metric states summed over ranks, and the step's extra values.

Keras metric states are sums and counts, so summing every rank's states and
then calling ``result()`` gives the metric over the global batch, weighted by
samples.  A step's logs become global in the collective the step does anyway
(the gradient sum, for the built-in step): :meth:`GlobalMetrics.pack` packs the metric
states, any other scalar the step logs (as a sum of value times rows, so the
result is the rows-weighted mean) and the step timings into one vector, and
reads the logs back from its sum.  The local states stay local, so the next
step keeps accumulating.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch

from multigpu._keras import compat as _compat
from multigpu.backend.recovery import counts_after_loss

__all__ = ["ALL_METRICS", "GlobalMetrics"]

ALL_METRICS: dict = {}  # a step's logs that are exactly ``model.metrics`` (Keras's own step): nothing extra


class GlobalMetrics:
    """Global results of one model's metrics.

    Args:
        model: the user's model.
        comm: the run's collectives.
    """

    def __init__(self, model, comm) -> None:
        self.model = model
        self.comm = comm
        self.local = False  # inside a step: get_metrics_result() answers locally
        self.updates_only = False  # inside Keras's compute_metrics in the built-in step: no results needed
        self._key: tuple | None = None
        self._variables: list = []
        self._fresh: dict | None = None  # global results of the last step, while no metric changed
        self._layouts: dict[str, tuple[list[str], list[str]]] = {}  # phase -> (extra keys, all keys)
        self._plan_key: tuple | None = None  # the metrics the plan below was decided for
        self._plan: list[tuple[str, int, int]] | None = None  # plain means read from the states (or None)
        self._kept: torch.Tensor | None = None  # this rank's states before the step (runs that may lose a rank)
        self._summed: torch.Tensor | None = None  # every rank's states summed, as of the last sum

    # ------------------------------------------------------------ states
    def variables(self) -> list:
        """Every state variable of ``model.metrics``, once each, in a stable order."""
        metrics = self.model.metrics
        key = tuple(id(m) for m in metrics)
        if key != self._key:
            seen, out = set(), []
            for m in metrics:
                for v in m.variables:
                    if id(v) not in seen:
                        seen.add(id(v))
                        out.append(v)
            self._key, self._variables = key, out
        return self._variables

    def vector(self) -> torch.Tensor:
        """This rank's metric states, flat, float32."""
        states = self._scalar_states()
        if states is not None:
            return torch.tensor(states, dtype=torch.float32)
        return torch.cat([v.value.detach().reshape(-1).to(torch.float32).cpu() for v in self.variables()])

    def _scalar_states(self) -> list[float] | None:
        """The states as floats when every state is a scalar on the CPU (the usual case: cheaper than tensors).

        On a GPU each ``item()`` would wait for the device: one copy of all the states is cheaper there.
        """
        variables = self.variables()
        if all(v.value.numel() == 1 and v.value.device.type == "cpu" for v in variables):
            return [v.value.item() for v in variables]
        return None

    def results(self, summed: torch.Tensor | list[float]) -> dict:
        """``get_metrics_result()`` with every state replaced by its sum over ranks."""
        plan = self._means_plan()
        if plan is not None:
            return _mean_results(plan, summed)
        return self._results(summed)

    def _means_plan(self) -> list[tuple[str, int, int]] | None:
        """Where each result's total and count sit in the states, when every metric is a plain mean.

        Keras's ``Mean`` (the loss tracker, and every ``MeanMetricWrapper``
        such as accuracy) returns ``total / count`` (0 where the count is 0).
        Computed from the summed states directly, without writing them into
        the variables and calling ``result()``, it costs microseconds instead
        of about 0.3 ms a step.  The plan is checked once against
        ``result()`` itself (names and values); on any difference, or any
        other metric, every result comes from ``result()``.
        """
        key = tuple(id(m) for m in self.model.metrics)
        if self._plan_key == key:
            return self._plan
        if not all(getattr(m, "built", True) for m in self.model.metrics):
            return None  # Keras builds its compiled metrics at the first step: decide then
        self._plan_key, self._plan = key, None
        index = _offsets(self.variables())
        plan = []
        for metric in self.model.metrics:
            parts = [(metric.name, metric)] if _plain_mean(metric) else _compat.named_results(metric)
            if parts is None or not all(_plain_mean(m) for _, m in parts):
                return None
            plan += [(name, index[id(m.total)], index[id(m.count)]) for name, m in parts]
        states = self.vector().tolist()
        reference = self._results(states)
        fast = _mean_results(plan, states)
        if list(reference) == list(fast) and all(_same(reference[k], fast[k]) for k in fast):
            self._plan = plan
        return self._plan

    def _results(self, summed: torch.Tensor | list[float]) -> dict:
        variables = self.variables()
        summed = torch.as_tensor(summed, dtype=torch.float32)
        saved = [v.value.detach().clone() for v in variables]
        offset = 0
        with torch.no_grad():
            for v, s in zip(variables, saved):
                part = summed[offset : offset + s.numel()].view(s.shape)
                v.value.copy_(part.round() if not s.dtype.is_floating_point else part)
                offset += s.numel()
        try:
            out = {}
            for metric in self.model.metrics:
                value = metric.result()
                out.update(value if isinstance(value, dict) else {metric.name: value})
            return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        finally:
            with torch.no_grad():
                for v, s in zip(variables, saved):
                    v.value.copy_(s)

    @contextmanager
    def local_results(self):
        """Within the block, ``model.get_metrics_result()`` answers from local states (no collective)."""
        self.local = True
        try:
            yield
        finally:
            self.local = False

    @contextmanager
    def no_results(self):
        """Within the block, ``model.get_metrics_result()`` returns ``{}``: the step needs the updates only.

        Keras's ``compute_metrics`` updates the metrics and then computes their
        (local) results; the built-in step reads global results from the summed
        states instead, so computing local ones would double the metrics' cost.
        """
        self.updates_only = True
        try:
            yield
        finally:
            self.updates_only = False

    def invalidate(self) -> None:
        """A metric changed (a step started, metrics were reset)."""
        self._fresh = None

    # ------------------------------------------------------------ a lost rank
    def keep(self) -> None:
        """Keeps this rank's states before a step, to take the step again after a lost rank."""
        self._kept = self.vector().clone()

    def restore(self) -> None:
        """Puts this rank's states back as :meth:`keep` found them (a step taken again)."""
        if self._kept is not None:
            self.load(self._kept)

    def forget(self) -> None:
        """The metrics were reset: no rank has counted anything yet."""
        self._summed = None

    def load(self, states: torch.Tensor) -> None:
        """Writes ``states`` (flat, as :meth:`vector` gives them) into the metric variables."""
        offset = 0
        with torch.no_grad():
            for v in self.variables():
                n = v.value.numel()
                v.value.copy_(states[offset : offset + n].reshape(v.value.shape).to(v.value.dtype))
                offset += n
        self._fresh = None

    def start_from_zero(self) -> None:
        """A rank that finished its step with another rank's sum (its own part of the step's counts is not
        known apart from the others'): its states go to 0 at :meth:`take_over`, and the writer holds the rest."""
        if self._kept is not None:
            self._kept = torch.zeros_like(self._kept)

    def take_over(self, comm) -> None:
        """After a rank was lost during a step: every rank back to its states before the step, and the leader
        adds what the lost ranks had counted (the last sum less the survivors' part), so that the global
        results go on as if nothing was lost."""
        if self._kept is None:
            return
        summed = None if self._summed is None else self._summed.tolist()
        self.load(torch.tensor(counts_after_loss(comm, self._kept.tolist(), summed), dtype=torch.float32))

    # ------------------------------------------------------------ a step's logs
    def pack(self, logs: dict | None, rows: int, timing: list[float], phase: str) -> torch.Tensor:
        """The vector a step sends: metric states, extra logs times rows, rows, timings.

        Args:
            logs: what the step returned on this rank (None for a rank with no
                rows, which sends the layout of the phase's step before).
            rows: this rank's rows in the step.
            timing: this rank's slots of the step record.
            phase: ``"train"`` or ``"test"`` (each keeps its own layout).

        Raises:
            ValueError: when the step logs a value that is neither a metric
                nor a scalar.
        """
        if logs is ALL_METRICS:
            self._layouts[phase] = ([], None)
        elif logs is not None:
            names = self._metric_names()
            extra = [k for k in logs if k not in names]
            for k in extra:
                value = logs[k]
                if isinstance(value, torch.Tensor) and value.numel() != 1:
                    raise ValueError(
                        f"multigpu: the step logged {k!r} with shape {tuple(value.shape)}; logs must be metrics "
                        "(in model.metrics) or scalars, so that every rank can show the global value."
                    )
            self._layouts[phase] = (extra, list(logs))
        extra_keys = self._layouts.get(phase, ([], None))[0]
        values = []
        for k in extra_keys:
            value = 0.0 if logs is None else logs[k]
            values.append((float(value) if not isinstance(value, torch.Tensor) else float(value.detach())) * rows)
        tail = [*values, float(rows), *timing]
        states = self._scalar_states()
        if states is not None:
            return torch.tensor(states + tail, dtype=torch.float32)
        return torch.cat([self.vector(), torch.tensor(tail, dtype=torch.float32)])

    def unpack(self, summed: list[float], n_timing: int, phase: str) -> tuple[dict, list[float]]:
        """Global logs and the summed timing slots from the summed vector."""
        extra_keys, keys = self._layouts.get(phase, ([], None))
        n_states = sum(v.value.numel() for v in self.variables())
        n_extra = len(extra_keys)
        states = summed[:n_states]
        if self.comm.min_devices is not None:  # a run that may lose a rank: its counts stay known
            self._summed = torch.tensor(states, dtype=torch.float32)
        extra = summed[n_states : n_states + n_extra]
        rows = summed[n_states + n_extra]
        timing = summed[n_states + n_extra + 1 : n_states + n_extra + 1 + n_timing]
        results = self.results(states)
        self._fresh = results
        logs = dict(results)
        for k, value in zip(extra_keys, extra):
            logs[k] = torch.tensor(value / rows if rows else 0.0)
        if keys is not None:
            logs = {k: logs[k] for k in keys if k in logs}
        return logs, timing

    def _metric_names(self) -> set[str]:
        key = tuple(id(m) for m in self.model.metrics)
        if getattr(self, "_names_key", None) != key:
            with self.local_results():
                self._names = set(self.model.get_metrics_result())
            self._names_key = key
        return self._names

    # ------------------------------------------------------------ outside steps
    def global_results(self, aside=None) -> dict:
        """Global results now: the last step's if no metric changed since, else one collective (``aside``:
        :meth:`SetAside.epoch_results <multigpu.backend.parking.SetAside.epoch_results>`, the rank left's own
        while devices are set aside)."""
        if self._fresh is not None:
            return self._fresh
        if aside is not None:
            self._fresh = aside(lambda: self.results(self.vector()), self._summed_results)
            if self._fresh is not None:
                return self._fresh
        self._fresh = self._summed_results()
        return self._fresh

    def _summed_results(self) -> dict:
        """The results of the metric states summed over the ranks (over the ranks left where ``comm.among``)."""
        state = self.vector()
        buf = self.comm.buffer(state.numel() + 1)
        buf[: state.numel()].copy_(state)
        buf[-1] = 1.0
        summed = self.comm.reduce(buf, tag=state.numel() % 2039 + 1, what="summing metrics")
        self._summed = summed[: state.numel()].clone().cpu()
        return self.results(self._summed)


def _plain_mean(metric) -> bool:
    """A Keras ``Mean`` whose result is Keras's own ``total / count`` in float32."""
    import keras

    return (isinstance(metric, keras.metrics.Mean) and type(metric).result is keras.metrics.Mean.result
            and metric.dtype == "float32" and len(metric.variables) == 2)


def _offsets(variables: list) -> dict:
    """Each variable (by id) -> its first position in the flat state vector."""
    out, offset = {}, 0
    for v in variables:
        out[id(v)] = offset
        offset += v.value.numel()
    return out


def _mean_results(plan: list[tuple[str, int, int]], summed) -> dict:
    values = summed.tolist() if isinstance(summed, torch.Tensor) else summed
    out = {}
    for name, t, c in plan:
        total, count = np.float32(values[t]), np.float32(values[c])
        out[name] = torch.tensor(total / count if count != 0 else np.float32(0.0))
    return out


def _same(a, b) -> bool:
    a, b = float(a), float(b)
    return a == b or (math.isnan(a) and math.isnan(b))
