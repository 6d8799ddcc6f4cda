"""The attention functions: materialised (`materialised`), in blocks (`blocked`), through
`jax.nn` (`choice`, which also picks one), and rotary positions (`rotary`)."""
