"""dense_armor: shape-typed Equinox modules for attention and sequence models."""

__version__ = "0.1.0"
