"""Where hpsjax is published: one address for the docs, badges and install lines."""

from __future__ import annotations

__all__ = ["REPOSITORY", "REPOSITORY_URL", "colab_badge", "install_spec"]

REPOSITORY = "hpsjax/hpsjax"
"""The GitHub ``owner/name`` the project is published under."""

REPOSITORY_URL = f"https://github.com/{REPOSITORY}"
"""The repository's web address."""

_BRANCH = "main"


def colab_badge(notebook: str) -> str:
    """The markdown "Open in Colab" badge of ``colab/<notebook>``."""
    return (
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{REPOSITORY}/blob/{_BRANCH}"
        f"/colab/{notebook})"
    )


def install_spec(extras: str = "experiments") -> str:
    """The pip requirement that installs hpsjax from the repository."""
    extra = f"[{extras}]" if extras else ""
    return f"hpsjax{extra} @ git+{REPOSITORY_URL}"
