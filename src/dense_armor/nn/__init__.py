"""dense_armor's neural toolkit, in layers that import only downwards: `core` (the base classes,
errors and argument checks), `kernels` (the attention functions and their choice) and `state` (the
caches and counters), `layers` (pointwise layers and positions), `mixers` (attention and
recurrent layers), `blocks`, `models` (Sequential, Stack, the factories). Users import from the
faces in `dense_armor.utility.neural`."""
