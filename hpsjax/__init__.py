"""hpsjax: train one JAX model on workers of unequal speed through a parameter server."""

__version__ = "0.1.0"
