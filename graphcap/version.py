"""graphcap's version, in one place below every module that records it (manifests, the compile cache's key)."""
from __future__ import annotations

VERSION = "0.1.0"
