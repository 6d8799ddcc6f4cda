"""Models: `Sequential`, `Stack` (scan over layers), and the encoder and decoder factories."""
