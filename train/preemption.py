"""Stopping a run cleanly on SIGTERM and SIGINT, at a step every process
agrees on.

Cluster schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some
time before they kill a job; a person at the terminal sends SIGINT (Ctrl-C).
`StopSignals` turns either into a request to stop: the training loop asks
`should_stop(step)` after every step and, when it says so, saves a
checkpoint of that step and ends the run, which `--resume` then continues.

How the processes agree on the step:

- One process: the signal handler sets a flag that `should_stop` reads; no
  host sync, no collective, nothing per step beyond a Python attribute.
- Several processes (`jax.distributed`): JAX's preemption service
  (`multihost_utils.reached_preemption_sync_point`). `jax.distributed`
  installs its own SIGTERM handler; a notice on any process reaches every
  process through the coordination service, whose background threads agree
  on the step after the fastest process's current one; every process then
  stops at that same step. Each step costs a mutex, not a collective, and a
  SIGTERM sent to only one process still stops them all. SIGINT is handed to
  that service by raising SIGTERM in the process (its handler is JAX's).
  Where the service is off (`jax_enable_preemption_service=False`), the
  processes take the maximum of their flags with a tiny all-gather every
  step instead: correct, at the cost of a host sync per step.

A second signal while the run is stopping (finishing its step or writing
the checkpoint):

- SIGTERM is acknowledged with a line on stderr and otherwise ignored:
  schedulers can deliver it twice (SLURM signals a step and its tasks), and
  the grace period before their SIGKILL is for the save.
- SIGINT, a person pressing Ctrl-C again, ends the process at once
  (`os._exit(130)`), as SIGKILL would: the checkpoint being written is a
  temporary directory that the next run removes; the previous complete
  checkpoint survives (`train.checkpoint`).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from typing import Callable

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# The call counter JAX's preemption service compares across processes: one
# count for the whole process, not the run's step, so that it never goes
# back (`--compare` trains several runs in one process; a notice that
# arrives between two of them must still meet a later call).
_SYNC_CALLS = itertools.count()


def exit_code(sig: int) -> int:
  """The shell's status for a process ended by `sig`: 128 + its number
  (143 for SIGTERM, 130 for SIGINT)."""
  return 128 + int(sig)


class StopSignals:
  """Catches SIGTERM and SIGINT while a run trains (a context manager).

  Every process of a multi-process run must use its `StopSignals` alike:
  the same runs in the same order, `should_stop` after every step.

  Args:
    describe: called with no argument when a second SIGINT ends the
      process, for the line it prints (e.g. which checkpoint survives).

  Attributes:
    signal: the signal that stopped the run (`signal.SIGTERM` or
      `signal.SIGINT`), once `should_stop` has said so; None before. A
      process stopped by another process's notice reports SIGTERM.
    step: the step `should_stop` first said True for; None before.

  Raises:
    ValueError: entered outside the main thread (Python runs signal
      handlers only there).
  """

  def __init__(self, *, describe: Callable[[], str] | None = None):
    self.signal: signal.Signals | None = None
    self.step: int | None = None
    self._describe = describe
    self._received: signal.Signals | None = None
    self._previous = {}
    self._jax_service = False
    self._synced = False

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is not threading.main_thread():
      raise ValueError(
          "handle_signals=True installs SIGTERM and SIGINT handlers, which "
          "Python allows only in the main thread; call Trainer.run from the "
          "main thread or pass handle_signals=False.")
    caught = SIGNALS
    if jax.process_count() > 1:
      try:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        # Raises where the service is off. True: a notice came before this
        # run (e.g. between two runs of `--compare`): stop after one step.
        self._synced = multihost_utils.reached_preemption_sync_point(
            next(_SYNC_CALLS))
        self._jax_service = True
        # SIGTERM stays with JAX's handler, which feeds the service.
        caught = (signal.SIGINT,)
      except RuntimeError:
        self._jax_service = False
    for sig in caught:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    sig = signal.Signals(signum)
    if self._received is None:
      self._received = sig
      if self._jax_service:
        # JAX's SIGTERM handler tells the coordination service; every
        # process then agrees on the step to stop at.
        signal.raise_signal(signal.SIGTERM)
      return
    if sig == signal.SIGINT:
      detail = self._describe() if self._describe is not None else ""
      print(f"second SIGINT: stopped at once, without finishing the "
            f"checkpoint{detail}", file=sys.stderr, flush=True)
      os._exit(exit_code(sig))  # pylint: disable=protected-access
    print(f"{sig.name} again: already stopping; the checkpoint is being "
          f"written (SIGINT or SIGKILL stop at once)", file=sys.stderr,
          flush=True)

  def should_stop(self, step: int) -> bool:
    """Whether to stop after `step` (the number of completed steps).

    Every process must call it after every step, with the same steps: in
    a multi-process run they all return True at the same step.
    """
    if self.signal is not None:
      return True
    if jax.process_count() == 1:
      stop = self._received is not None
    elif self._jax_service:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      stop = self._synced or multihost_utils.reached_preemption_sync_point(
          next(_SYNC_CALLS))
    else:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      flags = multihost_utils.process_allgather(
          np.int32(0 if self._received is None else int(self._received)))
      stop = bool(np.any(flags))
      if stop and self._received is None:
        self._received = signal.Signals(int(np.max(flags)))
    if stop:
      self.signal = self._received or signal.SIGTERM
      self.step = step
    return stop
