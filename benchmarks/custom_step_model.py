"""The built-in convnet with a hand-written ``train_step``, to price a custom step against the built-in one.

    multigpu bench --devices cpu:0 cpu:1 --batch-size 256 --model benchmarks/custom_step_model.py:custom --no-solo
    multigpu bench --devices cpu:0 cpu:1 --batch-size 256 --model benchmarks/custom_step_model.py:builtin --no-solo

``builtin`` is ``multigpu.bench.models.convnet(0.25)`` as it is; ``custom`` is the same network
in a subclass whose ``train_step`` does what Keras's guide for the torch backend writes by hand
(forward, ``compute_loss``, ``backward``, ``optimizer.apply``, ``compute_metrics``).
"""

import keras
import torch

from multigpu.bench.models import convnet


class CustomStep(keras.Model):
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        loss.backward()
        trainable = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in trainable], trainable)
        return self.compute_metrics(x, y, y_pred)


def builtin() -> keras.Model:
    return convnet(0.25)


def custom() -> keras.Model:
    template = convnet(0.25)
    return CustomStep(template.inputs, template.outputs, name="convnet_custom_step")
