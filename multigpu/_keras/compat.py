"""Every Keras internal multigpu uses, in one place, checked against the installed Keras.

Public Keras APIs are used wherever they exist (``keras.utils.unpack_x_y_sample_weight``,
``model.compute_loss``, ``model.metrics``, ``model.compute_metrics``); what has
no public equivalent is reached only through the functions below.  Each one
names the internal it needs; :func:`check` verifies all of them at
``parallelize`` time and fails with the Keras version when one is missing, so
a Keras release that moves an internal gives a clear error instead of a wrong
result.  Tested with Keras 3.10 to 3.15.
"""

from __future__ import annotations

import keras

__all__ = ["TESTED", "DataAdapter", "PyDatasetAdapter", "batchnorm_axes", "batchnorm_moments",
           "call_has_training_arg", "check", "compile_metrics", "compute_loss", "flatten_layers", "in_symbolic_scope",
           "keras_version", "loss_tracker", "named_results", "optimizer_variables", "own_trainable_variables",
           "replace_batchnorm_moments", "seed_variables", "silence_backup_saving", "symbolic_build"]

TESTED = ((3, 10), (3, 17))  # [first, last) minor versions the suite ran with (make compat); pyproject.toml agrees

# Every internal the accessors below reach, as (owner, attribute, backends or None for all), declared by
# ``@_uses`` on the accessor itself; :func:`check` verifies each on a small object of its owner's kind, and
# ``tests/test_layers.py`` checks that every ``._name`` in this file and every name the package's ledgers
# set on a Keras object is declared here.
INTERNALS: list[tuple[str, str, tuple[str, ...] | None]] = []
# The public names the steps rely on, checked alike (the JAX steps' own where Keras's JAX trainer has them).
_PUBLIC = [*(("Model", a, None) for a in ("compute_metrics", "get_metrics_result", "train_step")),
           ("Optimizer", "apply", None), ("Model", "compute_loss_and_updates", ("jax",)),
           ("compiled Model", "metrics_variables", ("jax",))]
_CHECKED = False


def _uses(owner: str, *attributes: str, backends: tuple[str, ...] | None = None):
    """Declares the Keras internals (``owner``'s ``attributes``) the decorated accessor reaches."""
    def declare(fn):
        INTERNALS.extend((owner, a, backends) for a in attributes)
        return fn
    return declare

try:  # the base class Keras accepts as input as-is (get_data_adapter returns it unchanged)
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter
except ImportError as exc:  # pragma: no cover - depends on the Keras release
    DataAdapter = None  # type: ignore[assignment,misc]
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

try:  # runs a PyDataset with its own workers (Keras's enqueuer), for multigpu's background readers
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
except ImportError as exc:  # pragma: no cover - depends on the Keras release
    PyDatasetAdapter = None  # type: ignore[assignment,misc]
    _IMPORT_ERROR = _IMPORT_ERROR or exc


def keras_version() -> tuple[int, int]:
    """Keras's (major, minor) version."""
    parts = keras.__version__.split(".")
    return int(parts[0]), int(parts[1])


def check() -> None:
    """Fails clearly when this Keras lacks an internal multigpu needs (every one in :data:`INTERNALS`, looked up
    on small objects of its owner's kind, once per process).

    Raises:
        RuntimeError: naming the Keras version and the missing piece.
    """
    global _CHECKED
    if _CHECKED:
        return
    missing = []
    if _IMPORT_ERROR is not None:
        missing.append(f"keras.src.trainers.data_adapters' DataAdapter and PyDatasetAdapter ({_IMPORT_ERROR})")
    backend = keras.backend.backend()
    wanted = [(owner, a) for owner, a, backends in [*_PUBLIC, *INTERNALS] if backends is None or backend in backends]
    probes: dict[str, list] = {}
    for owner, attribute in dict.fromkeys(wanted):
        if owner not in probes:
            try:
                probes[owner] = _probes(owner)
            except Exception:  # the probe itself needs an internal that moved
                probes[owner] = []
        if not probes[owner] or not all(hasattr(p, attribute) for p in probes[owner]):
            missing.append(f"{owner}.{attribute}")
    if missing:
        raise RuntimeError(
            f"multigpu needs Keras internals that Keras {keras.__version__} does not have: {', '.join(missing)}. "
            f"multigpu is tested with Keras {_tested()}; install one of those (pip install '{_requirement()}')."
        )
    _CHECKED = True
    if not TESTED[0] <= keras_version() < TESTED[1]:
        import warnings

        warnings.warn(f"multigpu is tested with Keras {_tested()}; this is Keras {keras.__version__}.",
                      stacklevel=3)


def _probes(owner: str) -> list:
    """Small objects of ``owner``'s kind to look internals up on (classes where the internal is a method, built
    instances where it is set when built or compiled); empty where the kind itself moved."""
    import numpy as np

    if owner == "Model":
        return [keras.Model]
    if owner in ("compiled Model", "CompileMetrics"):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        symbolic_build(model, (np.zeros((2, 2), "float32"), np.zeros((2, 1), "float32")))
        return [model] if owner == "compiled Model" else [m for m in model.metrics if type(m).__name__ == owner]
    if owner == "Optimizer":
        optimizer = keras.optimizers.SGD()
        optimizer.build([keras.Variable(np.zeros(1, "float32"))])
        return [optimizer]
    if owner == "accumulating Optimizer":
        optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
        optimizer.build([keras.Variable(np.zeros(1, "float32"))])
        return [optimizer]
    if owner == "Variable":
        return [keras.Variable(np.zeros(1, "float32"))]
    if owner == "Layer":
        return [keras.layers.Dense(1)]
    if owner == "BatchNormalization":
        layer = keras.layers.BatchNormalization()
        layer.build((None, 2))
        return [layer]
    if owner == "BackupAndRestore":
        return [keras.callbacks.BackupAndRestore("multigpu-probe")]
    if owner == "torch optimizers":
        return list(torch_optimizer_classes().values())
    raise ValueError(f"unknown owner of Keras internals: {owner!r}")


def _tested() -> str:
    return f"{TESTED[0][0]}.{TESTED[0][1]} to {TESTED[1][0]}.{TESTED[1][1] - 1}"


def _requirement() -> str:
    return f"keras>={TESTED[0][0]}.{TESTED[0][1]},<{TESTED[1][0]}.{TESTED[1][1]}"


@_uses("Model", "_compute_loss")
def compute_loss(model, x, y, y_pred, sample_weight, training: bool = True):
    """``model.compute_loss`` (respecting overrides), as Keras's own steps call it.

    ``Model._compute_loss`` passes ``training`` only to overrides that take it
    (the argument came in Keras 3.3).
    """
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


@_uses("Model", "_compute_loss")
def wrap_compute_loss(model, wrapper) -> None:
    """Replaces the model's ``_compute_loss`` (what Keras's steps call) by ``wrapper(_compute_loss)``."""
    object.__setattr__(model, "_compute_loss", wrapper(model._compute_loss))


@_uses("Model", "_symbolic_build")
def symbolic_build(model, data_batch) -> None:
    """Builds ``model``'s layers, compiled metrics and loss and its optimizer from a batch's shapes, as Keras's
    torch and JAX ``fit`` do before the first step (``Trainer._symbolic_build``)."""
    model._symbolic_build(data_batch=data_batch)


@_uses("compiled Model", "_loss_tracker")
def loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` log (``Trainer._loss_tracker``), or None."""
    return getattr(model, "_loss_tracker", None)


@_uses("compiled Model", "_compile_metrics")
def compile_metrics(model):
    """The metrics given to ``compile`` (``Trainer._compile_metrics``), or None."""
    return getattr(model, "_compile_metrics", None)


@_uses("CompileMetrics", "_flat_metrics", "_flat_weighted_metrics")
def named_results(metric) -> list[tuple[str, object]] | None:
    """The (name, inner metric) pairs of ``metric.result()``'s dict, for Keras's ``CompileMetrics``.

    The names follow ``CompileMetrics.result`` (the output's name first,
    ``_1``, ``weighted_`` for a clash).  ``None`` for any other metric, or a
    ``CompileMetrics`` of unknown shape: the caller then calls ``result()``.
    A caller must check the names once against ``result()`` itself.
    """
    if type(metric).__name__ != "CompileMetrics" or not getattr(metric, "built", False):
        return None
    flat, weighted = getattr(metric, "_flat_metrics", None), getattr(metric, "_flat_weighted_metrics", None)
    if flat is None or weighted is None:
        return None
    out: list[tuple[str, object]] = []
    counters: dict[str, int] = {}
    for lists, is_weighted in ((flat, False), (weighted, True)):
        for mls in lists:
            if not mls:
                continue
            prefix = f"{mls.output_name}_" if mls.output_name else ""
            for m in mls.metrics:
                name = prefix + m.name
                if name not in counters:
                    counters[name] = 1
                elif not is_weighted:
                    counters[name] += 1
                    name = f"{name}_{counters[name] - 1}"
                else:
                    name = f"{prefix}weighted_{m.name}"
                    if name not in counters:
                        counters[name] = 1
                    else:
                        counters[name] += 1
                        name = f"{name}_{counters[name] - 1}"
                out.append((name, m))
    return out


@_uses("compiled Model", "_call_has_training_arg")
def call_has_training_arg(model) -> bool:
    """Whether ``model.call`` takes ``training`` (``Layer._call_has_training_arg``)."""
    return bool(getattr(model, "_call_has_training_arg", True))


@_uses("Model", "_flatten_layers")
def flatten_layers(model) -> list:
    """Every layer nested in ``model`` (``Layer._flatten_layers``)."""
    return list(model._flatten_layers(include_self=False))


@_uses("Layer", "_trainable_variables")
def own_trainable_variables(layer) -> list:
    """The trainable variables ``layer`` made itself, not its sublayers' (``Layer._trainable_variables``)."""
    return [v for v in layer._trainable_variables if v.trainable]


def in_symbolic_scope() -> bool:
    """Whether Keras is inferring shapes (``compute_output_spec``: no value is read)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope as inside

    return inside()


@_uses("BatchNormalization", "_moments")
def batchnorm_moments(layer):
    """The ``(inputs, mask) -> (mean, variance)`` a ``BatchNormalization`` layer trains with (``_moments``)."""
    return layer._moments


@_uses("BatchNormalization", "_reduction_axes")
def batchnorm_axes(layer) -> list[int]:
    """The axes a ``BatchNormalization`` layer reduces over (``_reduction_axes``, set when it is built)."""
    return list(layer._reduction_axes)


@_uses("BatchNormalization", "_moments")
def replace_batchnorm_moments(layer, moments, ledger) -> None:
    """Makes ``layer`` train with ``moments(inputs, mask) -> (mean, variance)`` instead of its own (noted in the
    model's ``ledger``)."""
    ledger.set(layer, "_moments", moments)


@_uses("Model", "_update_metrics_variables", backends=("jax",))
def update_metrics_variables(model, metrics_variables, unscaled_loss, x, y, y_pred, sample_weight):
    """Keras's JAX trainer's stateless metric update (``_update_metrics_variables``): ``(logs, new states)``."""
    return model._update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)


@_uses("Optimizer", "_trainable_variables")
def optimizer_variables(optimizer) -> list:
    """The variables an optimizer was built with (``Optimizer._trainable_variables``)."""
    return list(optimizer._trainable_variables)


# The optimizer's own lists that are not per-variable state to shard: the variables themselves, and the EMA's
# averages (kept whole on every rank: :mod:`multigpu.backend.sharding`).
_NOT_SLOTS = ("_trainable_variables", "_variables", "_model_variables_moving_average")


@_uses("Optimizer", "_trainable_variables")
def optimizer_slot_lists(optimizer) -> list[list]:
    """The optimizer's per-variable state: every list it holds of one state variable (or None) per variable
    it was built with, in their order (momenta, Adam's moments, gradient accumulators; not EMA averages)."""
    built = list(optimizer._trainable_variables)
    out = []
    for name, value in vars(optimizer).items():
        if name in _NOT_SLOTS or not isinstance(value, list) or len(value) != len(built) or not built:
            continue
        # a state variable of another rank's part is of no elements on JAX (its shape follows its value)
        if all(s is None or (isinstance(s, keras.Variable) and tuple(s.shape) in (tuple(v.shape), (0,)))
               for s, v in zip(value, built)) and any(s is not None for s in value):
            out.append(value)
    return out


@_uses("Optimizer", "_backend_apply_gradients")
def backend_apply_gradients(optimizer):
    """Keras's own update of ``optimizer`` after its gradients are filtered and unscaled
    (``_backend_apply_gradients``: clipping, weight decay, accumulation, the update step, the EMA)."""
    return type(optimizer)._backend_apply_gradients.__get__(optimizer)


def clip_by_global_norm(grads: list, clip_norm: float) -> list:
    """Keras's own clipping by the global norm (``keras.src.optimizers.base_optimizer.clip_by_global_norm``)."""
    from keras.src.optimizers.base_optimizer import clip_by_global_norm as keras_clip

    return keras_clip(grads, clip_norm)


@_uses("Optimizer", "_update_model_variables_moving_average", "_overwrite_model_variables_with_average_value")
def update_ema(optimizer) -> None:
    """Keras's EMA step after an update (the end of ``_backend_apply_gradients``, before the iteration count
    moves): the averages of every variable, and the variables overwritten by them every
    ``ema_overwrite_frequency`` steps (a condition on tensors, as Keras writes it: it may run traced)."""
    variables = optimizer._trainable_variables
    optimizer._update_model_variables_moving_average(variables)
    frequency = optimizer.ema_overwrite_frequency
    if frequency:
        keras.ops.cond((optimizer.iterations + 1) % frequency == 0,
                       lambda: optimizer._overwrite_model_variables_with_average_value(variables), lambda: None)


@_uses("Optimizer", "_iterations")
def applied_steps(optimizer) -> int:
    """How many times ``apply`` ran (``_iterations``: with gradient accumulation ``iterations`` counts updates)."""
    return int(keras.ops.convert_to_numpy(optimizer._iterations))


@_uses("Optimizer", "_backend_reset_gradient_accumulators")
@_uses("accumulating Optimizer", "_accumulated_gradients")
def reset_held_accumulators(optimizer, held) -> None:
    """Keras's reset of the gradient accumulators after an accumulated update
    (``_backend_reset_gradient_accumulators``), for the accumulators ``held(accumulator)`` says this process
    holds: an optimizer in parts lets go of the others' storage (:mod:`multigpu.backend.sharding`)."""
    for accumulator in optimizer._accumulated_gradients:
        if accumulator is not None and held(accumulator):
            accumulator.assign(keras.ops.zeros(accumulator.shape, dtype=accumulator.dtype))


@_uses("Variable", "_value", backends=("torch", "tensorflow"))
def set_variable_storage(variable, storage) -> None:
    """Gives a Keras variable ``storage`` (a ``torch.nn.Parameter``, a ``tf.Variable``) in place of its own, of
    another size where it may be (an empty one lets go of its memory; the variable's Keras ``shape`` stays)."""
    variable._value = storage


@_uses("Variable", "_value", "_shape", "_ndim", backends=("jax",))
def set_jax_variable_value(variable, value) -> None:
    """Gives a JAX Keras variable ``value`` of another shape (no elements: a part not held), its shape with it."""
    variable._value = value
    variable._shape = tuple(value.shape)
    variable._ndim = len(value.shape)


@_uses("torch optimizers", "_parallel_update_step", backends=("torch",))
def update_step_owner(optimizer):
    """The class whose ``_parallel_update_step`` (Keras's torch optimizers' update) ``optimizer`` runs, or None."""
    for cls in type(optimizer).__mro__:
        if "_parallel_update_step" in vars(cls):
            return cls
    return None


def torch_optimizer_classes() -> dict:
    """Keras's torch optimizer classes by name (``keras.src.backend.torch.optimizers``); empty if moved."""
    try:
        from keras.src.backend.torch.optimizers import torch_adam, torch_rmsprop, torch_sgd
    except ImportError:
        return {}

    return {"SGD": torch_sgd.SGD, "RMSprop": torch_rmsprop.RMSprop, "Adam": torch_adam.Adam}


@_uses("Optimizer", "_get_variable_index")
def optimizer_slot(optimizer, name: str, variable):
    """The optimizer's state variable ``name`` (``"_velocities"``, ...) for ``variable`` (``_get_variable_index``)."""
    return getattr(optimizer, name)[optimizer._get_variable_index(variable)]


def seed_variables(model) -> list:
    """The random-seed state variables of ``model``'s layers (Dropout and friends)."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


@_uses("BackupAndRestore", "_save_model", "_weights_path", "delete_checkpoint")
def silence_backup_saving(callback, ledger) -> None:
    """Makes a ``BackupAndRestore`` restore but never write (``_save_model``, ``delete_checkpoint``); it still
    calls the model's ``save_weights`` where Keras would (written on rank 0, every rank waits there for it)."""

    def save_nothing_but_wait(*args, **kwargs) -> None:
        callback.model.save_weights(filepath=callback._weights_path, overwrite=True)

    if not ledger.owns(callback, "_save_model"):
        ledger.set(callback, "_save_model", save_nothing_but_wait)
        ledger.set(callback, "delete_checkpoint", False)


@_uses("compiled Model", "_compile_loss")
def compiled_loss(model):
    """The loss object ``compile`` built (``Trainer._compile_loss``), or None."""
    return getattr(model, "_compile_loss", None)
