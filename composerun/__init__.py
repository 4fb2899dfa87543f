"""composerun: declarative training runs over PyTorch's composable distributed APIs."""

__version__ = "0.1.0"
