"""Reading a pod's spec as the kubelet does: `$(VAR)` expansion, container paths rewritten to
the local directories behind them, readiness probe URLs, and the error of a container that
cannot be configured yet."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


class ConfigError(Exception):
    """A container cannot be configured yet (the kubelet's CreateContainerConfigError)."""


def identity(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    """A pod's namespace, name and uid."""
    meta = pod["metadata"]
    return str(meta["namespace"]), str(meta["name"]), str(meta["uid"])


def expand(text: str, lookup: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`,
    anything else (an undefined name, a lone `$`) stays as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            following = text[i + 1]
            if following == "$":
                out.append("$")
                i += 2
                continue
            if following == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(lookup[name] if name in lookup else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


class PathMap:
    """Rewrites container paths (mount paths) to the local directories behind them."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        # Longest first, so a nested mount wins over the mount that contains it.
        self._pairs = sorted(mapping.items(), key=lambda kv: len(kv[0]), reverse=True)
        alternatives = "|".join(re.escape(p.rstrip("/") or "/") for p, _ in self._pairs)
        self._pattern = (
            re.compile(rf"(?<![\w.\-/])({alternatives})(?=/|$|[^\w.\-/])") if self._pairs else None
        )
        self._lookup = {p.rstrip("/") or "/": local for p, local in self._pairs}

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self._lookup[m.group(1)], text)


def readiness_url(container: Mapping[str, Any]) -> str | None:
    """The loopback URL of a container's `httpGet` readiness probe, if it has one."""
    http = (container.get("readinessProbe") or {}).get("httpGet")
    if not http:
        return None
    port = http.get("port")
    if isinstance(port, str) and not port.isdigit():
        named = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
        port = named.get(port)
    path = str(http.get("path") or "/")
    return f"http://127.0.0.1:{port}{path if path.startswith('/') else '/' + path}"
