"""fashionjax: train and evaluate Fashion-MNIST classifiers with JAX and Optax, honestly measured."""

__version__ = "0.2.0"
