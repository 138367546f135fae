"""Optional dependencies: each is imported only where it is used, and a missing one names its pip extra."""

from __future__ import annotations

import importlib.util


def require(package: str, *, extra: str, needed_by: str, instead: str = "") -> None:
    """Raise ``ModuleNotFoundError`` naming the extra that installs ``package``, if it is not installed.

    Checked without importing it, so a constructor can check what its later hooks will import.
    """
    if importlib.util.find_spec(package) is not None:
        return
    message = (
        f"{needed_by} needs {package}, which is not installed: pip install 'lightning_autosp[{extra}]' "
        f"(in a clone: pip install -e '.[{extra}]')"
    )
    raise ModuleNotFoundError(f"{message}{f', or {instead}' if instead else ''}.", name=package)
