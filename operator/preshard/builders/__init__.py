"""Pure manifest builders: typed input in, manifest dict out, no I/O."""

from typing import Any

Manifest = dict[str, Any]
"""A Kubernetes object or a part of one, as the API server reads it."""
