"""``autosp``: LightningCLI with the AutoSP strategy registered.

    autosp fit --config examples/configs/cpu_demo.yaml

``strategy: autosp`` and ``strategy: {class_path: lightning_autosp.AutoSPStrategy, init_args: ...}``
both work, since importing this package registers the strategy.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_autosp  # noqa: F401  (registers strategy="autosp")


def main(args: list[str] | None = None) -> None:
    LightningCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
