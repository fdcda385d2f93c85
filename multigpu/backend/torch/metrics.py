"""Global logs: metric states summed over ranks, and the step's extra values.

Keras metric states are sums and counts, so summing every rank's states and
then calling ``result()`` gives the metric over the global batch, weighted by
samples.  A step's logs become global in the collective the step does anyway
(the gradient sum, for the built-in step): :class:`StepLogs` packs the metric
states, any other scalar the step logs (as a sum of value times rows, so the
result is the rows-weighted mean) and the step timings into one vector, and
reads the logs back from its sum.  The local states stay local, so the next
step keeps accumulating.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

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
        variables = self.variables()
        if not variables:
            return torch.zeros(0)
        return torch.cat([v.value.detach().reshape(-1).to(torch.float32).cpu() for v in variables])

    def results(self, summed: torch.Tensor | list[float]) -> dict:
        """``get_metrics_result()`` with every state replaced by its sum over ranks."""
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
        tail = torch.tensor([*values, float(rows), *timing], dtype=torch.float32)
        return torch.cat([self.vector(), tail])

    def unpack(self, summed: list[float], n_timing: int, phase: str) -> tuple[dict, list[float]]:
        """Global logs and the summed timing slots from the summed vector."""
        extra_keys, keys = self._layouts.get(phase, ([], None))
        n_states = sum(v.value.numel() for v in self.variables())
        n_extra = len(extra_keys)
        states = summed[:n_states]
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
    def global_results(self) -> dict:
        """Global results now: the last step's if no metric changed since, else one collective."""
        if self._fresh is not None:
            return self._fresh
        state = self.vector()
        buf = self.comm.buffer(state.numel() + 1)
        buf[: state.numel()].copy_(state)
        buf[-1] = 1.0
        summed = self.comm.reduce(buf, tag=state.numel() % 2039 + 1, what="summing metrics")
        self._fresh = self.results(summed[: state.numel()].clone())
        return self._fresh
