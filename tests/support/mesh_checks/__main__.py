"""`python -m mesh_checks NAME...` (with `tests/support` on the path)."""

import sys

import mesh_checks

if __name__ == "__main__":
  mesh_checks.main(sys.argv[1:] or list(mesh_checks.CHECKS))
