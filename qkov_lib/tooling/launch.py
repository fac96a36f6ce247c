"""Launch buttons that open a chapter's own source as a notebook (a Sphinx extension).

sphinx-book-theme builds each notebook page's Binder and JupyterHub links from ``_config.yml``
(``launch_buttons``, ``repository``) and points them at the page's source file. A book built from
executed notebooks (``qkov book --mode executed``, what ``make book`` does) has ``.ipynb`` sources
in its staging copy that the repository does not hold: :func:`source_url` points the links at the
chapter's MyST file instead (``book/<chapter>.md``), which the Binder environment (``binder/``)
opens as a notebook through jupytext.

The repository and the hub differ from one deployment to the next, so the environment may set them
at build time (the Pages workflow does): :data:`REPOSITORY_ENV`, :data:`BRANCH_ENV` and
:data:`HUB_ENV` replace ``_config.yml``'s values (:func:`theme_overrides`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPOSITORY_ENV = "QKOV_REPOSITORY_URL"  # e.g. https://github.com/owner/qkov
BRANCH_ENV = "QKOV_REPOSITORY_BRANCH"    # e.g. main
HUB_ENV = "QKOV_JUPYTERHUB_URL"          # a JupyterHub with nbgitpuller, e.g. https://hub.example.edu


def _https(name: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.netloc:
        raise ValueError(f"${name} must be an https:// address, got {url!r}")
    return url.rstrip("/")


def theme_overrides(options: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``html_theme_options`` with the repository address, its branch and the JupyterHub address
    taken from ``environ`` where set (non-empty); ValueError, naming the variable, for an address
    that is not ``https://``. The launch buttons' other settings are kept."""
    out = dict(options)
    if environ.get(REPOSITORY_ENV):
        out["repository_url"] = _https(REPOSITORY_ENV, environ[REPOSITORY_ENV])
    if environ.get(BRANCH_ENV):
        out["repository_branch"] = environ[BRANCH_ENV]
    if environ.get(HUB_ENV):
        out["launch_buttons"] = {**dict(out.get("launch_buttons") or {}),
                                 "jupyterhub_url": _https(HUB_ENV, environ[HUB_ENV])}
    return out


def source_url(url: str, pagename: str) -> str:
    """A launch link ``url`` of page ``pagename`` pointed at ``<pagename>.md`` instead of
    ``<pagename>.ipynb`` (in the link's path, plain or percent-encoded as the JupyterHub link has
    it); any other link unchanged."""
    for sep in ("/", "%2F"):
        name = pagename.replace("/", sep)
        url = url.replace(f"{name}.ipynb", f"{name}.md")
    return url


def _config(app: Any, config: Any) -> None:
    config.html_theme_options = theme_overrides(config.html_theme_options or {}, os.environ)


def _links(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    md = Path(getattr(app.config, "qkov_source_dir", None) or app.srcdir) / f"{pagename}.md"
    if not md.is_file():
        return
    for group in context.get("header_buttons", []):
        if group.get("label") == "launch-buttons":
            for button in group.get("buttons", []):
                if button.get("url"):
                    button["url"] = source_url(button["url"], pagename)


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", _config)
    # after sphinx-book-theme's add_launch_buttons (priority 501)
    app.connect("html-page-context", _links, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
