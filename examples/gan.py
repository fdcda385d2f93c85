"""A small DCGAN on Fashion-MNIST: a custom ``train_step`` with two optimizers, data-parallel.

    KERAS_BACKEND=torch python examples/gan.py                                  # every device, 5 epochs
    KERAS_BACKEND=torch python examples/gan.py --quick                          # under a minute on 2 CPU cores
    KERAS_BACKEND=torch python examples/gan.py --devices cpu:0,cpu:1@0.5 --ratios 2,1

The model is keras.io's "DCGAN overriding train_step" written for the torch backend: the
step draws noise, trains the discriminator on generated and real images with one
optimizer, then the generator through the discriminator with another, each with its own
``backward`` and ``optimizer.apply`` call, and keeps its own loss trackers.  The only
multigpu line is ``multigpu.parallelize(gan, ...)``: every ``optimizer.apply`` call receives
the gradient of the whole global batch (each device's part weighted by its share), and the
logs are the global means, so the script is the one you would write for one device.

At the end rank 0 saves the generator (a plain Keras file) and a grid of generated images
(``--out``, PNG), and prints how often the trained discriminator tells real test images
from generated ones.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
from _common import FASHION_MNIST, add_device_arguments, apply_quick_defaults, read_fashion_mnist
from keras import layers

import multigpu


class GAN(keras.Model):
    """A discriminator and a generator trained in turn by one ``train_step``."""

    def __init__(self, discriminator: keras.Model, generator: keras.Model, latent_dim: int) -> None:
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer: keras.optimizers.Optimizer, g_optimizer: keras.optimizers.Optimizer,
                loss_fn: keras.losses.Loss) -> None:
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return [self.d_loss_tracker, self.g_loss_tracker]

    def call(self, images: torch.Tensor) -> torch.Tensor:
        """The discriminator's verdict on ``images`` (what Keras calls to build the model from a batch)."""
        return self.discriminator(images)

    def train_step(self, real_images: torch.Tensor) -> dict:
        batch = real_images.shape[0]
        # The discriminator: generated images labelled 1, real ones 0 (labels with a little noise).
        z = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        generated = self.generator(z)
        images = torch.cat([generated, real_images], dim=0)
        labels = torch.cat([torch.ones((batch, 1)), torch.zeros((batch, 1))], dim=0)
        labels = labels + 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)
        self.zero_grad()
        d_loss = self.loss_fn(labels, self.discriminator(images))
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        # The generator: its images should be taken for real ones (label 0).
        z = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        self.zero_grad()
        g_loss = self.loss_fn(torch.zeros((batch, 1)), self.discriminator(self.generator(z)))
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)

        self.d_loss_tracker.update_state(d_loss, sample_weight=batch)
        self.g_loss_tracker.update_state(g_loss, sample_weight=batch)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def build(latent_dim: int, width: int) -> tuple[keras.Model, keras.Model]:
    """The discriminator and generator of keras.io's DCGAN, for 28x28x1 images, ``width`` filters wide."""
    discriminator = keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(width, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2D(2 * width, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Flatten(),
        layers.Dropout(0.2),
        layers.Dense(1),  # a logit: > 0 means "generated"
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input((latent_dim,)),
        layers.Dense(7 * 7 * 2 * width),
        layers.Reshape((7, 7, 2 * width)),
        layers.Conv2DTranspose(2 * width, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2DTranspose(width, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2D(1, 5, padding="same", activation="sigmoid"),
    ], name="generator")
    return discriminator, generator


def load_images(rows: int | None) -> tuple[np.ndarray, np.ndarray, str]:
    """Fashion-MNIST train and test images in [0, 1], shape (N, 28, 28, 1); synthetic blobs without it."""
    found = read_fashion_mnist()
    if found is not None:
        (x_train, _), (x_test, _) = found
        source = "Fashion-MNIST"
    else:
        if multigpu.rank() == 0:
            print(f"Fashion-MNIST not used (no IDX files in {' or '.join(FASHION_MNIST)}: apt-get install "
                  "dataset-fashion-mnist); falling back to synthetic images.", flush=True)
        rng = np.random.default_rng(0)
        grid = np.linspace(-1, 1, 28)
        centres = rng.uniform(-0.5, 0.5, size=(8000, 2, 1, 1))
        blobs = np.exp(-((grid[None, None, :] - centres[:, 0]) ** 2 + (grid[None, :, None] - centres[:, 1]) ** 2) * 8)
        x_train, x_test, source = blobs[:6000] * 255, blobs[6000:] * 255, "synthetic"

    def prepare(images: np.ndarray) -> np.ndarray:
        return (images.astype("float32") / 255.0).reshape(-1, 28, 28, 1)

    return prepare(x_train[:rows]), prepare(x_test[:1000]), source


def save_grid(images: np.ndarray, path: str) -> None:
    """Writes a square grid of 28x28 images to ``path`` as PNG."""
    side = int(np.sqrt(len(images)))
    tiles = images[: side * side, :, :, 0].reshape(side, side, 28, 28).transpose(0, 2, 1, 3)
    keras.utils.save_img(path, tiles.reshape(side * 28, side * 28, 1) * 255.0, scale=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p)
    p.add_argument("--epochs", type=int, default=None, help="default 5 (1 with --quick)")
    p.add_argument("--rows", type=int, default=None, help="training images (default all; 2048 with --quick)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width", type=int, default=None, help="filters of the first conv layer (default 64; 16 quick)")
    p.add_argument("--out", default="gan", help="file prefix: OUT-generator.keras and OUT-samples.png")
    p.add_argument("--quick", action="store_true", help="a narrow GAN on few images")
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"epochs": (5, 1), "rows": (None, 2048), "width": (64, 16)})
    if a.epochs < 1 or a.batch_size < 1 or a.width < 1:
        p.error(f"--epochs, --batch-size and --width must be positive. Received: {a.epochs}, {a.batch_size}, "
                f"{a.width}")
    return a


def main() -> None:
    args = parse_args()
    keras.utils.set_random_seed(0)
    latent_dim = 64
    x_train, x_test, source = load_images(args.rows)
    discriminator, generator = build(latent_dim, args.width)
    gan = multigpu.parallelize(GAN(discriminator, generator, latent_dim), devices=args.devices, ratios=args.ratios)
    gan.compile(d_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
                g_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    state = multigpu.state(gan)
    if multigpu.rank() == 0:
        print(f"{multigpu.world_size()} device(s): {', '.join(d.label for d in state.devices)}; "
              f"{len(x_train)} {source} images, global batch {args.batch_size}", flush=True)
    history = gan.fit(x_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2 if multigpu.rank() == 0 else 0)

    if multigpu.rank() == 0:
        d_loss, g_loss = history.history["d_loss"][-1], history.history["g_loss"][-1]
        print(f"final losses: d_loss {d_loss:.4f}, g_loss {g_loss:.4f}")
        z = keras.random.normal((64, latent_dim), seed=7)
        samples = keras.ops.convert_to_numpy(generator(z, training=False))
        # How often the discriminator (a logit, > 0 for "generated") is right on each kind.
        on_real = keras.ops.convert_to_numpy(discriminator(x_test, training=False))
        on_fake = keras.ops.convert_to_numpy(discriminator(samples, training=False))
        print(f"discriminator right on {np.mean(on_real < 0):.0%} of real test images and "
              f"{np.mean(on_fake > 0):.0%} of generated ones")
        generator.save(f"{args.out}-generator.keras")
        save_grid(samples, f"{args.out}-samples.png")
        print(f"saved {args.out}-generator.keras and {args.out}-samples.png")


if __name__ == "__main__":
    main()
