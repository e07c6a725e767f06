"""Suite-wide settings."""

from __future__ import annotations

from hypothesis import settings

# Shared 2-core CI machines are noisy: judge properties, not per-example wall time.
settings.register_profile("governor", deadline=None, print_blob=True)
settings.load_profile("governor")
