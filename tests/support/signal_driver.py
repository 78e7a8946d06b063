"""`python -m train` with two hooks, for tests/train/test_preemption.py.

    python tests/support/signal_driver.py [--signal-at STEP:NAME] [--hold STEP:SECONDS]
        -- CLI FLAGS...

runs `train.cli.main(CLI FLAGS)` (the real command line) where

- `--signal-at 5:SIGINT` sends SIGINT to this process when step 5 is done
  (from the loop's own `should_stop` call, so the run stops at exactly that
  step: a test can then catch the save of a step it knows);
- `--hold 4:3` holds the write of the checkpoint of step 4 for 3 seconds
  after every array is written and before orbax renames its temporary
  directory (in `Checkpointer._record_files`, orbax's finalization
  callback), printing `holding the save of step 4` on stdout first: a test
  that reads that line can signal the process while the save is in flight,
  for certain.

Both hooks change no number of the run.
"""

import os
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from train import checkpoint  # pylint: disable=wrong-import-position
from train import cli  # pylint: disable=wrong-import-position
from train import preemption  # pylint: disable=wrong-import-position


def main(argv):
  split = argv.index("--")
  opts, flags = argv[:split], argv[split + 1:]
  hooks = dict(zip(opts[::2], opts[1::2]))
  if "--signal-at" in hooks:
    at, name = hooks["--signal-at"].split(":")
    should_stop = preemption.StopSignals.should_stop

    def signalled(self, step):
      if step == int(at):
        os.kill(os.getpid(), signal.Signals[name])
      return should_stop(self, step)
    preemption.StopSignals.should_stop = signalled
  if "--hold" in hooks:
    step, seconds = hooks["--hold"].split(":")
    record = checkpoint.Checkpointer._record_files  # pylint: disable=protected-access

    def held(self):
      if self._writing == int(step):  # pylint: disable=protected-access
        print(f"holding the save of step {step}", flush=True)
        time.sleep(float(seconds))
      record(self)
    checkpoint.Checkpointer._record_files = held  # pylint: disable=protected-access
  return cli.main(flags)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
