# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""``python -m rpg_research.cli ...``: the same as the ``rpg-trl`` console script."""

from . import main


if __name__ == "__main__":
    raise SystemExit(main())
