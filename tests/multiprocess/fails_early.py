"""2 processes under jax.distributed; process $CULPRIT fails at $WHEN, the other waits.

``WHEN``: ``before-init`` (raises before ``jax.distributed.initialize()``),
``during-init`` (its ``initialize`` times out: the peer comes 60 s late),
``after-init`` (raises after it, before any multimesh program, while the peer waits in
a cross-process barrier), ``exit0-before-init`` (exits with code 0 without joining),
``exit1-after-init`` (``sys.exit(1)`` after it, while the peer waits in a barrier),
``exit0-after-init`` (exits with code 0 right after it, before setting up its devices,
so the peer waits for its topology).
Every process prints its pid first, and the culprit the time it fails (but for
``during-init``, where jax's fatal log line gives the time).
"""

import os
import sys
import time

me = int(os.environ["MULTIMESH_LAUNCH_PROCESS_ID"])
CULPRIT, WHEN = int(os.environ["CULPRIT"]), os.environ["WHEN"]
print(f"pid {os.getpid()}", flush=True)


def fail(how):
    print(f"fails at {time.time():.3f}", flush=True)
    if how == "exit0":
        sys.exit(0)
    if how == "exit1":
        sys.exit(1)
    raise ValueError(f"process {me} fails {WHEN}")


if me == CULPRIT and WHEN in ("before-init", "exit0-before-init"):
    fail("exit0" if WHEN.startswith("exit0") else "raise")
if me != CULPRIT and WHEN == "during-init":
    time.sleep(60)

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

if me == CULPRIT and WHEN == "during-init":  # jax aborts the process (its log says when)
    jax.distributed.initialize(initialization_timeout=3)
jax.distributed.initialize()
if me == CULPRIT and WHEN == "after-init":
    fail("raise")
if me == CULPRIT and WHEN in ("exit1-after-init", "exit0-after-init"):
    fail(WHEN[:5])
multihost_utils.sync_global_devices("everyone")  # waits for the culprit
print("the peer never got here", flush=True)
