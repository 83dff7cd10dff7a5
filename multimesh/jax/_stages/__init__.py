"""mjit's stages: options and checks at the door, then trace, lower, compile, call.

The jax stage protocol (``jax.stages``) for MPMD programs, and the pass pipeline they run."""
