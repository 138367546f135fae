"""``autosp``: LightningCLI with the AutoSP strategy registered.

    autosp fit --config examples/configs/cpu_demo.yaml

``strategy: autosp`` and ``strategy: {class_path: lightning_autosp.AutoSPStrategy, init_args: ...}``
both work, since importing this package registers the strategy. Class paths are imported from the
working directory too, as under ``python -m``: ``class_path: examples.models.LlamaModule`` works from
the repository root.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

import lightning_autosp  # noqa: F401  (registers strategy="autosp")


def main(args: list[str] | None = None) -> None:
    # A console script puts its own bin/ directory on sys.path, not the working directory as
    # `python -m` does, so a config's class paths into the user's project would not import. Lightning
    # relaunches this script for every local rank in the same directory, so each rank gets it too.
    working_dir = os.getcwd()
    if working_dir not in sys.path:
        sys.path.insert(0, working_dir)
    LightningCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
