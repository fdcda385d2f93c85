"""The forward pass and loss of Keras's own training step, replayed as recorded torch operations.

Keras runs each layer's forward pass through Python (its ``__call__``,
dtype policies, name scopes, ``keras.ops`` dispatch), which costs tens of
microseconds per operation whatever the batch.  On small models and small
local batches that is most of a step: on the MLP 784-512-512-10 at 32 rows,
the forward pass and loss took 2.3 ms through Keras against 0.8 ms as bare
torch calls.  Splitting a batch over devices halves the arithmetic of each
but not this fixed cost, so it decided whether two devices beat one.

:class:`ForwardReplay` records, once per input signature, the torch
operations that the model's forward pass and ``compute_loss`` dispatch
(``torch.fx``'s ``make_fx``, on the real tensors), and from then on calls
those operations directly.  Autograd sees the same operations in the same
order as in Keras's own code, so the loss, the outputs and every gradient
are the same bit for bit; backward is untouched.  Variables the pass writes
(BatchNorm's moving statistics, the loss's per-output trackers) are
arguments of the recording, so a replay writes them as Keras's pass does.

It replays only where that is certain, and otherwise the step runs Keras's
own code (nothing else changes):

* every layer's ``call`` is Keras's own or one of keras-hub's modeling layers
  (``keras_hub.src.layers.modeling``: transformer blocks, attention,
  embeddings; like Keras's, they keep no Python state between steps), and
  the model's ``compute_loss`` is Keras's (a layer or model of the user's own
  may keep Python state between steps);
* the recording reads no tensor's value into Python (``make_fx`` refuses
  that: a branch on the data, a seeded ``Dropout``'s seed), and draws random
  numbers only from torch's default generator (an unseeded ``Dropout``): the
  replay then draws them in the same order and sizes as Keras's pass would;
* the first replay of each signature gives the same outputs, loss and
  gradients, bit for bit, as Keras's own pass on the same batch.

``parallelize(replay=False)`` (or ``MULTIGPU_REPLAY=0``) keeps Keras's own pass everywhere.

When to record is a matter of cost. A recording costs several passes (tracing, one checking replay, the
gradients of both, compared by digests one at a time, :mod:`.digest`: 1.5 s for the outside convnet at 86 rows,
7x its forward pass, against 0.2 s for an MLP), and each new local batch size is a new signature, so a share
search that moves the shares would pay it at every move. What a replay saves is measured: the first signature is
recorded at its second step (``record_at``), and the first replays of a signature recorded after at least three
warm passes through Keras (from its second: a first pass pays for a new size's buffers and kernels' plans) are
timed against the fastest of them, in processor time; until then, a signature is recorded once its passes
through Keras took as long as the last recording did. The saving per step is about the same at every batch size
(it is Keras's Python per operation). A later signature is then recorded once the steps it ran through Keras's
pass would have saved as much as a recording costs (a rent-or-buy rule: at most twice the cost of knowing the
future); where the future is known (the shares settled, the steps left in ``fit``), at once if those steps would
save it, else not in this ``fit`` (renting, the GRU of ``bench_fresh_auto.py`` paid a 2-4 s recording in its
last epoch to save at most 0.1 s), so a model whose replay saves nothing (a convnet, whose time is its
arithmetic) is never recorded again and a size a search only passes through costs nothing. While the search
moves, a new size is recorded at its first step when the replay saves something and a recording costs at most
``PROMPT_SECONDS``: its windows should time the same pass as the shares they are compared with. A saving below
``MIN_GAIN`` of Keras's pass counts as none (the first passes of a size overstate it). At most ``max_graphs``
signatures are kept. Recording runs the forward pass once more, with every non-trainable variable and torch's
random state restored afterwards (recording and checking the replay write them once more).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import keras
import torch

from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import own_method
from multigpu.backend.torch import internals
from multigpu.backend.torch.digest import gradient_digests

__all__ = ["ForwardReplay", "ineligible", "prepare_graph"]

_DIFFERS = "its replay differed from Keras's own pass"
# Modules whose layers' ``call`` the replay trusts to keep no Python state between steps.
TRUSTED_MODULES = ("keras.", "keras_hub.src.layers.modeling.")
# While the share search moves, a new batch size is recorded at once only when a recording costs at most
# this: the GRU of bench_balance records in 4 s, and a recording at each of a search's ~10 moves cost more
# than the search gained (gru 256: auto 0.65 of the best fixed share); the MLP's take 0.2 s.
PROMPT_SECONDS = 1.0
# A measured saving below this fraction of Keras's pass counts as none: the first passes of a size are still
# warming up (buffers, kernels' plans, caches), so they overstate it.  The outside convnet's replay saves 1-2%
# of its forward pass once warm, and measured 12-20% over its second pass; the MLP's saves 65%.
MIN_GAIN = 0.25
# Replays of a signature timed to measure the saving, and the warm passes through Keras's code (after its first)
# it is measured against: one warm pass is not enough (a process's second pass still ran 0.2 s against 0.07 s).
_TIMED_REPLAYS = 3
_WARM_PASSES = 3


class ForwardReplay:
    """The forward pass and loss of one model's built-in training step (see the module docstring).

    Args:
        model: the Keras model.
        enabled: False keeps Keras's own code for every step (global BatchNorm
            statistics, whose forward pass runs collectives).
        replay: False keeps Keras's own code too, because the caller asked
            (``parallelize(replay=False)``: the same numbers either way, so it is
            for measuring what the replay buys).
        max_graphs: the most input signatures kept, least recently used dropped.
        record_at: the earliest step of a signature at which it is recorded
            (later once the last recording took longer than the signature's
            steps so far through Keras's pass).
    """

    def __init__(self, model, *, enabled: bool = True, replay: bool = True, max_graphs: int = 8,
                 record_at: int = 2) -> None:
        self.model = model
        self.max_graphs = max_graphs
        self.record_at = record_at
        self._record_cost = 0.0  # seconds the last recording took
        if not enabled:
            self.reason: str | None = "disabled"
        elif not replay:
            self.reason = "replay=False"
        elif gaps := internals.missing():
            self.reason = f"torch {torch.__version__} lacks {', '.join(gaps)}"
        else:
            self.reason = None
        self.recorded = 0
        self.replayed = 0
        self.record_seconds = 0.0
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._seen: dict[tuple, tuple[int, float]] = {}  # steps and seconds through Keras's pass
        # What a replay saves is timed in processor time, which a throttled device's bursts do not distort
        # (the same pass measured 0.04 to 0.2 s of wall time on a device held to half a core).
        self._fastest: dict[tuple, tuple[int, float]] = {}  # warm passes through Keras's code: (count, fastest)
        self._replays: dict[tuple, list[float]] = {}  # the first replays' processor seconds, per signature
        self.gain: float | None = None  # processor seconds a replay saves per step; None until measured
        self._refused: set[tuple] = set()
        self._checked = False

    def forget(self) -> None:
        """Drops the recorded passes and what they hold (a device ran out of memory: it needs it back)."""
        self._graphs.clear()

    def __call__(self, x, y, sample_weight, *, prompt: bool = False,
                 ahead: int | None = None) -> tuple[object, torch.Tensor, bool]:
        """``(y_pred, loss, recorded)`` of the training forward pass on this batch.

        Args:
            x, y, sample_weight: the batch, as Keras unpacks it.
            prompt: record a new signature at its first step once a first
                recording exists and took at most ``PROMPT_SECONDS`` (the
                share search is moving: its windows should time the replayed
                pass, as at the shares it compares them with; a dearer
                recording at every probe would cost more than it corrects).
            ahead: the steps of this ``fit`` known to come at this signature
                (the shares settled, a whole global batch; None: not known):
                it is recorded now if they would save what a recording costs,
                else not in this ``fit``.

        ``recorded`` says that this call also recorded a signature (the step
        took longer than a step does).
        """
        if not self._checked:
            self._checked = True
            if self.reason is None:
                self.reason = ineligible(self.model)
        if self.reason is not None:
            y_pred, loss = self._keras(x, y, sample_weight)
            return y_pred, loss, False
        leaves, spec = _flat_inputs(x, y, sample_weight)
        values = _variable_values(self.model)
        key = _signature(self.model, leaves, spec, values)
        if key is not None:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                self.replayed += 1
                timed = self._replays.get(key)
                if timed is None or len(timed) >= _TIMED_REPLAYS:
                    return self._replay(graph, values, leaves)
                began = time.process_time()
                out = self._replay(graph, values, leaves)
                timed.append(time.process_time() - began)
                count, keras_cpu = self._fastest.get(key, (0, 0.0))
                if len(timed) == _TIMED_REPLAYS and count >= _WARM_PASSES:
                    replay_cpu = min(timed)
                    self.gain = keras_cpu - replay_cpu if replay_cpu < (1 - MIN_GAIN) * keras_cpu else 0.0
                return out
        began, began_cpu = time.perf_counter(), time.process_time()
        before = _rng_state() if key is not None and key not in self._refused else None
        y_pred, loss = self._keras(x, y, sample_weight)
        if key is None or key in self._refused:
            return y_pred, loss, False
        cpu = time.process_time() - began_cpu
        steps, seconds = self._seen.get(key, (0, 0.0))
        if steps:  # a signature's first pass also pays its first use (buffers, kernels' plans): not a measure
            count, fastest = self._fastest.get(key, (0, cpu))
            self._fastest[key] = count + 1, min(cpu, fastest)
        self._seen[key] = steps, seconds = steps + 1, seconds + time.perf_counter() - began
        if not self._should_record(steps, seconds, prompt, ahead):
            return y_pred, loss, False
        self._record(key, x, y, sample_weight, leaves, values, y_pred, loss, before)
        return y_pred, loss, True

    def _should_record(self, steps: int, seconds: float, prompt: bool, ahead: int | None = None) -> bool:
        """Whether a signature run ``steps`` times through Keras's pass (``seconds`` in all), with ``ahead`` steps
        of it known to come, is recorded now (see the module docstring)."""
        if prompt and self.recorded and self._record_cost <= PROMPT_SECONDS and (self.gain is None or self.gain > 0):
            return True
        if ahead is not None and self.recorded:  # the future is known: buy now, or not in this fit
            saves = self.gain if self.gain is not None else seconds / steps  # unmeasured: a free replay's saving
            return saves > 0 and ahead * saves >= self._record_cost
        if self.gain is None:  # the saving is not measured yet: record at ``record_at``, by the seconds rule
            return steps >= self.record_at and seconds >= self._record_cost
        return self.gain > 0 and steps * self.gain >= self._record_cost

    # ------------------------------------------------------------ internals
    def _keras(self, x, y, sample_weight):
        model = self.model
        y_pred = model(x, training=True) if _compat.call_has_training_arg(model) else model(x)
        return y_pred, _compat.compute_loss(model, x, y, y_pred, sample_weight, training=True)

    def _replay(self, graph, values, leaves):
        gm, unique, template = graph
        out = gm(*values, *(leaves[i] for i in unique))
        y_pred = out[0] if template is None else keras.tree.pack_sequence_as(template, list(out[:-1]))
        return y_pred, out[-1], False

    def _record(self, key, x, y, sample_weight, leaves, values, y_pred, loss, before: tuple) -> None:
        """Records the signature's operations, checks them, and keeps them if a replay matches Keras's pass.

        ``before`` is torch's random state before Keras's pass made ``y_pred`` and ``loss``: the checking
        replay starts from it, so a pass that draws random numbers draws the same ones.
        """
        began = time.perf_counter()
        unique = _unique_positions(leaves)
        flat_pred = keras.tree.flatten(y_pred)
        template = None if isinstance(y_pred, torch.Tensor) else keras.tree.map_structure(lambda _: 0, y_pred)
        variables = [v for v in _variables(self.model) if not v.trainable]
        saved = [v.value.detach().clone() for v in variables]  # recording and checking write them again
        rng = _rng_state()

        def forward(*_tensors):  # make_fx maps the variables and inputs to its arguments by identity
            pred, value = self._keras(x, y, sample_weight)
            return (*keras.tree.flatten(pred), value)

        problem = None
        try:
            gm = internals.make_fx(forward)(*values, *(leaves[i] for i in unique))
            trainable = len(self.model.trainable_variables)
            problem = prepare_graph(gm, trainable, len(values))
            if problem is None:
                _set_rng_state(before)
                out = gm(*values, *(leaves[i] for i in unique))
                expected = [*flat_pred, loss]
                if len(out) != len(expected) or not all(_same(a, b) for a, b in zip(out, expected)):
                    problem = _DIFFERS
                elif trainable and loss.requires_grad:  # and the gradients: backward sees what Keras's pass made
                    params = values[:trainable]  # (compared by digests: one gradient held at a time)
                    if gradient_digests(out[-1], params) != gradient_digests(loss, params, retain_graph=True):
                        problem = _DIFFERS
        except Exception as error:  # any failure to record means Keras's own pass
            problem = f"recording failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
        finally:
            with torch.no_grad():
                for v, value in zip(variables, saved):
                    v.value.copy_(value)
            _set_rng_state(rng)
        self._record_cost = time.perf_counter() - began
        self.record_seconds += self._record_cost
        if problem is not None:
            self._refused.add(key)
            if problem != _DIFFERS or (not self._graphs and len(self._refused) >= 2):
                self.reason = problem  # every signature would have it: Keras's own pass from now on
            return
        self.recorded += 1
        self._graphs[key] = (gm, unique, template)
        if self.gain is None:
            self._replays[key] = []  # time the first replays: what a replay saves decides the next recordings
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)


def ineligible(model) -> str | None:
    """Why ``model``'s forward pass cannot be replayed, or None."""
    for layer in [model, *_compat.flatten_layers(model)]:
        call = type(layer).call
        if not getattr(call, "__module__", "").startswith(TRUSTED_MODULES):
            return f"layer {layer.name!r} has its own call ({type(layer).__name__})"
    if own_method(type(model), "compute_loss") is not None:
        return "the model has its own compute_loss"
    return None


def prepare_graph(gm, trainable: int, variables: int) -> str | None:
    """Readies a recorded graph for replay; or says why it may not be replayed.

    Its first ``variables`` arguments are the model's variables, the first
    ``trainable`` of them trainable.  Keras writes a variable (``assign``)
    with gradients off, which the recording does not keep: each write to a
    non-trainable variable is made to run so again.  Writes to tensors made
    inside the pass stay as recorded (the recording's check compares the
    gradients too).  A graph that draws random numbers from a generator of
    its own, or writes a trainable variable or an input, is refused.
    """
    args = [node for node in gm.graph.nodes if node.op == "placeholder"]
    writable = set(args[trainable:variables])
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, internals.OpOverload):
            continue
        schema = node.target._schema
        if internals.random_tag() in node.target.tags and internals.argument(node, schema, "generator") is not None:
            return f"the forward pass draws random numbers from a generator of its own ({node.target})"
        if not schema.is_mutable:
            continue
        written = internals.written_arguments(node, schema)
        if any(w in writable for w in written):
            if not all(w in writable for w in written):
                return f"the forward pass writes a variable and another tensor in one operation ({node.target})"
            node.target = _without_grad(node.target)
        elif any(w in args for w in written):
            return f"the forward pass writes a trainable variable or an input in place ({node.target})"
    gm.recompile()
    return None


_WITHOUT_GRAD: dict = {}


def _without_grad(op):
    """``op`` run with gradients off, as Keras's ``Variable.assign`` runs it."""
    wrapper = _WITHOUT_GRAD.get(op)
    if wrapper is None:
        def wrapper(*args, **kwargs):
            with torch.no_grad():
                return op(*args, **kwargs)

        wrapper.__name__ = f"{op.__name__.replace('.', '_')}_without_grad"
        _WITHOUT_GRAD[op] = wrapper
    return wrapper


def _rng_state() -> tuple:
    return torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_state(state: tuple) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _variables(model) -> list:
    """Every variable the forward pass and loss may read or write, the loss's own metrics included."""
    seen: set[int] = set()
    out = []
    for v in [*model.trainable_variables, *model.non_trainable_variables, *model.metrics_variables]:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _variable_values(model) -> list[torch.Tensor]:
    return [v.value for v in _variables(model)]


def _flat_inputs(x, y, sample_weight) -> tuple[list, object]:
    leaves, spec = internals.tree_flatten((x, y, sample_weight))
    return leaves, spec


def _signature(model, leaves: list, spec, values: list) -> tuple | None:
    """What a recording depends on, or None when the inputs are not all tensors."""
    shapes = []
    for leaf in leaves:
        if leaf is None:
            shapes.append(None)
        elif isinstance(leaf, torch.Tensor):
            shapes.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        else:
            return None
    return (str(spec), tuple(shapes), tuple(_unique_positions(leaves)),
            tuple(map(id, values)), id(_compat.compiled_loss(model)))


def _unique_positions(leaves: list) -> list[int]:
    """Positions of the first occurrence of each distinct tensor (``fit(x, x)`` passes one tensor twice)."""
    seen: set[int] = set()
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(i)
    return out


def _same(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(a.detach(), b.detach()))
