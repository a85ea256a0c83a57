"""The pinned versions of every binary the local environment builds.

Changing a version here makes the next run build that component again into its own cache
directory; the old build stays until the cache is cleared.
"""

from __future__ import annotations

from typing import Final

KUBERNETES: Final = "v1.34.4"
ETCD: Final = "v3.6.16"
KWOK: Final = "v0.8.0"
HELM: Final = "v3.22.0"

# The Go version the wrapper modules declare; the toolchain on PATH must be at least this new
# (kwok v0.8.0 itself needs Go 1.26).
GO_MINIMUM: Final = "1.26"
